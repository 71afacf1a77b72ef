"""A load generator and benchmark for any OpenAI-compatible server: ``python -m mlkit.serve.bench``.

    python -m mlkit.serve.bench --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --random-input-len 1024 --random-output-len 128 --request-rate 8 --ignore-eos
    python -m mlkit.serve.bench --base-url http://127.0.0.1:8000 --concurrency-sweep 1,4,16,32

It measures what a user of the server sees, in the manner of ``vllm bench
serve``, so that the same command compares mlkit with vLLM, SGLang or any other
server on the same prompts: every request is streamed, and the time to the
first token (TTFT), the gaps between tokens (ITL), the time per output token
(TPOT) and the end-to-end latency are read from the arrival of the server-sent
events, with throughput over the whole run.

Random prompts are token ids (``prompt: [ids]``), so that their length is
exact whatever the server's tokenizer, and they differ from each other so that
a prefix cache does not shorten them. Arrivals are Poisson at ``--request-rate``
from a fixed seed, so two runs send the same load.

Imports no JAX (plain Python, aiohttp and numpy): it runs on any machine that can
reach the server, and adds nothing to the server's process.

The library entry points are :func:`run_benchmark` / :func:`benchmark` (one
run) and :func:`run_sweep` / :func:`sweep` (one run per concurrency); the
pieces (:class:`SSEParser`, :func:`compute_metrics`, :func:`arrival_times`,
:func:`build_prompts`) are pure and tested alone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import time
import urllib.parse
from typing import Any, Mapping, Sequence

import aiohttp
import numpy as np

PROG = "python -m mlkit.serve.bench"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PERCENTILES = (("median", 50.0), ("p90", 90.0), ("p99", 99.0))
LATENCIES = ("ttft", "tpot", "itl", "e2e")

# Words for random chat prompts (chat takes text): common, short, and one token each in
# most English tokenizers, so that N words are close to N tokens.
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city name team minute idea kid body back parent "
    "face others level office door health person art war history party result change morning "
    "reason research girl guy moment air teacher force education").split()


class ServerUnreachable(ConnectionError):
  """The server did not answer at all (nothing listening, wrong host, refused connection)."""


# --------------------------------------------------------------------------------------------
# Configuration


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  """One benchmark (or one concurrency sweep): where, what and how fast.

  Attributes:
    base_url: the server's root, ``http://HOST:PORT`` (a trailing ``/v1`` is dropped);
      requests go to ``{base_url}/v1/completions`` or ``/v1/chat/completions``.
    endpoint: "completions" or "chat".
    model: the ``model`` field of every request; None: the first id that
      ``GET {base_url}/v1/models`` lists.
    api_key: sent as ``Authorization: Bearer``; None: no header. Never written to results.
    num_prompts: requests in a run; None: 100 random prompts, or every prompt of
      ``prompts_file`` (more than the file holds: its prompts again, in order).
    request_rate: requests per second, Poisson arrivals; ``math.inf``: all at once.
    max_concurrency: the most requests in flight (later arrivals wait); None: no cap.
    concurrency_sweep: one run per value, each with rate inf and that max concurrency
      (``request_rate`` and ``max_concurrency`` must then be left at their defaults).
    random_input_len: tokens per random prompt (words, with ``endpoint="chat"``).
    random_output_len: ``max_tokens`` of random prompts, and of a prompts file's
      prompts that give no ``output_len``.
    random_vocab_size: random prompts' token ids are drawn uniformly from [0, this).
    prompts_file: a JSON Lines file of ``{"prompt": str or [ids], "output_len": int}``,
      or a text file with one prompt per line; None: random prompts.
    ignore_eos: send ``ignore_eos: true`` (vLLM's extension) so that every output has
      its full length.
    temperature: the sampling temperature of every request.
    seed: seeds the random prompts and the arrival times.
    timeout_s: the longest one request may take, streaming included.
    extra_body: fields added to every request body (e.g. ``{"return_token_ids": true}``).
    output_json: where :func:`run_benchmark` / :func:`run_sweep` write their result;
      None: nowhere.
    progress_interval_s: seconds between progress lines on stderr; 0: none.

  Raises:
    ValueError: a field out of range; the message names it.
  """

  base_url: str
  endpoint: str = "completions"
  model: str | None = None
  api_key: str | None = None
  num_prompts: int | None = None
  request_rate: float = math.inf
  max_concurrency: int | None = None
  concurrency_sweep: tuple[int, ...] = ()
  random_input_len: int = 1024
  random_output_len: int = 128
  random_vocab_size: int = 256
  prompts_file: str | None = None
  ignore_eos: bool = False
  temperature: float = 0.0
  seed: int = 0
  timeout_s: float = 600.0
  extra_body: Mapping[str, Any] | None = None
  output_json: str | None = None
  progress_interval_s: float = 5.0

  def __post_init__(self):
    def bad(field: str, want: str):
      raise ValueError(f"BenchConfig.{field} must be {want}, got {getattr(self, field)!r}")

    if not isinstance(self.base_url, str):
      bad("base_url", "a string http://HOST:PORT")
    url = self.base_url.strip().rstrip("/")
    if url.endswith("/v1"):
      url = url[:-3]
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
      bad("base_url", "http://HOST:PORT or https://HOST:PORT")
    object.__setattr__(self, "base_url", url)
    if self.endpoint not in ENDPOINTS:
      bad("endpoint", f"one of {sorted(ENDPOINTS)}")
    if self.model is not None and (not isinstance(self.model, str) or not self.model):
      bad("model", "a non-empty string or None")
    if self.api_key is not None and not isinstance(self.api_key, str):
      raise ValueError("BenchConfig.api_key must be a string or None")
    if self.num_prompts is not None and (not _is_int(self.num_prompts) or self.num_prompts < 1):
      bad("num_prompts", "an integer >= 1 or None")
    if (not _is_number(self.request_rate) or math.isnan(self.request_rate)
        or self.request_rate <= 0):
      bad("request_rate", "a number > 0 (requests per second; inf: all at once)")
    if self.max_concurrency is not None and (not _is_int(self.max_concurrency)
                                             or self.max_concurrency < 1):
      bad("max_concurrency", "an integer >= 1 or None")
    try:
      sweep = tuple(self.concurrency_sweep)
    except TypeError:
      sweep = None
    if sweep is None or not all(_is_int(c) and c >= 1 for c in sweep):
      bad("concurrency_sweep", "a sequence of integers >= 1")
    object.__setattr__(self, "concurrency_sweep", tuple(int(c) for c in sweep))
    if sweep and (self.max_concurrency is not None or self.request_rate != math.inf):
      raise ValueError("BenchConfig.concurrency_sweep sets each run's max_concurrency and its "
                       "request rate (inf): leave max_concurrency and request_rate unset")
    for name in ("random_input_len", "random_output_len", "random_vocab_size"):
      if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
        bad(name, "an integer >= 1")
    if self.prompts_file is not None:
      if not isinstance(self.prompts_file, (str, os.PathLike)):
        bad("prompts_file", "a path or None")
      if not os.path.isfile(self.prompts_file):
        bad("prompts_file", "an existing file")
    if not isinstance(self.ignore_eos, bool):
      bad("ignore_eos", "True or False")
    if (not _is_number(self.temperature) or not math.isfinite(self.temperature)
        or self.temperature < 0):
      bad("temperature", "a finite number >= 0")
    if not _is_int(self.seed) or self.seed < 0:
      bad("seed", "an integer >= 0")
    if not _is_number(self.timeout_s) or not self.timeout_s > 0:
      bad("timeout_s", "a number of seconds > 0")
    if self.extra_body is not None and not isinstance(self.extra_body, Mapping):
      bad("extra_body", "a mapping of request fields or None")
    if self.output_json is not None and not isinstance(self.output_json, (str, os.PathLike)):
      bad("output_json", "a path or None")
    if (not _is_number(self.progress_interval_s) or math.isnan(self.progress_interval_s)
        or self.progress_interval_s < 0):
      bad("progress_interval_s", "a number of seconds >= 0")

  def settings(self) -> dict:
    """The fields as JSON-ready values, without the API key (only whether one was given)."""
    out = {}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name == "api_key":
        out["api_key_given"] = v is not None
        continue
      out[f.name] = _json_ready(v)
    return out


def _json_ready(v):
  """Plain JSON values: tuples as lists, inf as "inf" (JSON has no infinity), paths as strings."""
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)
  if isinstance(v, (tuple, list)):
    return [_json_ready(x) for x in v]
  if isinstance(v, Mapping):
    return {str(k): _json_ready(x) for k, x in v.items()}
  if isinstance(v, os.PathLike):
    return os.fspath(v)
  if isinstance(v, np.generic):
    return v.item()
  return v


# --------------------------------------------------------------------------------------------
# Prompts and arrivals


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One request's prompt.

  Attributes:
    prompt: text, or a list of token ids.
    output_len: the request's ``max_tokens``.
    prompt_len: the prompt's length in tokens where known (token ids), else None.
  """

  prompt: str | list[int]
  output_len: int
  prompt_len: int | None = None


def random_token_prompts(n: int, input_len: int, output_len: int, vocab_size: int,
                         seed: int) -> list[Prompt]:
  """``n`` prompts of exactly ``input_len`` token ids drawn uniformly from [0, vocab_size)."""
  rng = np.random.default_rng((seed, 0))
  ids = rng.integers(0, vocab_size, size=(n, input_len))
  return [Prompt(row.tolist(), output_len, input_len) for row in ids]


def random_word_prompts(n: int, input_len: int, output_len: int, seed: int) -> list[Prompt]:
  """``n`` prompts of ``input_len`` random words (for chat, which takes text)."""
  rng = np.random.default_rng((seed, 0))
  picks = rng.integers(0, len(_WORDS), size=(n, input_len))
  return [Prompt(" ".join(_WORDS[i] for i in row), output_len) for row in picks]


def load_prompts_file(path: str, default_output_len: int) -> list[Prompt]:
  """The prompts of a JSON Lines file or a text file with one prompt per line.

  A file is JSON Lines when its name ends with ``.jsonl`` or its first non-blank line
  is a JSON object; each line is then ``{"prompt": str or [ids], "output_len": int}``
  (``output_len`` optional: ``default_output_len``). Blank lines are skipped.

  Raises:
    ValueError: an unreadable line (its number is given), or no prompts at all.
    OSError: the file cannot be read.
  """
  path = os.fspath(path)
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  first = next((ln for ln in lines if ln.strip()), None)
  if first is None:
    raise ValueError(f"{path}: no prompts in the file")
  jsonl = path.endswith(".jsonl")
  if not jsonl and first.lstrip().startswith("{"):
    try:
      jsonl = isinstance(json.loads(first), dict)
    except ValueError:
      jsonl = False
  prompts = []
  for no, line in enumerate(lines, 1):
    if not line.strip():
      continue
    if not jsonl:
      prompts.append(Prompt(line, default_output_len))
      continue
    try:
      obj = json.loads(line)
    except ValueError as e:
      raise ValueError(f"{path}:{no}: not JSON ({e})") from None
    if not isinstance(obj, dict) or "prompt" not in obj:
      raise ValueError(f"{path}:{no}: each line must be an object with a 'prompt'")
    p = obj["prompt"]
    if isinstance(p, str):
      if not p:
        raise ValueError(f"{path}:{no}: 'prompt' is empty")
      plen = None
    elif isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p):
      plen = len(p)
    else:
      raise ValueError(f"{path}:{no}: 'prompt' must be a non-empty string or a non-empty "
                       "list of token ids (integers >= 0)")
    out = obj.get("output_len", default_output_len)
    if not _is_int(out) or out < 1:
      raise ValueError(f"{path}:{no}: 'output_len' must be an integer >= 1, got {out!r}")
    prompts.append(Prompt(p, int(out), plen))
  return prompts


