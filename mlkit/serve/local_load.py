"""Load on a front door from inside its process, as the HTTP handlers put it: no HTTP.

What the front door costs is the difference between a workload sent through
HTTP (``mlkit.serve.bench``) and the same workload handed straight to the
server's engine thread. :func:`drive` is the second way. It runs
``ColocatedServer.serve_forever`` in a thread, as the server's main thread
does, and asyncio clients submit :class:`~mlkit.serve.http.calls.Call`\\ s to
its inbox and read their updates, as the handlers do
(:mod:`mlkit.serve.http.calls`). Two kinds of load, as ``mlkit.serve.bench``:

* **closed loop** (``concurrency``): each client sends its next request when its
  last one's final update arrives;
* **open loop** (``rate``): requests are sent at Poisson arrival times
  (:func:`mlkit.serve.bench.arrival_times`), whatever is still running, so an
  in-process run and an HTTP run with the same seed see the same arrivals.

:func:`engine_loop` is a third way, with no front door at all: a closed loop that
submits between the engine's own steps.

:func:`step_split` and :func:`served_histogram` read where the time went inside
a server: its engine's step times, and its own histograms from ``/metrics``;
:func:`server_figures` puts both together between two :func:`server_snapshot`\\ s,
as :func:`drive` reports them. docs/http.md says how ``serve_http`` uses them.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np


def drive(engine, prompts: list[list[int]], sampling, *, concurrency: int | None = None,
          rate: float | None = None, seed: int = 0, arrival_window=None) -> dict:
  """Serves ``prompts`` through a front door on ``engine`` in this process; returns figures.

  Args:
    engine: a colocated ``Engine`` with nothing in flight (it is stepped by the front
      door's thread until every prompt ended).
    prompts: token ids per request.
    sampling: one ``SamplingParams`` for every request.
    concurrency: closed loop with this many clients (give this or ``rate``).
    rate: open loop at this many requests per second (Poisson arrivals from ``seed``).
    seed: the arrivals' seed (open loop).
    arrival_window: the front door's ``ArrivalWindow`` (default: a server's default).

  Returns:
    ``{"requests", "output_tokens", "duration_s", "output_tok_s", "median_ttft_ms",
    "mean_ttft_ms", "median_tpot_ms", "engine_mean_ttft_ms", "steps",
    "device_ms_per_step", "host_ms_per_step"}``. TTFT runs from the hand-off to the
    first token's arrival on the asyncio side; the engine's own TTFT from the request's
    arrival in the engine to its first token.

  Raises:
    ValueError: neither or both of ``concurrency`` and ``rate``, or no prompts.
    RuntimeError: the front door refused or aborted a request.
  """
  from mlkit.serve.bench import arrival_times
  from mlkit.serve.decode import ArrivalWindow, ColocatedServer
  from mlkit.serve.http.calls import HTTP, Accepted, Call
  if (concurrency is None) == (rate is None):
    raise ValueError("drive: give concurrency (closed loop) or rate (open loop), not both")
  if not prompts:
    raise ValueError("drive: no prompts")
  if concurrency is not None and concurrency < 1:
    raise ValueError(f"drive: concurrency must be >= 1, got {concurrency}")
  if rate is not None and not rate > 0:
    raise ValueError(f"drive: rate must be > 0 requests per second, got {rate}")
  n = len(prompts)
  server = ColocatedServer(engine, None, model_name="in-process", max_waiting=4 * n,
                           arrival_window=arrival_window or ArrivalWindow())
  thread = threading.Thread(target=server.serve_forever, daemon=True, name="engine")
  ttft, tpot, engine_ttft, tokens = [], [], [], [0]

  async def one(i: int) -> None:
    call = Call([prompts[i]], [sampling], asyncio.get_running_loop())
    t0 = time.perf_counter()
    server.inbox.queue.put((HTTP, {"kind": "http_submit", "call": call}))
    first = await call.queue.get()
    if not isinstance(first, Accepted):
      raise RuntimeError(f"the in-process front door refused a request: {first}")
    got, t_first = 0, None
    while True:
      u = await call.queue.get()
      if u.tokens and t_first is None:
        t_first = time.perf_counter()
      got += len(u.tokens)
      if u.done:
        break
    if u.abort_reason is not None:
      raise RuntimeError(f"an in-process request was aborted: {u.abort_reason}: {u.error}")
    ttft.append(t_first - t0)
    tpot.append((time.perf_counter() - t_first) / max(got - 1, 1))
    if u.ttft_s is not None:
      engine_ttft.append(u.ttft_s)
    tokens[0] += got

  async def closed(queue) -> None:
    for i in queue:
      await one(i)

  async def opened(i: int, start: float, at: float) -> None:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    await one(i)

  async def main() -> float:
    t0 = time.perf_counter()
    if concurrency is not None:
      queue = iter(range(n))
      await asyncio.gather(*(closed(queue) for _ in range(concurrency)))
    else:
      times = arrival_times(n, rate, seed)
      await asyncio.gather(*(opened(i, t0, float(times[i])) for i in range(n)))
    return time.perf_counter() - t0

  before = engine.metrics()
  thread.start()
  try:
    wall = asyncio.run(main())
  finally:
    server.stop()
    thread.join(30)
  return {"requests": n, "output_tokens": tokens[0], "duration_s": wall,
          "output_tok_s": tokens[0] / wall, "median_ttft_ms": 1e3 * float(np.median(ttft)),
          "mean_ttft_ms": 1e3 * float(np.mean(ttft)),
          "median_tpot_ms": 1e3 * float(np.median(tpot)),
          "engine_mean_ttft_ms": 1e3 * float(np.mean(engine_ttft)) if engine_ttft else 0.0,
          **step_split(before, engine.metrics())}


def engine_loop(engine, prompts: list[list[int]], sampling, *, concurrency: int) -> dict:
  """Serves ``prompts`` by calling ``engine.submit`` and ``engine.step`` in this thread: a
  closed loop of ``concurrency`` requests, the next submitted between steps, the moment one
  ends. No front door, no client: what the engine alone does with the same workload.

  Args:
    engine: an ``Engine`` (or any ``ServingEngine``); its other requests are stepped too,
      but not counted.
    prompts: token ids per request.
    sampling: one ``SamplingParams`` for every request.
    concurrency: requests in flight (>= 1).

  Returns:
    ``{"requests", "output_tokens", "duration_s", "output_tok_s", "median_ttft_ms",
    "median_tpot_ms"}``; TTFT runs from the request's submission to its first token, TPOT
    over the requests that emitted more than one token (NaN where none did).

  Raises:
    ValueError: concurrency below 1, or no prompts.
    RuntimeError: the engine aborted a request.
  """
  if not prompts:
    raise ValueError("engine_loop: no prompts")
  if concurrency < 1:
    raise ValueError(f"engine_loop: concurrency must be >= 1, got {concurrency}")
  n = len(prompts)
  live, done, next_i = {}, [], 0
  t0 = time.perf_counter()
  while len(done) < n:
    while len(live) < concurrency and next_i < n:
      rid = engine.submit(prompts[next_i], sampling)
      live[rid] = engine.get(rid)
      next_i += 1
    for o in engine.step():
      if o.done and o.request_id in live:
        r = live.pop(o.request_id)
        if r.abort_reason is not None:
          raise RuntimeError(f"engine_loop: the engine aborted request {o.request_id}: "
                             f"{r.abort_reason}")
        done.append(r)
  wall = time.perf_counter() - t0
  tokens = sum(len(r.output) for r in done)
  ttft = [r.first_token_time - r.arrival_time for r in done]
  tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in done
          if len(r.output) > 1]
  return {"requests": n, "output_tokens": tokens, "duration_s": wall,
          "output_tok_s": tokens / wall, "median_ttft_ms": 1e3 * float(np.median(ttft)),
          "median_tpot_ms": 1e3 * float(np.median(tpot)) if tpot else float("nan")}


def step_split(before: dict, after: dict) -> dict:
  """Steps, and device and host milliseconds per step, between two ``Engine.metrics()``
  snapshots (device: launch to results; host: the engine thread's own work)."""
  steps = after["steps"] - before["steps"]
  per_step = lambda k: 1e3 * (after[k] - before[k]) / max(steps, 1)  # noqa: E731
  return {"steps": steps, "device_ms_per_step": per_step("device_seconds"),
          "host_ms_per_step": per_step("host_seconds")}


def served_histogram(base_url: str, name: str, *, api_key: str | None = None,
                     timeout_s: float = 30.0) -> tuple[float, int]:
  """(sum, count) of one histogram in a server's ``/metrics`` (every label set added up).

  Args:
    base_url: the server's root, http://HOST:PORT.
    name: the histogram, e.g. "mlkit:time_to_first_token_seconds".
    api_key: the server's ``--api-key``, when it has one.
    timeout_s: seconds to wait for the answer.

  Raises:
    OSError: the server did not answer.
    KeyError: it has no histogram of that name.
  """
  import urllib.request

  from prometheus_client.parser import text_string_to_metric_families
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  request = urllib.request.Request(base_url.rstrip("/") + "/metrics", headers=headers)
  with urllib.request.urlopen(request, timeout=timeout_s) as f:
    text = f.read().decode()
  for family in text_string_to_metric_families(text):
    if family.name == name and family.type == "histogram":
      total = sum(s.value for s in family.samples if s.name.endswith("_sum"))
      count = sum(int(s.value) for s in family.samples if s.name.endswith("_count"))
      return total, count
  raise KeyError(f"{base_url}/metrics has no histogram {name!r}")


TTFT_HISTOGRAM = "mlkit:time_to_first_token_seconds"


def server_snapshot(base_url: str, engine_metrics: dict, *, api_key: str | None = None) -> dict:
  """What :func:`server_figures` compares: a server engine's ``metrics()`` (through the
  server's control channel, ``mlkit.serve.client.Client.metrics``) and the sum and count of
  the server's TTFT histogram (:data:`TTFT_HISTOGRAM`, read from ``/metrics`` by
  :func:`served_histogram`, which says what it raises)."""
  total, count = served_histogram(base_url, TTFT_HISTOGRAM, api_key=api_key)
  return {"metrics": engine_metrics, "ttft_sum_s": total, "ttft_count": count}


def server_figures(before: dict, after: dict) -> dict:
  """A server's own figures between two :func:`server_snapshot`\\ s, keyed as
  :func:`drive` keys them: :func:`step_split`'s, and ``engine_mean_ttft_ms``, its engine's
  mean TTFT over the requests whose first token came in between (0.0 when none did)."""
  count = after["ttft_count"] - before["ttft_count"]
  ttft_s = (after["ttft_sum_s"] - before["ttft_sum_s"]) / count if count else 0.0
  return {**step_split(before["metrics"], after["metrics"]), "engine_mean_ttft_ms": 1e3 * ttft_s}
