"""A checkpoint's tokenizer and chat template, as an OpenAI-compatible server needs them.

The served models ship their tokenizers in two formats, and the server should
not care which:

- ``tokenizer.json`` (DeepSeek-V3, GLM 5), read by Hugging Face ``tokenizers``;
  its special tokens are the tokenizer's added tokens.
- ``tiktoken.model`` (Kimi K2), a BPE rank table read by ``tiktoken`` with the
  pre-tokenisation regex of Kimi's ``tokenization_kimi.py``; its special tokens
  are listed in ``tokenizer_config.json``'s ``added_tokens_decoder``.

A directory with both is read through ``tokenizer.json``. :class:`Tokenizer` is
one interface over both. The stop ids come from ``generation_config.json``,
else ``config.json``, else the ``eos_token`` string, the order transformers'
generation uses. The chat template is rendered the way transformers renders it
(same sandbox, options, filters and globals), so a prompt here matches one
built by the model's reference tokenizer byte for byte.

Neither torch nor transformers is needed, and no JAX is imported.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import functools
import json
import operator
import os
import re

import jinja2
import jinja2.ext
import jinja2.sandbox
import tiktoken
import tokenizers

# Kimi K2's pre-tokenisation regex, copied from its tokenization_kimi.py. The
# `&&` class intersections are supported by tiktoken's engine (fancy-regex over
# Rust's regex crate): Han characters are split from other letters.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


class TokenizerError(ValueError):
  """A tokenizer file that cannot be read: malformed, inconsistent or unsupported."""


class ChatTemplateError(ValueError):
  """A chat template that is missing, does not compile, or refused the messages."""


class _HFBackend:
  """``tokenizer.json`` through Hugging Face ``tokenizers``."""

  kind = "tokenizers"

  def __init__(self, hf: tokenizers.Tokenizer):
    self.hf = hf
    vocab = hf.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values(), default=-1) + 1
    valid = bytearray(self.vocab_size)
    for i in vocab.values():
      valid[i] = 1
    self.valid = bytes(valid)
    self.special_ids = frozenset(i for i, t in hf.get_added_tokens_decoder().items() if t.special)
    # Byte-fallback tokens (<0xNN>) decode to U+FFFD one per token when their run is not valid
    # UTF-8, so a run's text is known only once it ends (mlkit.text.detok).
    decoder = hf.decoder.__getstate__() if hf.decoder is not None else b""
    self.byte_ids = frozenset()
    if b'"ByteFallback"' in decoder:
      self.byte_ids = frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))

  def encode(self, text: str, add_special_tokens: bool) -> list[int]:
    return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self.hf.token_to_id(token)

  def raw_token(self, token_id: int) -> str:
    return self.hf.id_to_token(token_id)


class _TiktokenBackend:
  """Kimi's ``tiktoken.model`` through ``tiktoken``."""

  kind = "tiktoken"

  def __init__(self, enc: tiktoken.Encoding, ids, special_ids: frozenset[int]):
    self.enc = enc
    self.vocab_size = enc.n_vocab
    valid = bytearray(self.vocab_size)
    for i in ids:  # the ranks and the added tokens' ids
      valid[i] = 1
    self.valid = bytes(valid)
    self.special_ids = special_ids

  def encode(self, text: str, add_special_tokens: bool) -> list[int]:
    del add_special_tokens  # none to add: Kimi's TikTokenTokenizer has no post-processor
    return self.enc.encode(text, allowed_special="all", disallowed_special=())

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    if skip_special_tokens:
      ids = [i for i in ids if i not in self.special_ids]
    return self.enc.decode(ids, errors="replace")

  def token_bytes(self, token_id: int) -> bytes:
    return self.enc.decode_single_token_bytes(token_id)

  def raw_token(self, token_id: int) -> str:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token_id))

  def token_to_id(self, token: str) -> int | None:
    try:
      return self.enc.encode_single_token(token)
    except KeyError:
      return None


