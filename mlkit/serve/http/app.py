"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, models, health, metrics.

A thin layer, as in vLLM and sglang-jax: a handler parses and checks a request
(:mod:`mlkit.serve.http.openai_api`), hands it to the engine thread as a
:class:`mlkit.serve.http.calls.Call`, and turns the token updates that come
back into a response, or into server-sent events (``data: {json}``, ending
with ``data: [DONE]``). A client that disconnects cancels its requests, and
their pages are free within a step. docs/http.md lists the endpoints, the
parameters and the errors.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
from typing import Any

from absl import logging
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlkit.serve.http import openai_api as api
from mlkit.serve.http.calls import HTTP, Accepted, Call, Refusal, Update

MAX_BODY_BYTES = 32 << 20


class Door:
  """What the HTTP handlers need from the serving process.

  Args:
    inbox_queue: the engine thread's inbox queue (``FrontDoor.inbox.queue``).
    context: the served model, for request checking (``openai_api.Context``).
    metrics: the process's ``ServeMetrics``.
    api_key: when set, every endpoint but /health needs ``Authorization: Bearer <key>``.
  """

  def __init__(self, inbox_queue, context: api.Context, metrics, api_key: str | None = None):
    self.inbox_queue = inbox_queue
    self.context = context
    self.metrics = metrics
    self.api_key = api_key.encode() if api_key else None
    self.ready = threading.Event()  # set once warm-up is done: /health answers 200
    self.created = int(time.time())

  def submit(self, call: Call) -> None:
    self.inbox_queue.put((HTTP, {"kind": "http_submit", "call": call}))

  def cancel(self, call: Call) -> None:
    self.inbox_queue.put((HTTP, {"kind": "http_cancel", "call": call}))

  def stop(self, call: Call, index: int) -> None:
    self.inbox_queue.put((HTTP, {"kind": "http_stop", "call": call, "index": index}))


class _RequireKey:
  """ASGI middleware: every path but /health needs ``Authorization: Bearer <key>`` (compared in
  constant time). Plain ASGI, not Starlette's BaseHTTPMiddleware, which would put every
  streamed chunk through an extra task and memory stream."""

  def __init__(self, app, key: bytes):
    self.app, self.key = app, key

  async def __call__(self, scope, receive, send):
    if scope["type"] == "http" and scope["path"] != "/health":
      given = dict(scope["headers"]).get(b"authorization", b"")
      token = given[7:].strip() if given[:7].lower() == b"bearer " else b""
      if not hmac.compare_digest(token, self.key):
        response = _error(api.ApiError(401, "a valid API key is needed: Authorization: "
                                       "Bearer <key>", type="authentication_error",
                                       code="invalid_api_key"))
        await response(scope, receive, send)
        return
    await self.app(scope, receive, send)


def _error(e: api.ApiError) -> JSONResponse:
  headers = {"Retry-After": "1"} if e.status == 503 else None
  return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _json_body(request: Request) -> Any:
  size = request.headers.get("content-length")
  if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
    raise api.ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
  raw = await request.body()
  if len(raw) > MAX_BODY_BYTES:
    raise api.ApiError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
  try:
    return json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:
    raise api.ApiError(400, f"the request body is not valid JSON: {e}") from None