def build_prompts(config: BenchConfig) -> list[Prompt]:
  """The prompts of one run: ``config.num_prompts`` of them, from the file or random.

  Raises:
    ValueError: a bad prompts file, or token-id prompts for the chat endpoint.
    OSError: the prompts file cannot be read.
  """
  if config.prompts_file is None:
    n = 100 if config.num_prompts is None else config.num_prompts
    if config.endpoint == "chat":
      return random_word_prompts(n, config.random_input_len, config.random_output_len,
                                 config.seed)
    return random_token_prompts(n, config.random_input_len, config.random_output_len,
                                config.random_vocab_size, config.seed)
  prompts = load_prompts_file(config.prompts_file, config.random_output_len)
  if config.endpoint == "chat" and any(not isinstance(p.prompt, str) for p in prompts):
    raise ValueError(f"{config.prompts_file}: the chat endpoint takes text prompts, and this "
                     "file has token ids; use --endpoint completions")
  n = len(prompts) if config.num_prompts is None else config.num_prompts
  return [prompts[i % len(prompts)] for i in range(n)]


def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
  """When each of ``n`` requests is sent, in seconds from the start: a Poisson process.

  The first is sent at 0, and the gaps are exponential with mean ``1 / rate``;
  ``rate = inf`` sends all at 0.
  """
  if n <= 0:
    return np.zeros(0)
  if rate == math.inf:
    return np.zeros(n)
  gaps = np.random.default_rng((seed, 1)).exponential(1.0 / rate, size=n - 1)
  return np.concatenate([[0.0], np.cumsum(gaps)])