class Tokenizer:
  """One checkpoint's tokenizer, whichever file it came from.

  Made by :func:`load_tokenizer`. Thread-safe for reading: nothing changes after loading.

  Attributes:
    path: the checkpoint directory.
    backend: ``"tokenizers"`` (tokenizer.json) or ``"tiktoken"`` (tiktoken.model).
    vocab_size: the largest id the tokenizer can produce or decode, plus one
      (special tokens included). The model's vocabulary may be larger (padded).
    eos_token_ids: the ids that end generation, from generation_config.json,
      else config.json, else the eos_token string; empty when none is known.
    bos_token: the beginning-of-sequence token's text, or None.
    eos_token: the end-of-sequence token's text, or None.
    chat_template: the default chat template's source, or None.
  """

  def __init__(self, backend, *, path: str, bos_token: str | None, eos_token: str | None,
               eos_token_ids: tuple[int, ...], chat_templates: dict[str, str],
               template_source: str | None):
    self._backend = backend
    self.path = path
    self.backend = backend.kind
    self.vocab_size = backend.vocab_size
    self.bos_token = bos_token
    self.eos_token = eos_token
    self.eos_token_ids = eos_token_ids
    self._templates = chat_templates
    self._template_source = template_source
    self.chat_template = chat_templates.get("default")

  def __repr__(self) -> str:
    return (f"Tokenizer(path={self.path!r}, backend={self.backend!r}, "
            f"vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})")

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """The ids of ``text``.

    Special tokens written literally in the text (``<|im_start|>`` in a rendered
    chat prompt) become their special ids.

    Args:
      text: the text.
      add_special_tokens: whether to add the tokenizer's own framing (a BOS, by
        tokenizer.json's post-processor); the tiktoken backend adds none.

    Raises:
      TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode takes a string, got {type(text).__name__}")
    return self._backend.encode(text, add_special_tokens)

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    """The text of ``ids``; invalid UTF-8 becomes U+FFFD.

    Raises:
      ValueError: an id the tokenizer does not have.
    """
    ids = [self.check_id(i) for i in ids]
    return self._backend.decode(ids, skip_special_tokens)

  def check_id(self, token_id) -> int:
    """``token_id`` as an int, after checking the tokenizer can decode it.

    Raises:
      ValueError: an id outside the tokenizer's vocabulary.
      TypeError: not an integer.
    """
    i = operator.index(token_id)
    if not (0 <= i < self.vocab_size and self._backend.valid[i]):
      raise ValueError(f"token id {i} is not in the tokenizer of {self.path} "
                       f"(vocab_size {self.vocab_size})")
    return i

  @property
  def impl(self):
    """The backend object (``tokenizers`` or ``tiktoken``), for streaming detokenisation."""
    return self._backend

  def token_to_id(self, token: str) -> int | None:
    """The id of a single token's text (special tokens included), or None."""
    return self._backend.token_to_id(token)

  def token_text(self, token_id: int) -> str:
    """One token as text for display (log-probabilities): its decoded text when that is whole
    UTF-8, else its raw vocabulary entry (``tokenizers``) or ``bytes:\\xNN...`` (``tiktoken``),
    so that two tokens never show as the same replacement character.

    Raises:
      ValueError: an id the tokenizer does not have.
    """
    text = self.decode([token_id], skip_special_tokens=False)
    return self._backend.raw_token(token_id) if "\ufffd" in text else text

  def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None,
                          **extra) -> str:
    """Renders ``messages`` with the checkpoint's chat template, as transformers does.

    The template sees ``messages``, ``add_generation_prompt``, ``tools``,
    ``bos_token``, ``eos_token`` and every extra keyword (``enable_thinking``...).
    When ``tools`` are given and the checkpoint names a ``tool_use`` template, that
    one is used.

    Args:
      messages: a list of ``{"role": ..., "content": ...}`` dicts.
      add_generation_prompt: whether to end with the assistant's turn header.
      tools: JSON-schema tool definitions, passed to the template as they are.
      **extra: more template variables.

    Returns:
      The prompt text; encode it with :meth:`encode` (add_special_tokens=False).

    Raises:
      ChatTemplateError: the checkpoint ships no chat template, the template does
        not compile, fails, or calls ``raise_exception``.
    """
    name = "tool_use" if tools and "tool_use" in self._templates else "default"
    template = self._templates.get(name)
    if template is None and self._templates:
      raise ChatTemplateError(f"the checkpoint {self.path} names no default chat template "
                              f"({self._template_source} has {sorted(self._templates)})")
    if template is None:
      raise ChatTemplateError(f"the checkpoint {self.path} ships no chat template (neither "
                              "chat_template.jinja nor tokenizer_config.json's chat_template)")
    compiled = _compile_template(template, self._template_source)
    variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra,
                 "messages": messages, "tools": tools,
                 "add_generation_prompt": add_generation_prompt}
    try:
      return compiled.render(**variables)
    except ChatTemplateError:
      raise
    except Exception as e:  # a template is code: any failure is the template's, not the server's
      raise ChatTemplateError(f"the chat template ({self._template_source}) failed: "
                              f"{type(e).__name__}: {e}") from e


