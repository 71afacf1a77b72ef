"""The OpenAI-compatible request and response shapes: parsing into engine requests, and back.

Kept free of HTTP machinery so that it can be read and tested alone:

* :func:`parse_completion` / :func:`parse_chat` check a request body field by
  field and turn it into a :class:`Plan`: token ids per choice and a
  ``SamplingParams`` per choice. Anything the caller got wrong raises
  :class:`ApiError` naming the field (``param``), which the server answers with
  400 and OpenAI's error shape.
* :class:`ChoiceText` turns one choice's token updates into text deltas:
  incremental detokenisation (multi-byte characters are never split), stop
  strings (never emitted; text is held back only while it could still begin
  one), and log-probabilities in the completions or chat format.

What follows OpenAI's API, and what is vLLM's extension of it, is noted at each field.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from mlkit.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per request
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP_STRINGS = 16


class ApiError(Exception):
  """A request the server refuses, in OpenAI's error shape.

  Args:
    status: the HTTP status (4xx for what the caller did, 503 when the server is busy).
    message: what is wrong and how to fix it.
    param: the request field at fault, or None.
    type: OpenAI's error type.
    code: a short machine-readable code, or None.
  """

  def __init__(self, status: int, message: str, param: str | None = None,
               type: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Context:
  """What request checking needs to know about the served model.

  Attributes:
    model: the served model's name (``model`` must name it).
    vocab_size: token ids must be below it.
    max_tokens: the longest sequence (prompt + output) a request may reach.
    max_logprobs: the most top log-probabilities the engine computes (0: none).
    tokenizer: an ``mlkit.text.Tokenizer``, or None (token-id prompts only).
  """

  model: str
  vocab_size: int
  max_tokens: int
  max_logprobs: int
  tokenizer: Any = None


@dataclasses.dataclass
class Plan:
  """A checked request: what to submit, and how to answer.

  Attributes:
    kind: "completion" or "chat".
    prompts: token ids per prompt.
    n: choices per prompt; choice ``i * n + j`` is prompt i's j-th.
    samplings: SamplingParams per choice.
    stream / include_usage: server-sent events, with a final usage chunk.
    stop_strings: text that ends a choice (never emitted).
    logprobs: top alternatives per token to report, or None for no log-probabilities.
    skip_special_tokens: leave special tokens out of the text.
  """

  kind: str
  prompts: list[list[int]]
  n: int
  samplings: list[SamplingParams]
  stream: bool
  include_usage: bool
  stop_strings: list[str]
  logprobs: int | None
  skip_special_tokens: bool = True

  @property
  def choice_prompts(self) -> list[list[int]]:
    return [p for p in self.prompts for _ in range(self.n)]


# ------------------------------------------------------------------ field checks
def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, name: str, default, lo: int, hi: int | None = None):
  v = body.get(name, default)
  if v is None:
    return default
  if not _is_int(v) or v < lo or (hi is not None and v > hi):
    rng = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    raise ApiError(400, f"'{name}' must be {rng}, got {v!r}", name)
  return v


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open=False) -> float:
  v = body.get(name, default)
  if v is None:
    return default
  if not _is_num(v) or v != v or v > hi or v < lo or (lo_open and v == lo):
    raise ApiError(400, f"'{name}' must be a number in {'(' if lo_open else '['}{lo}, {hi}], "
                   f"got {v!r}", name)
  return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
  v = body.get(name, default)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise ApiError(400, f"'{name}' must be true or false, got {v!r}", name)
  return v


def _unsupported(body: dict, ctx: Context) -> None:
  """Fields we do not implement must be absent or at their neutral value."""
  for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("echo", False),
                        ("suffix", None), ("logit_bias", None), ("best_of", None)):
    v = body.get(name)
    if v is not None and v != neutral and not (name == "logit_bias" and v == {}):
      raise ApiError(400, f"'{name}' is not supported by this server", name)
  if body.get("best_of") not in (None, body.get("n", 1)):
    raise ApiError(400, "'best_of' is not supported by this server", "best_of")
  fmt = body.get("response_format")
  if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", None)):
    raise ApiError(400, "'response_format' other than text is not supported", "response_format")
  model = body.get("model")
  if model is not None and model != ctx.model:
    raise ApiError(404, f"the model {model!r} does not exist; this server serves {ctx.model!r}",
                   "model", type="not_found_error", code="model_not_found")


def _token_list(v, ctx: Context, param: str) -> list[int]:
  if not v:
    raise ApiError(400, f"'{param}' must not be empty", param)
  bad = next((t for t in v if not _is_int(t) or not 0 <= t < ctx.vocab_size), None)
  if bad is not None:
    raise ApiError(400, f"'{param}' holds {bad!r}, not a token id in [0, {ctx.vocab_size})", param)
  return list(v)


def _encode(text: str, ctx: Context, param: str, add_special_tokens: bool) -> list[int]:
  if ctx.tokenizer is None:
    raise ApiError(400, f"'{param}' is text, but this model's checkpoint ships no tokenizer: "
                   "send token ids instead", param)
  ids = ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)
  if not ids:
    raise ApiError(400, f"'{param}' encodes to no tokens", param)
  return ids


def _stops(body: dict, ctx: Context) -> tuple[list[str], tuple[int, ...]]:
  stop = body.get("stop")
  strings = [stop] if isinstance(stop, str) else stop if stop is not None else []
  if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
    raise ApiError(400, "'stop' must be a non-empty string or a list of them", "stop")
  if len(strings) > MAX_STOP_STRINGS or any(len(s) > 256 for s in strings):
    raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most 256 "
                   "characters", "stop")
  if strings and ctx.tokenizer is None:
    raise ApiError(400, "'stop' strings need a tokenizer, and this model's checkpoint ships "
                   "none: use 'stop_token_ids'", "stop")
  ids = body.get("stop_token_ids") or []  # vLLM's extension
  if not isinstance(ids, list):
    raise ApiError(400, "'stop_token_ids' must be a list of token ids", "stop_token_ids")
  ids = _token_list(ids, ctx, "stop_token_ids") if ids else []
  eos = () if _bool(body, "ignore_eos", False) or ctx.tokenizer is None else (
      ctx.tokenizer.eos_token_ids)
  return strings, tuple(dict.fromkeys([*ids, *eos]))


def _samplings(body: dict, ctx: Context, prompts: list[list[int]], n: int, max_new: int | None,
               stop_ids: tuple[int, ...], logprobs: int | None) -> list[SamplingParams]:
  temperature = _num(body, "temperature", 1.0, 0.0, 100.0)
  top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
  top_k = body.get("top_k", 0)  # vLLM's extension; -1 or 0 disables
  if top_k is None or top_k == -1:
    top_k = 0
  if not _is_int(top_k) or not 0 <= top_k <= ctx.vocab_size:
    raise ApiError(400, f"'top_k' must be -1, 0 or an integer in [1, {ctx.vocab_size}]", "top_k")
  seed = body.get("seed")
  if seed is not None and not _is_int(seed):
    raise ApiError(400, f"'seed' must be an integer, got {seed!r}", "seed")
  out = []
  for p in prompts:
    room = ctx.max_tokens - len(p)
    if room < 1:
      raise ApiError(400, f"the prompt has {len(p)} tokens; this server holds at most "
                     f"{ctx.max_tokens} tokens per sequence, prompt and output together",
                     "messages" if "messages" in body else "prompt", code="context_length_exceeded")
    want = room if max_new is None else max_new
    if want > room:
      raise ApiError(400, f"the prompt ({len(p)} tokens) plus max_tokens ({want}) exceeds the "
                     f"{ctx.max_tokens} tokens this server holds per sequence",
                     "max_tokens", code="context_length_exceeded")
    for j in range(n):
      # n > 1 with a seed: each choice its own stream; without one, a fresh seed each.
      s = (seed + j) % (1 << 32) if seed is not None else secrets.randbits(32)
      out.append(SamplingParams(max_new_tokens=want, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=s, stop_tokens=stop_ids, logprobs=logprobs))
  return out


def _common(body, ctx: Context) -> tuple[int, bool, bool]:
  """The fields both endpoints take: (n, stream, include_usage)."""
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  _unsupported(body, ctx)
  n = _int(body, "n", 1, 1, MAX_N)
  stream = _bool(body, "stream", False)
  opts = body.get("stream_options")
  if opts is not None and (not isinstance(opts, dict) or not stream):
    raise ApiError(400, "'stream_options' is a map, and only allowed with stream: true",
                   "stream_options")
  include_usage = bool(opts and _bool(opts, "include_usage", False))
  return n, stream, include_usage


def _max_new(body: dict, default: int | None) -> int | None:
  name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  return _int(body, name, default, 1)


def _check_logprobs(k: int | None, ctx: Context, param: str) -> None:
  if k is not None and k > ctx.max_logprobs:
    raise ApiError(400, f"'{param}' is {k}; this server returns at most {ctx.max_logprobs} "
                   "top log-probabilities" if ctx.max_logprobs else
                   f"'{param}': this server computes no log-probabilities", param)


def parse_completion(body: Any, ctx: Context) -> Plan:
  """``POST /v1/completions``: ``prompt`` as a string, strings, token ids or lists of them.

  Raises:
    ApiError: naming the field at fault.
  """
  n, stream, include_usage = _common(body, ctx)
  prompt = body.get("prompt")
  if isinstance(prompt, str):
    prompts = [_encode(prompt, ctx, "prompt", True)]
  elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
    prompts = [_token_list(prompt, ctx, "prompt")]
  elif isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS and all(
      isinstance(p, str) for p in prompt):
    prompts = [_encode(p, ctx, "prompt", True) for p in prompt]
  elif isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS and all(
      isinstance(p, list) for p in prompt):
    prompts = [_token_list(p, ctx, "prompt") for p in prompt]
  else:
    raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids, or a "
                   f"list of such lists (at most {MAX_PROMPTS} prompts)", "prompt")
  lp = body.get("logprobs")
  if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
    raise ApiError(400, f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
  _check_logprobs(lp, ctx, "logprobs")
  strings, stop_ids = _stops(body, ctx)
  samplings = _samplings(body, ctx, prompts, n, _max_new(body, 16), stop_ids, lp)
  return Plan("completion", prompts, n, samplings, stream, include_usage, strings, lp,
              _bool(body, "skip_special_tokens", True))


def parse_chat(body: Any, ctx: Context) -> Plan:
  """``POST /v1/chat/completions``: ``messages`` rendered with the checkpoint's chat template.

  Raises:
    ApiError: naming the field at fault.
  """
  n, stream, include_usage = _common(body, ctx)
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
    raise ApiError(400, "'messages' must be a non-empty list of objects with a 'role'", "messages")
  for i, m in enumerate(messages):
    c = m.get("content")
    if isinstance(c, list):  # content parts: text only
      if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                 for p in c):
        raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
      m = dict(m, content="".join(p["text"] for p in c))
      messages[i] = m
    elif c is not None and not isinstance(c, str):
      raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                     "messages")
  if ctx.tokenizer is None:
    raise ApiError(400, "chat needs a tokenizer and a chat template, and this model's checkpoint "
                   "ships no tokenizer: use /v1/completions with token ids", "messages")
  tools = body.get("tools")
  if tools is not None and not isinstance(tools, list):
    raise ApiError(400, "'tools' must be a list", "tools")
  extra = body.get("chat_template_kwargs") or {}  # vLLM's extension
  if not isinstance(extra, dict):
    raise ApiError(400, "'chat_template_kwargs' must be a map", "chat_template_kwargs")
  from mlkit.text import ChatTemplateError
  try:
    text = ctx.tokenizer.apply_chat_template(
        messages, add_generation_prompt=_bool(body, "add_generation_prompt", True), tools=tools,
        **extra)
  except ChatTemplateError as e:
    raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
  prompts = [_encode(text, ctx, "messages", False)]
  want = _bool(body, "logprobs", False)
  top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
  if top is not None and not want:
    raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
  lp = (top or 0) if want else None
  _check_logprobs(lp, ctx, "top_logprobs")
  strings, stop_ids = _stops(body, ctx)
  samplings = _samplings(body, ctx, prompts, n, _max_new(body, None), stop_ids, lp)
  return Plan("chat", prompts, n, samplings, stream, include_usage, strings, lp,
              _bool(body, "skip_special_tokens", True))


# ------------------------------------------------------------------ text out
class ChoiceText:
  """One choice's text as its tokens arrive: detokenised incrementally, stop strings applied.

  Args:
    plan: the request's Plan (stop strings, log-probabilities, format).
    tokenizer: an ``mlkit.text.Tokenizer`` or None (then the text stays empty and
      tokens are reported as ``token_id:N``).
  """

  def __init__(self, plan: Plan, tokenizer):
    from mlkit.text import IncrementalDetokenizer, StopMatcher
    self.plan = plan
    self.tokenizer = tokenizer
    self.detok = (IncrementalDetokenizer(tokenizer, skip_special_tokens=plan.skip_special_tokens)
                  if tokenizer is not None else None)
    self.stops = StopMatcher(plan.stop_strings) if plan.stop_strings else None
    self.tokens: list[int] = []
    self.text = ""
    self.finish_reason: str | None = None
    self.stopped = False  # a stop string matched: later tokens are dropped

  def feed(self, tokens, logprobs) -> tuple[str, list, list[int]]:
    """The text, log-probability entries and token ids of newly arrived tokens (what may be
    sent now; tokens past a stop string are dropped)."""
    if self.stopped:
      return "", [], []
    out, entries, first = [], [], len(self.tokens)
    for i, t in enumerate(tokens):
      self.tokens.append(int(t))
      # An id only the model has (a padded vocabulary) has no text.
      delta = self.detok.add(int(t)) if self.detok is not None and self._known(int(t)) else ""
      if logprobs is not None and self.plan.logprobs is not None:
        entries.append(self._entry(int(t), logprobs[i]))
      if self.stops is not None:
        delta, hit = self.stops.feed(delta)
        if hit:
          out.append(delta)
          self.stopped, self.finish_reason = True, "stop"
          break
      out.append(delta)
    text = "".join(out)
    self.text += text
    return text, entries, self.tokens[first:]

  def finish(self, reason: str | None) -> str:
    """The held-back text once the choice ended (empty after a stop string)."""
    if self.finish_reason is None:
      self.finish_reason = reason
    if self.stopped:
      return ""
    tail = self.detok.flush() if self.detok is not None else ""
    if self.stops is not None:
      tail, hit = self.stops.feed(tail)
      if hit:
        self.stopped, self.finish_reason = True, "stop"
        self.text += tail
        return tail
      tail += self.stops.flush()
    self.text += tail
    return tail

  def token_text(self, t: int) -> str:
    if self.tokenizer is None or not self._known(t):
      return f"token_id:{t}"
    return self.tokenizer.token_text(t)

  def _known(self, t: int) -> bool:
    """Whether the tokenizer has ``t`` (a model's vocabulary may be padded past it)."""
    try:
      self.tokenizer.check_id(t)
      return True
    except ValueError:
      return False

  def _entry(self, token: int, lp) -> dict:
    chosen, ids, lps = lp
    if self.plan.kind == "chat":
      def one(t, v):
        s = self.token_text(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
      return {**one(token, chosen), "top_logprobs": [one(t, v) for t, v in zip(ids, lps)]}
    return {"token": self.token_text(token), "logprob": chosen,
            "top": {self.token_text(t): v for t, v in zip(ids, lps)}}


def completion_logprobs(entries: list[dict], offset: int) -> dict:
  """Completions' ``logprobs`` object from a choice's entries (``offset``: text before them)."""
  tokens = [e["token"] for e in entries]
  offsets, pos = [], offset
  for t in tokens:
    offsets.append(pos)
    pos += len(t)
  return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
          "top_logprobs": [e["top"] for e in entries], "text_offset": offsets}