# --------------------------------------------------------------------------------------------
# Server-sent events


_EOL = re.compile(rb"\r\n|\r|\n")


class SSEParser:
  """Server-sent events from a byte stream that arrives in pieces of any size.

  :meth:`feed` takes the bytes as they come and returns the data of each event
  they complete: the ``data:`` lines of one event joined with newlines (the
  text ``[DONE]`` included, as it comes). Lines end with LF, CRLF or CR (a CR at
  the end of a piece waits for the next); comments and the ``event``, ``id`` and
  ``retry`` fields are ignored. Lines are split as bytes and decoded whole, so a
  character split between pieces arrives intact.
  """

  def __init__(self):
    self._buf = b""
    self._data: list[str] = []
    self._started = False

  def feed(self, chunk: bytes) -> list[str]:
    buf = self._buf + chunk
    if not self._started and buf:
      if len(buf) < 3 and b"\xef\xbb\xbf".startswith(buf):
        self._buf = buf  # perhaps a byte-order mark, split
        return []
      self._started = True
      if buf.startswith(b"\xef\xbb\xbf"):
        buf = buf[3:]
    events: list[str] = []
    pos = 0
    while True:
      m = _EOL.search(buf, pos)
      if m is None or (m.group() == b"\r" and m.end() == len(buf)):
        break  # no whole line yet, or a CR that may be half of a CRLF
      self._line(buf[pos:m.start()], events)
      pos = m.end()
    self._buf = buf[pos:]
    return events

  def close(self) -> list[str]:
    """The events the stream's end completes: a last line without its end, and an event
    without its blank line (which the SSE spec drops; a benchmark would rather see it)."""
    events: list[str] = []
    if self._buf:
      self._line(self._buf.rstrip(b"\r"), events)
      self._buf = b""
    self._line(b"", events)
    return events

  def _line(self, raw: bytes, events: list[str]) -> None:
    if not raw:
      if self._data:
        events.append("\n".join(self._data))
        self._data = []
      return
    line = raw.decode("utf-8", errors="replace")
    if line.startswith(":"):
      return
    field, colon, value = line.partition(":")
    if colon and value.startswith(" "):
      value = value[1:]
    if field == "data":
      self._data.append(value)


@dataclasses.dataclass
class Event:
  """One parsed event of a completions or chat stream.

  Attributes:
    done: the ``[DONE]`` marker.
    text: the content of this chunk (text, or the delta's content or reasoning).
    token_ids: how many token ids the chunk carries (vLLM's ``return_token_ids``).
    has_logprobs: the chunk carries log-probability entries (a token each).
    finish_reason: the choice's finish reason, once it ends.
    usage: the usage chunk's ``usage`` map.
    error: an error event's message.
  """

  done: bool = False
  text: str = ""
  token_ids: int = 0
  has_logprobs: bool = False
  finish_reason: str | None = None
  usage: dict | None = None
  error: str | None = None

  @property
  def is_content(self) -> bool:
    """Whether the chunk carries output: non-empty text, token ids or log-probabilities."""
    return bool(self.text) or self.token_ids > 0 or self.has_logprobs