def _raise_exception(message):
  raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(format):  # pylint: disable=redefined-builtin
  return datetime.datetime.now().strftime(format)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' tojson: jinja's own escapes HTML characters, which prompts must not have.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


@functools.lru_cache(maxsize=16)
def _compile_template(template: str, source: str | None) -> jinja2.Template:
  try:
    return _jinja_env().from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ChatTemplateError(f"the chat template ({source}) does not compile: line "
                            f"{e.lineno}: {e.message}") from e


def _read_json(path: str) -> dict | None:
  """A JSON object file's contents, None when it does not exist."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise TokenizerError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise TokenizerError(f"{path} holds a JSON {type(data).__name__}, not an object")
  return data


def _token_text(value, path: str, field: str) -> str | None:
  """A special token given as a string or as an AddedToken dict ({"content": ...})."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, dict) and isinstance(value.get("content"), str):
    return value["content"]
  raise TokenizerError(f"{path}: {field} must be a string or a dict with a string 'content', "
                       f"got {value!r}")


def _eos_ids(value, path: str) -> tuple[int, ...]:
  items = value if isinstance(value, list) else [value]
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
    raise TokenizerError(f"{path}: eos_token_id must be a non-negative int or a list of them, "
                         f"got {value!r}")
  return tuple(dict.fromkeys(items))


def _chat_templates(checkpoint_dir: str, config: dict, config_path: str):
  """The named templates and where they came from; chat_template.jinja wins, as in transformers."""
  jinja_path = os.path.join(checkpoint_dir, "chat_template.jinja")
  if os.path.isfile(jinja_path):
    try:
      with open(jinja_path, encoding="utf-8") as f:
        return {"default": f.read()}, jinja_path
    except (OSError, UnicodeDecodeError) as e:
      raise TokenizerError(f"{jinja_path} cannot be read: {e}") from e
  value = config.get("chat_template")
  if value is None:
    return {}, None
  if isinstance(value, str):
    return {"default": value}, config_path
  if isinstance(value, list) and all(
      isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
      for t in value):
    return {t["name"]: t["template"] for t in value}, config_path
  raise TokenizerError(f"{config_path}: chat_template must be a string or a list of "
                       "{'name', 'template'} dicts")


def _read_tiktoken_ranks(path: str) -> dict[bytes, int]:
  """The ``base64token rank`` lines of a tiktoken file.

  Read here rather than by tiktoken.load.load_tiktoken_bpe, which caches every
  file it reads in a temp folder keyed by the path alone: a checkpoint rewritten
  in place would be read stale.
  """
  ranks: dict[bytes, int] = {}
  try:
    with open(path, "rb") as f:
      for lineno, line in enumerate(f, 1):
        parts = line.split()
        if not parts:
          continue
        if len(parts) != 2:
          raise TokenizerError(f"{path}:{lineno}: expected `base64token rank`, got {line[:80]!r}")
        try:
          token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (binascii.Error, ValueError) as e:
          raise TokenizerError(f"{path}:{lineno}: expected `base64token rank`: {e}") from e
        if token in ranks or rank < 0:
          raise TokenizerError(f"{path}:{lineno}: token {token!r} repeated or rank {rank} < 0")
        ranks[token] = rank
  except OSError as e:
    raise TokenizerError(f"{path} cannot be read: {e}") from e
  if not ranks:
    raise TokenizerError(f"{path} holds no tokens")
  if len(set(ranks.values())) != len(ranks):
    raise TokenizerError(f"{path}: two tokens share a rank")
  return ranks


def _kimi_specials(config: dict, config_path: str, ranks: dict[bytes, int]):
  """Kimi's special tokens: tokenizer_config.json's added_tokens_decoder, after the BPE ranks."""
  table = config.get("added_tokens_decoder") or {}
  if not isinstance(table, dict):
    raise TokenizerError(f"{config_path}: added_tokens_decoder must be an object")
  rank_ids = set(ranks.values())
  specials: dict[str, int] = {}
  skipped = set()
  for key, entry in table.items():
    try:
      i = int(key)
    except ValueError:
      raise TokenizerError(
          f"{config_path}: added_tokens_decoder key {key!r} is not an id") from None
    content = entry.get("content") if isinstance(entry, dict) else None
    if not isinstance(content, str) or not content:
      raise TokenizerError(f"{config_path}: added_tokens_decoder[{key}] has no string 'content'")
    if i in rank_ids or i < 0:
      raise TokenizerError(f"{config_path}: added token {content!r} has id {i}, which the BPE "
                           "ranks of tiktoken.model already use")
    if content in specials:
      raise TokenizerError(f"{config_path}: added token {content!r} is listed twice")
    specials[content] = i
    if entry.get("special", False):
      skipped.add(i)
  return specials, frozenset(skipped)