class _Answer:
  """One HTTP request's choices as their updates arrive: text, log-probabilities, usage."""

  def __init__(self, plan: api.Plan, door: Door):
    self.plan = plan
    self.door = door
    self.choices = [api.ChoiceText(plan, door.context.tokenizer) for _ in plan.choice_prompts]
    self.done = [False] * len(self.choices)
    self.logprobs: list[list] = [[] for _ in self.choices]
    self.offsets = [0] * len(self.choices)  # completions: text before this chunk's tokens
    self.failures: list[str] = []  # choices the server aborted (integrity, transfer, ...)

  @property
  def finished(self) -> bool:
    return all(self.done)

  def apply(self, u: Update, call: Call) -> tuple[str, list, list[int], str | None]:
    """(text delta, log-probability entries, token ids, finish reason or None) of an update."""
    c = self.choices[u.index]
    if u.done and u.abort_reason not in (None, "cancelled"):
      self.failures.append(f"choice {u.index}: {u.abort_reason}: {u.error}")
    was_stopped = c.stopped
    text, entries, ids = c.feed(u.tokens, u.logprobs)
    if c.stopped and not was_stopped and not u.done:
      self.door.stop(call, u.index)  # a stop string: the engine can let the request go
    finish = None
    if u.done or c.stopped:
      text += c.finish(_finish_reason(u) if u.done else "stop")
      finish = c.finish_reason
      self.done[u.index] = True
    self.logprobs[u.index] += entries
    return text, entries, ids, finish

  def usage(self) -> dict:
    prompt = sum(len(p) for p in self.plan.prompts)
    completion = sum(len(c.tokens) for c in self.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _finish_reason(u: Update) -> str:
  """OpenAI's finish reasons, plus vLLM's "abort" (cancelled) and "error" (the server failed
  the request: an integrity or transfer abort, ...)."""
  if u.abort_reason is None:
    return u.finish_reason or "length"
  return "abort" if u.abort_reason == "cancelled" else "error"


def build_app(door: Door) -> FastAPI:
  """The FastAPI app of one serving process."""
  app = FastAPI(title="mlkit", docs_url=None, redoc_url=None, openapi_url=None)
  ctx = door.context

  if door.api_key is not None:
    app.add_middleware(_RequireKey, key=door.api_key)

  @app.exception_handler(api.ApiError)
  async def on_api_error(_request, e: api.ApiError):
    return _error(e)

  @app.exception_handler(StarletteHTTPException)
  async def on_http_error(_request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return _error(api.ApiError(e.status_code, str(e.detail), type=kind))

  @app.exception_handler(RequestValidationError)
  async def on_validation_error(_request, e: RequestValidationError):
    return _error(api.ApiError(400, str(e)))

  @app.exception_handler(Exception)
  async def on_unexpected(_request, e: Exception):
    logging.exception("http: unexpected error")
    return _error(api.ApiError(500, f"internal server error ({type(e).__name__})",
                               type="server_error"))

  @app.get("/health")
  async def health():
    if not door.ready.is_set():
      return JSONResponse({"status": "warming up"}, status_code=503, headers={"Retry-After": "5"})
    return {"status": "ok"}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": ctx.model, "object": "model",
                                        "created": door.created, "owned_by": "mlkit",
                                        "max_model_len": ctx.max_tokens}]}

  @app.get("/metrics")
  async def metrics():
    return Response(door.metrics.render(), media_type=CONTENT_TYPE_LATEST)

  @app.post("/v1/completions")
  async def completions(request: Request):
    plan = api.parse_completion(await _json_body(request), ctx)
    return await _serve(request, plan)

  @app.post("/v1/chat/completions")
  async def chat(request: Request):
    plan = api.parse_chat(await _json_body(request), ctx)
    return await _serve(request, plan)

  async def _serve(request: Request, plan: api.Plan):
    if not door.ready.is_set():
      raise api.ApiError(503, "the server is warming up", type="server_error")
    call = Call(plan.choice_prompts, plan.samplings, asyncio.get_running_loop())
    door.submit(call)
    first = await call.queue.get()  # the engine thread answers at its next turn
    if isinstance(first, Refusal):
      if first.status == 400:  # the engine's own checks (e.g. the pool's length limit)
        raise api.ApiError(400, first.message, first.param or (
            "prompt" if plan.kind == "completion" else "messages"))
      raise api.ApiError(first.status, first.message, type="server_error")
    assert isinstance(first, Accepted), first
    answer = _Answer(plan, door)
    rid = ("cmpl-" if plan.kind == "completion" else "chatcmpl-") + secrets.token_hex(12)
    if plan.stream:
      return StreamingResponse(_events(call, answer, rid), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    return await _whole(request, call, answer, rid)

  async def _whole(request: Request, call: Call, answer: _Answer, rid: str):
    async def gather():
      while not answer.finished:
        answer.apply(await call.queue.get(), call)

    async def disconnected():
      while True:  # returns once the client is gone (an http.disconnect message)
        if (await request.receive())["type"] == "http.disconnect":
          return

    work = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(disconnected())
    try:
      await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
      if not work.done():  # the client left: its requests end now
        work.cancel()
        door.cancel(call)
      gone.cancel()
    if not work.done() or work.cancelled():
      return Response(status_code=499)
    work.result()
    if answer.failures:
      raise api.ApiError(500, "the server aborted the request: " + "; ".join(answer.failures),
                         type="server_error", code="aborted")
    return _final(answer, rid, door)

  async def _events(call: Call, answer: _Answer, rid: str):
    plan, created = answer.plan, int(time.time())
    obj = "text_completion" if plan.kind == "completion" else "chat.completion.chunk"
    usage_null = {"usage": None} if plan.include_usage else {}
    try:
      if plan.kind == "chat":  # the assistant's role first, one chunk per choice
        for i in range(len(answer.choices)):
          yield _sse({"id": rid, "object": obj, "created": created, "model": ctx.model,
                      "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}], **usage_null})
      while not answer.finished:
        # Everything that arrived since the last write goes out in one write, a choice's
        # updates merged into one event: a client slower than the engine gets fewer, longer
        # chunks (as vLLM's stream interval does) instead of an ever longer backlog.
        updates = [await call.queue.get()]
        while not call.queue.empty():
          updates.append(call.queue.get_nowait())
        merged: dict[int, list] = {}
        for u in updates:
          text, entries, ids, finish = answer.apply(u, call)
          m = merged.setdefault(u.index, ["", [], [], None])
          m[0], m[1], m[2], m[3] = m[0] + text, m[1] + entries, m[2] + ids, finish or m[3]
        events = []
        for index, (text, entries, ids, finish) in merged.items():
          if not text and not ids and finish is None:
            continue
          # token_ids: the new tokens (vLLM's return_token_ids), also when there is no text.
          choice = {"index": index, "finish_reason": finish, "token_ids": ids}
          if plan.kind == "chat":
            choice["delta"] = {"content": text} if text else {}
            choice["logprobs"] = {"content": entries} if plan.logprobs is not None else None
          else:
            choice["text"] = text
            choice["logprobs"] = (api.completion_logprobs(entries, answer.offsets[index])
                                  if plan.logprobs is not None else None)
            answer.offsets[index] += len(text)
          events.append(_sse({"id": rid, "object": obj, "created": created, "model": ctx.model,
                              "choices": [choice], **usage_null}))
        if events:
          yield "".join(events)
      if answer.failures:
        yield _sse(api.ApiError(500, "the server aborted the request: "
                                + "; ".join(answer.failures), type="server_error",
                                code="aborted").body())
      if plan.include_usage:
        yield _sse({"id": rid, "object": obj, "created": created, "model": ctx.model,
                    "choices": [], "usage": answer.usage()})
      yield "data: [DONE]\n\n"
    finally:
      if not answer.finished:  # the client disconnected mid-stream
        door.cancel(call)

  return app


def _sse(obj: dict) -> str:
  return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _final(answer: _Answer, rid: str, door: Door) -> dict:
  plan, ctx = answer.plan, door.context
  choices = []
  for i, c in enumerate(answer.choices):
    if plan.kind == "chat":
      choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                      "logprobs": ({"content": answer.logprobs[i]}
                                   if plan.logprobs is not None else None),
                      "finish_reason": c.finish_reason, "token_ids": c.tokens})
    else:
      choices.append({"index": i, "text": c.text,
                      "logprobs": (api.completion_logprobs(answer.logprobs[i], 0)
                                   if plan.logprobs is not None else None),
                      "finish_reason": c.finish_reason, "token_ids": c.tokens})
  return {"id": rid, "object": "chat.completion" if plan.kind == "chat" else "text_completion",
          "created": int(time.time()), "model": ctx.model, "choices": choices,
          "usage": answer.usage()}