def _error_text(obj) -> str | None:
  """The message of an OpenAI error body ``{"error": {"message": ...}}`` (or near shapes)."""
  if not isinstance(obj, dict):
    return None
  err = obj.get("error")
  if isinstance(err, dict):
    msg = err.get("message")
    return str(msg) if msg is not None else json.dumps(err)
  if isinstance(err, str):
    return err
  for key in ("message", "detail"):
    if obj.get(key) is not None and "choices" not in obj:
      return obj[key] if isinstance(obj[key], str) else json.dumps(obj[key])
  return None


def parse_event(data: str) -> Event:
  """One event's data: a chunk, the usage, ``[DONE]``, or an error."""
  if data.strip() == "[DONE]":
    return Event(done=True)
  try:
    obj = json.loads(data)
  except ValueError:
    return Event(error=f"malformed event: {data[:200]!r}")
  if not isinstance(obj, dict):
    return Event(error=f"malformed event: {data[:200]!r}")
  err = _error_text(obj)
  if err is not None:
    return Event(error=err)
  ev = Event(usage=obj.get("usage") if isinstance(obj.get("usage"), dict) else None)
  for c in obj.get("choices") or ():
    if not isinstance(c, dict):
      continue
    delta = c.get("delta") if isinstance(c.get("delta"), dict) else {}
    parts = [c.get("text"), delta.get("content"), delta.get("reasoning_content"),
             delta.get("reasoning")]
    ev.text += "".join(p for p in parts if isinstance(p, str))
    ids = c.get("token_ids") or delta.get("token_ids")
    if isinstance(ids, list):
      ev.token_ids += len(ids)
    lp = c.get("logprobs")
    if isinstance(lp, dict) and (lp.get("content") or lp.get("tokens")):
      ev.has_logprobs = True
    if c.get("finish_reason") is not None:
      ev.finish_reason = str(c["finish_reason"])
  return ev


def http_error_message(status: int, body: bytes) -> str:
  """``HTTP <status>: <message>`` from an error response (OpenAI's error body, else its text)."""
  text = body.decode("utf-8", errors="replace").strip()
  msg = None
  try:
    msg = _error_text(json.loads(text))
  except ValueError:
    pass
  if msg is None:
    msg = text[:500] or "(empty body)"
  return f"HTTP {status}: {msg}"


# --------------------------------------------------------------------------------------------
# Requests


@dataclasses.dataclass
class RequestRecord:
  """What one request did. Times are seconds; ``start_s`` is from the run's start.

  Attributes:
    index: the request's place in the run.
    prompt_len: the prompt's tokens where known before sending (token ids), else None.
    output_len: the ``max_tokens`` asked for.
    success: the stream ended normally, with no error.
    error: why not (``HTTP 400: <message>``, an error event, a timeout, a refused connection).
    http_status: the response's status, None when none came.
    start_s: when the request was sent.
    ttft_s: send to the first chunk with output.
    itl_s: the gaps between consecutive chunks with output.
    latency_s: send to the end of the stream.
    output_tokens: the usage's ``completion_tokens``; without usage, the token ids the
      chunks carried, else the number of chunks with output.
    prompt_tokens: the usage's ``prompt_tokens``, None without usage.
    finish_reason: the choice's finish reason.
  """

  index: int
  prompt_len: int | None
  output_len: int
  success: bool = False
  error: str | None = None
  http_status: int | None = None
  start_s: float | None = None
  ttft_s: float | None = None
  itl_s: list[float] = dataclasses.field(default_factory=list)
  latency_s: float | None = None
  output_tokens: int = 0
  prompt_tokens: int | None = None
  finish_reason: str | None = None

  @property
  def tpot_s(self) -> float | None:
    """(latency - TTFT) / (output tokens - 1); None with fewer than 2 tokens."""
    if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
      return None
    return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["tpot_s"] = self.tpot_s
    return d


class StreamRecorder:
  """Reads one request's events as they arrive and fills its :class:`RequestRecord`."""

  def __init__(self):
    self.content_times: list[float] = []
    self.token_ids = 0
    self.usage: dict | None = None
    self.errors: list[str] = []
    self.finish_reason: str | None = None
    self.done = False

  def add(self, data: str, t: float) -> None:
    """One event's data, arrived at time ``t`` (``time.perf_counter``)."""
    ev = parse_event(data)
    if ev.done:
      self.done = True
      return
    if ev.error is not None:
      self.errors.append(ev.error)
      return
    if ev.usage is not None:
      self.usage = ev.usage
    if ev.is_content:
      self.content_times.append(t)
      self.token_ids += ev.token_ids
    if ev.finish_reason is not None:
      self.finish_reason = ev.finish_reason

  def fill(self, record: RequestRecord, start: float, end: float) -> None:
    """Sets the record's timings and counts from a stream sent at ``start``, ended at ``end``."""
    ts = self.content_times
    record.ttft_s = ts[0] - start if ts else None
    record.itl_s = [b - a for a, b in zip(ts, ts[1:])]
    record.latency_s = end - start
    record.finish_reason = self.finish_reason
    usage = self.usage or {}
    if _is_int(usage.get("completion_tokens")):
      record.output_tokens = int(usage["completion_tokens"])
    else:
      record.output_tokens = self.token_ids or len(ts)
    if _is_int(usage.get("prompt_tokens")):
      record.prompt_tokens = int(usage["prompt_tokens"])
    if self.errors:
      record.error = "; ".join(self.errors)
    elif not self.done and self.finish_reason is None:
      record.error = "the stream ended before its end (no finish_reason, no data: [DONE])"
    record.success = record.error is None