def _load_backend(checkpoint_dir: str, config: dict, config_path: str):
  """The backend for the directory's tokenizer file, or None when it has none."""
  json_path = os.path.join(checkpoint_dir, "tokenizer.json")
  tiktoken_path = os.path.join(checkpoint_dir, "tiktoken.model")
  if os.path.isfile(json_path):
    try:
      return _HFBackend(tokenizers.Tokenizer.from_file(json_path))
    except Exception as e:  # tokenizers raises plain Exception for a malformed file
      raise TokenizerError(f"{json_path} is not a valid tokenizers file: {e}") from e
  if os.path.isfile(tiktoken_path):
    ranks = _read_tiktoken_ranks(tiktoken_path)
    specials, skipped = _kimi_specials(config, config_path, ranks)
    try:
      enc = tiktoken.Encoding(name=f"kimi:{tiktoken_path}", pat_str=KIMI_PAT_STR,
                              mergeable_ranks=ranks, special_tokens=specials)
    except Exception as e:
      raise TokenizerError(f"{tiktoken_path} cannot be loaded by tiktoken: {e}") from e
    return _TiktokenBackend(enc, [*ranks.values(), *specials.values()], skipped)
  if os.path.isfile(os.path.join(checkpoint_dir, "tokenizer.model")):
    raise TokenizerError(f"{checkpoint_dir} ships only tokenizer.model (SentencePiece), which is "
                         "not supported: a tokenizer.json or tiktoken.model is needed")
  return None


def load_tokenizer(checkpoint_dir: str) -> Tokenizer | None:
  """The tokenizer a checkpoint directory ships, or None when it ships none.

  Reads tokenizer.json (preferred) or tiktoken.model, with tokenizer_config.json
  (special tokens, chat template), special_tokens_map.json, chat_template.jinja,
  generation_config.json and config.json when present.

  Args:
    checkpoint_dir: a Hugging Face style checkpoint directory.

  Raises:
    FileNotFoundError: ``checkpoint_dir`` is not a directory.
    TokenizerError: a malformed or inconsistent file (the message names it), or
      only an unsupported SentencePiece tokenizer.model.
  """
  if not os.path.isdir(checkpoint_dir):
    raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")
  config_path = os.path.join(checkpoint_dir, "tokenizer_config.json")
  config = _read_json(config_path) or {}
  backend = _load_backend(checkpoint_dir, config, config_path)
  if backend is None:
    return None

  map_path = os.path.join(checkpoint_dir, "special_tokens_map.json")
  special_map = _read_json(map_path) or {}
  names = {}
  for field in ("bos_token", "eos_token"):
    names[field] = (_token_text(config.get(field), config_path, field)
                    or _token_text(special_map.get(field), map_path, field))

  eos_ids: tuple[int, ...] = ()
  gen_path = os.path.join(checkpoint_dir, "generation_config.json")
  model_path = os.path.join(checkpoint_dir, "config.json")
  model_config = _read_json(model_path) or {}
  text_config = model_config.get("text_config")  # multimodal checkpoints nest the LM's config
  for path, source in ((gen_path, _read_json(gen_path) or {}), (model_path, model_config),
                       (model_path, text_config if isinstance(text_config, dict) else {})):
    if source.get("eos_token_id") is not None:
      eos_ids = _eos_ids(source["eos_token_id"], path)
      break
  else:
    eos_id = backend.token_to_id(names["eos_token"]) if names["eos_token"] else None
    eos_ids = () if eos_id is None else (eos_id,)

  templates, template_source = _chat_templates(checkpoint_dir, config, config_path)
  return Tokenizer(backend, path=checkpoint_dir, bos_token=names["bos_token"],
                   eos_token=names["eos_token"], eos_token_ids=eos_ids,
                   chat_templates=templates, template_source=template_source)
