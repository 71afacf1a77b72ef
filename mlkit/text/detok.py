"""Streaming text out of generated ids: incremental detokenisation and stop strings.

A streamed response sends text as tokens arrive, but a token's text is not
always final when it arrives: a byte-level token may carry half of a UTF-8
character (an emoji or a CJK character spans up to four byte tokens), and text
that might begin a stop string must not be sent before it is known not to be
one. Both classes here hold text back exactly as long as it can still change,
so that what a client receives over the stream is what a non-streamed response
would have held:

- :class:`IncrementalDetokenizer`: every ``add`` delta plus ``flush()`` equals
  ``tokenizer.decode(all_ids)``. The tokenizers backend uses
  ``tokenizers.decoders.DecodeStream``, fed a byte-fallback run (``<0xNN>``
  tokens) at a time; the tiktoken backend runs each token's bytes through an
  incremental UTF-8 decoder with the same ``errors="replace"`` as tiktoken's
  ``decode``.
- :class:`StopMatcher`: holds back the longest tail that could begin a stop
  string, and cuts the text before the first stop string.

Imports no JAX.
"""

from __future__ import annotations

import array
import codecs

from tokenizers import decoders

from mlkit.text.tokenizer import Tokenizer

MAX_STOP_STRINGS = 16  # more than OpenAI's 4: the server may add the model's own
MAX_STOP_LENGTH = 256  # characters per stop string


class IncrementalDetokenizer:
  """The text of generated ids, one id at a time, never taking back what it emitted.

  Example::

    detok = IncrementalDetokenizer(tokenizer)
    for token_id in generated:
      send(detok.add(token_id))
    send(detok.flush())

  Args:
    tokenizer: the checkpoint's tokenizer.
    skip_special_tokens: leave out special tokens' text, as ``decode`` does.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    backend = tokenizer.impl
    self._backend = backend
    self._skip = backend.special_ids if skip_special_tokens else frozenset()
    self._done = False
    if backend.kind == "tiktoken":
      self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    else:
      # Skipped special ids never reach the stream (decode drops them before its decoder
      # too), so the stream decodes with skip_special_tokens=False.
      self._stream = decoders.DecodeStream(skip_special_tokens=False)
      self._ids = array.array("q")  # every id the stream saw, for the exact tail at flush()
      self._run: list[int] = []  # byte-fallback ids not yet given to the stream
      self._emitted = 0  # characters emitted so far

  def add(self, token_id) -> str:
    """Takes the next generated id and returns the new text that can no longer change.

    Returns "" while the text is incomplete (part of a UTF-8 character).

    Raises:
      ValueError: an id the tokenizer does not have, or ``flush`` was called.
    """
    if self._done:
      raise ValueError("IncrementalDetokenizer.add after flush()")
    i = self._tokenizer.check_id(token_id)
    if i in self._skip:
      return ""
    if self._backend.kind == "tiktoken":
      return self._utf8.decode(self._backend.token_bytes(i))
    self._ids.append(i)
    if i in self._backend.byte_ids:
      # ByteFallback turns every token of a run that is not valid UTF-8 into U+FFFD, even
      # the valid ones before the bad byte: a run's text is final only when the run ends.
      self._run.append(i)
      return ""
    text = self._stream.step(self._backend.hf, self._run + [i]) or ""
    self._run = []
    self._emitted += len(text)
    return text

  def flush(self) -> str:
    """The text held back at the end of generation (an incomplete character as U+FFFD).

    After it, the detokenizer takes no more ids.
    """
    if self._done:
      return ""
    self._done = True
    if self._backend.kind == "tiktoken":
      return self._utf8.decode(b"", final=True)
    full = self._backend.decode(self._ids.tolist(), skip_special_tokens=False)
    return full[self._emitted:]


class StopMatcher:
  """Cuts streamed text at the first stop string, holding back only what could begin one.

  The stop string itself is never emitted. Stop strings are matched in the
  text as it streams, across deltas; when several appear, the one that ends
  first counts (of two ending together, the one that starts first).

  Args:
    stop_strings: None, one string, or a sequence of at most
      :data:`MAX_STOP_STRINGS` non-empty strings of at most
      :data:`MAX_STOP_LENGTH` characters.

  Raises:
    ValueError: a stop string that is not a non-empty string, too long, or too many.
  """

  def __init__(self, stop_strings=None):
    if stop_strings is None:
      stop_strings = []
    elif isinstance(stop_strings, str):
      stop_strings = [stop_strings]
    elif not isinstance(stop_strings, (list, tuple)):
      raise ValueError(f"stop must be a string or a list of strings, got "
                       f"{type(stop_strings).__name__}")
    if len(stop_strings) > MAX_STOP_STRINGS:
      raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop_strings)}")
    for s in stop_strings:
      if not isinstance(s, str) or not s:
        raise ValueError(f"stop: every stop string must be a non-empty string, got {s!r}")
      if len(s) > MAX_STOP_LENGTH:
        raise ValueError(f"stop: a stop string is {len(s)} characters; at most "
                         f"{MAX_STOP_LENGTH} are allowed")
    self.stop_strings = tuple(dict.fromkeys(stop_strings))
    # Every proper prefix of a stop string: the tails that must wait for more text.
    self._prefixes = {s[:k] for s in self.stop_strings for k in range(1, len(s))}
    self._longest = max((len(s) for s in self.stop_strings), default=0)
    self._pending = ""
    self.stopped = False

  def feed(self, delta: str) -> tuple[str, bool]:
    """Takes the next piece of text.

    Returns:
      ``(emit_text, stopped)``: the text now safe to send, and whether a stop
      string appeared (then ``emit_text`` ends just before it, and generation
      should end). After a stop, every call returns ``("", True)``.
    """
    if self.stopped:
      return "", True
    text = self._pending + delta
    # The stop that completes first wins (the longer one when two end together), so the
    # result does not depend on how the text was cut into deltas.
    hits = [(i + len(s), i) for s in self.stop_strings if (i := text.find(s)) >= 0]
    if hits:
      self._pending = ""
      self.stopped = True
      return text[:min(hits)[1]], True
    hold = 0
    for k in range(min(len(text), self._longest - 1), 0, -1):
      if text[-k:] in self._prefixes:
        hold = k
        break
    self._pending = text[len(text) - hold:]
    return text[:len(text) - hold], False

  def flush(self) -> str:
    """The text held back, when generation ended without a stop string ("" after a stop)."""
    text, self._pending = self._pending, ""
    return text