def request_body(config: BenchConfig, model: str, prompt: Prompt) -> dict:
  """The JSON body of one streamed request."""
  body: dict[str, Any] = {"model": model}
  if config.endpoint == "chat":
    body["messages"] = [{"role": "user", "content": prompt.prompt}]
    body["max_completion_tokens"] = prompt.output_len
  else:
    body["prompt"] = prompt.prompt
    body["max_tokens"] = prompt.output_len
  body.update(temperature=config.temperature, stream=True,
              stream_options={"include_usage": True})
  if config.ignore_eos:
    body["ignore_eos"] = True
  body.update(config.extra_body or {})
  return body


async def send_request(client: aiohttp.ClientSession, url: str, body: dict,
                       record: RequestRecord, t0: float) -> None:
  """Sends one streamed request and fills ``record``; never raises but for cancellation.

  aiohttp, whose HTTP parser is C: at tens of thousands of chunks a second the
  client shares the machine with the server it measures, and a pure-Python
  parser (httpx's h11) took more CPU than the server's whole HTTP layer.
  """
  rec = StreamRecorder()
  start = time.perf_counter()
  record.start_s = start - t0
  try:
    async with client.post(url, json=body, headers={"Accept": "text/event-stream",
                                                    "Accept-Encoding": "identity"}) as r:
      record.http_status = r.status
      if r.status != 200:
        record.error = http_error_message(r.status, await r.read())
        record.latency_s = time.perf_counter() - start
        return
      parser = SSEParser()
      async for chunk in r.content.iter_any():
        t = time.perf_counter()
        for data in parser.feed(chunk):
          rec.add(data, t)
        if rec.done:
          break
      t = time.perf_counter()
      for data in parser.close():
        rec.add(data, t)
    rec.fill(record, start, time.perf_counter())
  except asyncio.CancelledError:
    rec.fill(record, start, time.perf_counter())
    raise
  except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
    rec.fill(record, start, time.perf_counter())
    record.success, record.error = False, f"timed out ({type(e).__name__})"
  except Exception as e:  # a failed request is a result, never the end of the run
    rec.fill(record, start, time.perf_counter())
    record.success, record.error = False, f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------------
# Metrics


def _stats(values_s: Sequence[float]) -> dict:
  """mean, median, p90, p99 of values in seconds, in milliseconds (None when empty)."""
  if not len(values_s):
    return {"mean": None, **{name: None for name, _ in PERCENTILES}}
  a = np.asarray(values_s, dtype=np.float64) * 1000.0
  out = {"mean": float(a.mean())}
  for name, q in PERCENTILES:
    out[name] = float(np.percentile(a, q, method="linear"))
  return out


def compute_metrics(records: Sequence[RequestRecord], duration_s: float) -> dict:
  """The run's counts, throughputs and latency statistics.

  Throughputs divide by ``duration_s``; tokens count completed requests only
  (prompt tokens from the usage, else the known prompt length). TTFT and E2E are
  over completed requests, TPOT over those with two or more output tokens, and
  ITL over every gap of every completed request.

  Returns:
    ``completed``, ``failed``, ``duration_s``, ``total_input_tokens``,
    ``total_output_tokens``, ``request_throughput`` (req/s), ``output_throughput``
    and ``total_token_throughput`` (tok/s), and for each of ttft, tpot, itl and e2e
    ``mean_<x>_ms``, ``median_<x>_ms``, ``p90_<x>_ms`` and ``p99_<x>_ms`` (None
    when there is nothing to measure).
  """
  ok = [r for r in records if r.success]
  inputs = sum((r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len or 0)
               for r in ok)
  outputs = sum(r.output_tokens for r in ok)
  per = duration_s if duration_s > 0 else math.nan
  m = {
      "completed": len(ok),
      "failed": len(records) - len(ok),
      "duration_s": duration_s,
      "total_input_tokens": inputs,
      "total_output_tokens": outputs,
      "request_throughput": len(ok) / per,
      "output_throughput": outputs / per,
      "total_token_throughput": (inputs + outputs) / per,
  }
  series = {
      "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
      "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
      "itl": [g for r in ok for g in r.itl_s],
      "e2e": [r.latency_s for r in ok if r.latency_s is not None],
  }
  for key in LATENCIES:
    for stat, v in _stats(series[key]).items():
      m[f"{stat}_{key}_ms"] = v
  for k in ("request_throughput", "output_throughput", "total_token_throughput"):
    if math.isnan(m[k]):
      m[k] = None
  return m


def summary(result: dict) -> dict:
  """A run's headline figures, keyed as ``mlkit.serve.local_load``'s in-process loads key
  theirs, so that an HTTP run and an in-process run of one workload compare key by key.

  Args:
    result: from :func:`benchmark` (or :func:`run_benchmark`).

  Returns:
    ``{"requests", "output_tokens", "duration_s", "output_tok_s", "median_ttft_ms",
    "mean_ttft_ms", "median_tpot_ms"}`` over the run's requests.

  Raises:
    RuntimeError: a request failed: a figure over the others would pass for the whole
      workload's (the message counts the failures and gives the first one's error).
  """
  m = result["metrics"]
  if m["failed"]:
    first = next(q["error"] for q in result["requests"] if not q["success"])
    raise RuntimeError(f"{m['failed']} of {m['completed'] + m['failed']} HTTP requests "
                       f"failed; the first: {first}")
  return {"requests": m["completed"], "output_tokens": m["total_output_tokens"],
          "duration_s": m["duration_s"], "output_tok_s": m["output_throughput"],
          "median_ttft_ms": m["median_ttft_ms"], "mean_ttft_ms": m["mean_ttft_ms"],
          "median_tpot_ms": m["median_tpot_ms"]}


# --------------------------------------------------------------------------------------------
# Running


def _client(config: BenchConfig, connections: int) -> aiohttp.ClientSession:
  headers = {"User-Agent": "mlkit-bench"}
  if config.api_key:
    headers["Authorization"] = f"Bearer {config.api_key}"
  connector = aiohttp.TCPConnector(limit=connections, force_close=False)
  timeout = aiohttp.ClientTimeout(total=config.timeout_s, connect=min(config.timeout_s, 10.0))
  return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)


async def resolve_model(client: aiohttp.ClientSession, config: BenchConfig) -> str:
  """``config.model``, else the first id of ``GET /v1/models``; checks the server answers.

  Raises:
    ServerUnreachable: no connection to the server, or no model name to be had.
  """
  url = config.base_url + "/v1/models"
  try:
    async with client.get(url, timeout=aiohttp.ClientTimeout(
        total=min(config.timeout_s, 10.0))) as resp:
      r = _Reply(resp.status, await resp.read())
  except (aiohttp.ClientError, asyncio.TimeoutError) as e:
    raise ServerUnreachable(f"cannot reach {config.base_url} ({type(e).__name__}: "
                            f"{e or 'no answer'})") from None
  if config.model is not None:
    return config.model
  if r.status_code != 200:
    raise ServerUnreachable(f"GET {url} answered {http_error_message(r.status_code, r.content)}"
                            "; pass the model's name (--model)")
  try:
    return str(r.json()["data"][0]["id"])
  except (ValueError, KeyError, IndexError, TypeError):
    raise ServerUnreachable(f"GET {url} listed no model ({r.text[:200]!r}); pass the model's "
                            "name (--model)") from None


async def _progress(records: list[RequestRecord], done: list[int], t0: float,
                    interval: float) -> None:
  while True:
    await asyncio.sleep(interval)
    n_failed = sum(1 for r in records if r.error is not None)
    print(f"{PROG}: {done[0]}/{len(records)} requests done ({n_failed} failed), "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


class _Reply:
  """A read reply: status, body, and the few accessors resolve_model needs."""

  def __init__(self, status: int, body: bytes):
    self.status_code, self.content = status, body

  @property
  def text(self) -> str:
    return self.content.decode("utf-8", "replace")

  def json(self):
    return json.loads(self.content)


async def _run(client: aiohttp.ClientSession, config: BenchConfig, model: str,
               prompts: Sequence[Prompt]) -> dict:
  """One run on an open client: sends every prompt on schedule, returns the result."""
  url = config.base_url + ENDPOINTS[config.endpoint]
  records = [RequestRecord(i, p.prompt_len, p.output_len) for i, p in enumerate(prompts)]
  times = arrival_times(len(prompts), config.request_rate, config.seed)
  sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
  done = [0]
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

  async def one(i: int, t0: float) -> None:
    async def go():
      try:
        await asyncio.wait_for(
            send_request(client, url, request_body(config, model, prompts[i]), records[i], t0),
            config.timeout_s)
      except asyncio.TimeoutError:
        records[i].success = False
        records[i].error = f"timed out after {config.timeout_s:g} s"
      done[0] += 1
    if sem is None:
      await go()
    else:
      async with sem:
        await go()

  t0 = time.perf_counter()
  progress = (asyncio.create_task(_progress(records, done, t0, config.progress_interval_s))
              if config.progress_interval_s > 0 else None)
  tasks = []
  try:
    for i, at in enumerate(times):
      wait = t0 + at - time.perf_counter()
      if wait > 0:
        await asyncio.sleep(wait)
      tasks.append(asyncio.create_task(one(i, t0)))
    await asyncio.gather(*tasks)
  finally:
    for t in tasks:
      t.cancel()
    if progress is not None:
      progress.cancel()
  duration = time.perf_counter() - t0
  settings = config.settings()
  settings.update(model=model, num_prompts=len(prompts), concurrency_sweep=[])
  return {
      "date": date,
      "base_url": config.base_url,
      "endpoint": config.endpoint,
      "model": model,
      "max_concurrency": config.max_concurrency,
      "request_rate": _json_ready(float(config.request_rate)),
      "settings": settings,
      "metrics": compute_metrics(records, duration),
      "requests": [r.to_json() for r in records],
  }


def _connections(config: BenchConfig, n: int) -> int:
  caps = [c for c in (config.max_concurrency, *config.concurrency_sweep) if c]
  return max(1, max(caps) if caps else n)


def write_json(path, result) -> None:
  """Writes a result (or a sweep's list of them) as JSON."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=1, allow_nan=False)
    f.write("\n")


async def run_benchmark(config: BenchConfig, prompts: Sequence[Prompt] | None = None) -> dict:
  """Runs one benchmark and returns its result (written to ``config.output_json`` if set).

  Args:
    config: the run; its ``concurrency_sweep`` must be empty (see :func:`run_sweep`).
    prompts: the prompts to send; default: :func:`build_prompts` of ``config``.

  Returns:
    ``{"date", "base_url", "endpoint", "model", "max_concurrency", "request_rate",
    "settings", "metrics", "requests"}``: the UTC date, the server, the settings
    (:meth:`BenchConfig.settings` with the model and prompt count resolved),
    :func:`compute_metrics`'s map, and one :meth:`RequestRecord.to_json` per request.

  Raises:
    ServerUnreachable: the server cannot be reached (checked before any request).
    ValueError: a sweep config, or bad prompts.
  """
  if config.concurrency_sweep:
    raise ValueError("BenchConfig.concurrency_sweep is set: use run_sweep, one result per value")
  prompts = build_prompts(config) if prompts is None else list(prompts)
  async with _client(config, _connections(config, len(prompts))) as client:
    model = await resolve_model(client, config)
    result = await _run(client, config, model, prompts)
  if config.output_json is not None:
    write_json(config.output_json, result)
  return result


async def run_sweep(config: BenchConfig, prompts: Sequence[Prompt] | None = None,
                    report=None) -> list[dict]:
  """One run per ``config.concurrency_sweep`` value (rate inf, that max concurrency).

  Every run sends the same prompts. ``report``, if given, is called with each
  result as it is done. Returns the results in sweep order (written as a list to
  ``config.output_json`` if set). Raises as :func:`run_benchmark`.
  """
  if not config.concurrency_sweep:
    raise ValueError("BenchConfig.concurrency_sweep is empty: use run_benchmark")
  prompts = build_prompts(config) if prompts is None else list(prompts)
  results = []
  async with _client(config, _connections(config, len(prompts))) as client:
    model = await resolve_model(client, config)
    for c in config.concurrency_sweep:
      one = dataclasses.replace(config, concurrency_sweep=(), max_concurrency=c,
                                request_rate=math.inf, output_json=None)
      results.append(await _run(client, one, model, prompts))
      results[-1]["settings"]["concurrency_sweep"] = list(config.concurrency_sweep)
      if report is not None:
        report(results[-1])
  if config.output_json is not None:
    write_json(config.output_json, results)
  return results


def benchmark(config: BenchConfig) -> dict:
  """:func:`run_benchmark`, from synchronous code (it runs its own event loop)."""
  return asyncio.run(run_benchmark(config))


def sweep(config: BenchConfig) -> list[dict]:
  """:func:`run_sweep`, from synchronous code (it runs its own event loop)."""
  return asyncio.run(run_sweep(config))


# --------------------------------------------------------------------------------------------
# Reports


def _fmt(v, digits: int = 2) -> str:
  if v is None:
    return "-"
  if isinstance(v, float):
    return f"{v:.{digits}f}"
  return str(v)


def format_result(result: dict) -> str:
  """A result as a small aligned table."""
  m = result["metrics"]
  rows = [
      ("Base URL", result["base_url"]),
      ("Endpoint", result["endpoint"]),
      ("Model", result["model"]),
      ("Request rate (req/s)", result["request_rate"]),
      ("Max concurrency", result["max_concurrency"] or "-"),
      ("Completed requests", m["completed"]),
      ("Failed requests", m["failed"]),
      ("Duration (s)", _fmt(m["duration_s"])),
      ("Total input tokens", m["total_input_tokens"]),
      ("Total output tokens", m["total_output_tokens"]),
      ("Request throughput (req/s)", _fmt(m["request_throughput"])),
      ("Output token throughput (tok/s)", _fmt(m["output_throughput"])),
      ("Total token throughput (tok/s)", _fmt(m["total_token_throughput"])),
  ]
  stats = ("mean", *(n for n, _ in PERCENTILES))
  w = max(len(k) for k, _ in rows) + 2
  vw = max(12, *(len(str(v)) for _, v in rows))
  total = max(w + vw, 8 + 12 * len(stats))
  lines = [" Benchmark result ".center(total, "=")]
  lines += [f"{k + ':':<{w}}{v!s:>{total - w}}" for k, v in rows]
  lines.append(" Latency (ms) ".center(total, "-"))
  lines.append(f"{'':<8}" + "".join(f"{s:>12}" for s in stats))
  for key in LATENCIES:
    lines.append(f"{key.upper():<8}" + "".join(f"{_fmt(m[f'{s}_{key}_ms']):>12}" for s in stats))
  errors = collections.Counter(r["error"] for r in result["requests"] if r["error"] is not None)
  if errors:
    lines.append(" Errors ".center(total, "-"))
    for err, n in errors.most_common(5):
      lines.append(f"{n:>5} x {err[:200]}")
    if len(errors) > 5:
      lines.append(f"  ... and {len(errors) - 5} other errors (the JSON has every request's)")
  lines.append("=" * total)
  return "\n".join(lines)


def format_sweep(results: Sequence[dict]) -> str:
  """A sweep's results, one row per concurrency."""
  cols = [("concurrency", lambda r: r["max_concurrency"]),
          ("done", lambda r: r["metrics"]["completed"]),
          ("failed", lambda r: r["metrics"]["failed"]),
          ("req/s", lambda r: _fmt(r["metrics"]["request_throughput"])),
          ("out tok/s", lambda r: _fmt(r["metrics"]["output_throughput"], 1)),
          ("TTFT p50", lambda r: _fmt(r["metrics"]["median_ttft_ms"], 1)),
          ("TTFT p99", lambda r: _fmt(r["metrics"]["p99_ttft_ms"], 1)),
          ("TPOT p50", lambda r: _fmt(r["metrics"]["median_tpot_ms"], 1)),
          ("ITL p99", lambda r: _fmt(r["metrics"]["p99_itl_ms"], 1)),
          ("E2E p50", lambda r: _fmt(r["metrics"]["median_e2e_ms"], 1))]
  table = [[name for name, _ in cols]] + [[str(f(r)) for _, f in cols] for r in results]
  widths = [max(len(row[j]) for row in table) for j in range(len(cols))]
  lines = [" Concurrency sweep (latencies in ms) ".center(sum(widths) + 2 * len(cols), "=")]
  for row in table:
    lines.append("".join(f"{c:>{w + 2}}" for c, w in zip(row, widths)))
  return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Command line


class _UsageError(Exception):
  pass


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # one line, and main returns 2
    raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
  p = _Parser(prog=PROG, description="Benchmarks an OpenAI-compatible server with streamed "
                                     "requests: TTFT, TPOT, ITL, latency and throughput.")
  p.add_argument("--base-url", required=True, help="the server's root, http://HOST:PORT")
  p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
  p.add_argument("--model", default=None,
                 help="the model's name (default: the first that GET /v1/models lists)")
  p.add_argument("--api-key", default=None,
                 help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)")
  p.add_argument("--num-prompts", type=int, default=None,
                 help="requests per run (default: 100, or every prompt of --prompts-file)")
  p.add_argument("--request-rate", type=float, default=math.inf,
                 help="requests per second, Poisson arrivals (default: inf, all at once)")
  p.add_argument("--max-concurrency", type=int, default=None,
                 help="the most requests in flight (default: no cap)")
  p.add_argument("--concurrency-sweep", default=None,
                 help="comma-separated concurrencies, e.g. 1,4,16,32: one run each, at rate inf")
  p.add_argument("--random-input-len", type=int, default=None,
                 help="tokens per random prompt (words with --endpoint chat; default 1024)")
  p.add_argument("--random-output-len", type=int, default=None,
                 help="max_tokens per request (default 128; a prompts file's lines may give "
                      "their own)")
  p.add_argument("--random-vocab-size", type=int, default=None,
                 help="random token ids are drawn from [0, this) (default 256)")
  p.add_argument("--prompts-file", default=None,
                 help='JSON Lines of {"prompt": str or [ids], "output_len": int}, or text with '
                      "one prompt per line")
  p.add_argument("--ignore-eos", action="store_true",
                 help="send ignore_eos: true (vLLM's extension), for outputs of full length")
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrivals")
  p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
  p.add_argument("--extra-body", default=None,
                 help='a JSON object of fields added to every request, e.g. '
                      '\'{"return_token_ids": true}\'')
  p.add_argument("--output-json", default=None, help="where to write the results")
  p.add_argument("--progress-interval", type=float, default=5.0,
                 help="seconds between progress lines on stderr (0: none)")
  return p


_FLAGS = {"timeout_s": "timeout", "progress_interval_s": "progress_interval"}


def _config(args) -> BenchConfig:
  sweep_values: tuple[int, ...] = ()
  if args.concurrency_sweep is not None:
    try:
      sweep_values = tuple(int(s) for s in args.concurrency_sweep.split(",") if s.strip())
    except ValueError:
      raise _UsageError("--concurrency-sweep takes comma-separated integers, e.g. 1,4,16,32") \
          from None
    if not sweep_values or min(sweep_values) < 1:
      raise _UsageError("--concurrency-sweep takes integers >= 1, e.g. 1,4,16,32")
    if args.max_concurrency is not None or args.request_rate != math.inf:
      raise _UsageError("--concurrency-sweep sets each run's concurrency and rate (inf): "
                        "leave out --max-concurrency and --request-rate")
  if args.prompts_file is not None:
    for flag in ("random_input_len", "random_vocab_size"):
      if getattr(args, flag) is not None:
        raise _UsageError(f"--{flag.replace('_', '-')} is for random prompts; "
                          "--prompts-file gives its own")
  extra = None
  if args.extra_body is not None:
    try:
      extra = json.loads(args.extra_body)
    except ValueError as e:
      raise _UsageError(f"--extra-body is not JSON ({e})") from None
    if not isinstance(extra, dict):
      raise _UsageError("--extra-body must be a JSON object")
  kw = {k: v for k, v in dict(random_input_len=args.random_input_len,
                              random_output_len=args.random_output_len,
                              random_vocab_size=args.random_vocab_size).items() if v is not None}
  try:
    return BenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        api_key=args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY"),
        num_prompts=args.num_prompts, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, concurrency_sweep=sweep_values,
        prompts_file=args.prompts_file, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed, timeout_s=args.timeout,
        extra_body=extra, output_json=None, progress_interval_s=args.progress_interval, **kw)
  except ValueError as e:  # name the flag, not the field
    msg = str(e)
    m = re.match(r"BenchConfig\.(\w+)", msg)
    if m:
      msg = "--" + _FLAGS.get(m[1], m[1]).replace("_", "-") + msg[m.end():]
    raise _UsageError(msg) from None


def main(argv=None) -> int:
  """The command line: 0 when requests completed, 1 when the server cannot be reached (or no
  request completed), 2 for bad arguments."""
  try:
    args = _parser().parse_args(argv)
    config = _config(args)
    prompts = build_prompts(config)
  except (_UsageError, ValueError, OSError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2

  def show(result):
    print(format_result(result), flush=True)

  try:
    if config.concurrency_sweep:
      results = asyncio.run(run_sweep(config, prompts, report=show))
      print(format_sweep(results))
    else:
      results = [asyncio.run(run_benchmark(config, prompts))]
      show(results[0])
  except ServerUnreachable as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print(f"{PROG}: interrupted", file=sys.stderr)
    return 130
  if args.output_json is not None:
    try:
      write_json(args.output_json, results if config.concurrency_sweep else results[0])
    except OSError as e:
      print(f"{PROG}: error: cannot write {args.output_json}: {e}", file=sys.stderr)
      return 1
  if not any(r["metrics"]["completed"] for r in results):
    print(f"{PROG}: error: no request completed", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
