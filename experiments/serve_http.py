"""serve_http: the same workload in process and through the OpenAI-compatible HTTP API.

What the front door costs. A colocated pool (random params, f32 KV, batch buckets
1 to 32, every bucket compiled before timing) serves random token-id prompts of
32 tokens, 64 output tokens each, at a fixed concurrency (a new request as soon
as one ends):

* **engine loop**: ``Engine.submit`` / ``step`` in this process, on the engine the
  server builds (``mlkit.serve.model.build_engine``); a request is submitted
  between steps, the moment the one before it ends; TTFT from submit;
* **in process**: the server's own engine thread (``ColocatedServer``) and its
  hand-off to asyncio (``mlkit.serve.http.calls``) in this process, driven by
  asyncio clients as the HTTP handlers drive it: everything but HTTP and the
  second process; TTFT from the hand-off to the first token's arrival;
* **HTTP**: ``python -m mlkit.serve --role colocated --http`` as a separate
  process, driven by ``mlkit.serve.bench`` (streamed completions) from this one;
  TTFT from the request's send to its first content chunk.

The three run one after the other, at concurrency 1, 8 and 32, on SMALL_MLA (a
decode step of 32 rows takes ~20 ms here) and on TINY_MLA (~2 ms: the front
door's cost per token is the same, so this is its worst case). The client runs
on the same two cores as the server. Targets (SMALL_MLA, concurrency 32): HTTP
keeps at least 90% of the in-process output tok/s and adds at most 5 ms to the
median TTFT. Writes serve_http.{json,md,png}.
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from experiments import common

PROMPT, OUTPUT, PAGE = 32, 64, 16
# SMALL_MLA's decode step at 32 rows takes ~20 ms on this CPU, TINY_MLA's ~2 ms: per output
# token the front door's cost is the same, so TINY_MLA is its worst case.
MODELS = ("small-mla", "tiny-mla")
ARGS = dict(kv_dtype="float32", num_pages=8 + 32 * 6, max_running=32, prefill_chunk=32,
            max_pages_per_seq=8, page_size=PAGE, batch_buckets=(1, 2, 4, 8, 16, 32))


def _flags(model: str, port: int) -> list[str]:
  flags = ["--model", model, "--http", str(port), "--max-waiting", "4096"]
  for k, v in ARGS.items():
    flags += [f"--{k.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, tuple) else str(v)]
  return flags


def _prompts(n: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, PROMPT).tolist() for _ in range(n)]


def _summary(n: int, tokens: int, wall: float, ttft: list, tpot: list) -> dict:
  """One way's figures from its wall time and per-request TTFT / TPOT (seconds)."""
  return {"requests": n, "output_tokens": tokens, "duration_s": wall,
          "output_tok_s": tokens / wall, "median_ttft_ms": 1e3 * float(np.median(ttft)),
          "mean_ttft_ms": 1e3 * float(np.mean(ttft)),
          "median_tpot_ms": 1e3 * float(np.median(tpot))}


def _engine_split(before: dict, after: dict, engine_ttft_s: float, n: int) -> dict:
  """Where a way's time went inside the server, from two engine metrics snapshots
  (``Engine.metrics()``) around it: steps, device and host milliseconds per step, and the
  engine's own mean TTFT (``engine_ttft_s`` summed over ``n`` requests: from the request's
  arrival in the engine to its first token, without the hand-off, HTTP or the client)."""
  steps = after["steps"] - before["steps"]
  per_step = lambda k: 1e3 * (after[k] - before[k]) / max(steps, 1)  # noqa: E731
  return {"steps": steps, "device_ms_per_step": per_step("device_seconds"),
          "host_ms_per_step": per_step("host_seconds"),
          "engine_mean_ttft_ms": 1e3 * engine_ttft_s / max(n, 1)}


def in_process(engine, n: int, concurrency: int, seed: int) -> dict:
  """Closed loop over ``engine``: ``concurrency`` requests in flight until ``n`` ended."""
  from mlkit.sampling import SamplingParams
  prompts = _prompts(n, seed)
  sampling = SamplingParams(max_new_tokens=OUTPUT)
  live, done, next_i = {}, [], 0
  t0 = time.perf_counter()
  while len(done) < n:
    while len(live) < concurrency and next_i < n:
      rid = engine.submit(prompts[next_i], sampling)
      live[rid] = engine.get(rid)
      next_i += 1
    for o in engine.step():
      if o.done and o.request_id in live:
        done.append(live.pop(o.request_id))
  wall = time.perf_counter() - t0
  tokens = sum(len(r.output) for r in done)
  ttft = [r.first_token_time - r.arrival_time for r in done]
  tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in done]
  return _summary(n, tokens, wall, ttft, tpot)


def in_process_clients(engine, n: int, concurrency: int, seed: int) -> dict:
  """The HTTP server's own engine loop and hand-off, in this process, without HTTP.

  The engine runs ``ColocatedServer.serve_forever`` in a thread, as the server's main thread
  does; ``concurrency`` asyncio clients submit ``Call`` objects to its inbox and read their
  updates, as the HTTP handlers do (``mlkit.serve.http.calls``). A client sends its next
  request when its last one's final update arrives (in the engine loop, :func:`in_process`,
  the next request is submitted between steps). TTFT from the submit to the first token's
  arrival on the asyncio side.
  """
  import asyncio
  import threading

  from mlkit.sampling import SamplingParams
  from mlkit.serve.decode import ColocatedServer
  from mlkit.serve.http.calls import HTTP, Accepted, Call
  prompts = _prompts(n, seed)
  sampling = SamplingParams(max_new_tokens=OUTPUT)
  server = ColocatedServer(engine, None, model_name="in-process", max_waiting=4 * n)
  thread = threading.Thread(target=server.serve_forever, daemon=True, name="engine")
  thread.start()
  ttft, tpot, tokens, next_i = [], [], 0, iter(range(n))
  engine_ttft = []  # the engine's own TTFT of each request (Update.ttft_s)
  before = engine.metrics()

  async def client() -> None:
    nonlocal tokens
    loop = asyncio.get_running_loop()
    for i in next_i:
      call = Call([prompts[i]], [sampling], loop)
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
        if u.done and u.ttft_s is not None:
          engine_ttft.append(u.ttft_s)
        got += len(u.tokens)
        if u.done:
          break
      if u.abort_reason is not None:
        raise RuntimeError(f"an in-process request was aborted: {u.abort_reason}: {u.error}")
      ttft.append(t_first - t0)
      tpot.append((time.perf_counter() - t_first) / max(got - 1, 1))
      tokens += got

  async def all_clients() -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0

  try:
    wall = asyncio.run(all_clients())
  finally:
    server.stop()
    thread.join(30)
  return dict(_summary(n, tokens, wall, ttft, tpot),
              **_engine_split(before, engine.metrics(), sum(engine_ttft), len(engine_ttft)))


def _served_ttft(base: str) -> tuple[float, int]:
  """(sum of seconds, count) of the server's TTFT histogram, from its /metrics."""
  import urllib.request

  from prometheus_client.parser import text_string_to_metric_families
  with urllib.request.urlopen(base + "/metrics", timeout=30) as f:
    text = f.read().decode()
  total, count = 0.0, 0
  for family in text_string_to_metric_families(text):
    if family.name == "mlkit:time_to_first_token_seconds":
      for sample in family.samples:
        if sample.name.endswith("_sum"):
          total += sample.value
        elif sample.name.endswith("_count"):
          count += int(sample.value)
  return total, count


def over_http(base: str, n: int, concurrency: int, seed: int, control=None) -> dict:
  """``n`` streamed completions through ``mlkit.serve.bench``; with ``control`` (an
  ``mlkit.serve.client.Client`` on the server's control channel), also the server's
  step times and its engine's own TTFT over the run."""
  from mlkit.serve import bench
  if control is not None:
    before, ttft_before = control.metrics(), _served_ttft(base)
  r = bench.benchmark(bench.BenchConfig(
      base_url=base, num_prompts=n, max_concurrency=concurrency, random_input_len=PROMPT,
      random_output_len=OUTPUT, random_vocab_size=256, ignore_eos=True, seed=seed,
      progress_interval_s=0))
  m = r["metrics"]
  if m["failed"]:
    raise RuntimeError(f"{m['failed']} HTTP requests failed: "
                       f"{next(q['error'] for q in r['requests'] if not q['success'])}")
  out = {"requests": m["completed"], "output_tokens": m["total_output_tokens"],
         "duration_s": m["duration_s"], "output_tok_s": m["output_throughput"],
         "median_ttft_ms": m["median_ttft_ms"], "mean_ttft_ms": m["mean_ttft_ms"],
         "median_tpot_ms": m["median_tpot_ms"]}
  if control is not None:
    total, count = _served_ttft(base)
    out.update(_engine_split(before, control.metrics(), total - ttft_before[0],
                             count - ttft_before[1]))
  return out


def _plot(path: str, rows: list[dict]) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
  for model in dict.fromkeys(r["model"] for r in rows):
    mine = [r for r in rows if r["model"] == model]
    xs = [r["concurrency"] for r in mine]
    for where, style in (("engine_loop", "^:"), ("in_process", "o-"), ("http", "s--")):
      label = f"{model}, {where.replace('_', ' ')}"
      a.plot(xs, [r[where]["output_tok_s"] for r in mine], style, label=label)
      b.plot(xs, [r[where]["median_ttft_ms"] for r in mine], style, label=label)
  a.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="output tok/s",
        title="throughput")
  b.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="median TTFT (ms)",
        title="time to first token")
  for ax in (a, b):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def one_model(model: str, levels, per_level) -> list[dict]:
  """Both ways at every concurrency level for one model; a row per level."""
  import jax

  from mlkit.serve import launch
  from mlkit.serve.client import Client
  from mlkit.serve.model import ServeConfig, build_engine, load_model, warm_up_colocated
  cfg = ServeConfig(role="colocated", model=model, **ARGS)
  common.progress(f"serve_http: {model} in process (compiling every batch bucket first)")
  params, mcfg = load_model(cfg)
  engine = build_engine(cfg, params, mcfg)
  warm_up_colocated(engine)  # as the server does at start-up
  rows = []
  for c in levels:
    rows.append({"model": model, "concurrency": c,
                 "engine_loop": in_process(engine, per_level(c), c, seed=c),
                 "in_process": in_process_clients(engine, per_level(c), c, seed=c)})
  del engine, params
  jax.clear_caches()
  tmp = tempfile.mkdtemp(prefix="mlkit-serve-http-")
  port, log = launch.free_port(), os.path.join(tmp, "server.log")
  control_address = f"127.0.0.1:{launch.free_port()}"
  proc = launch.start("colocated", control_address, _flags(model, port), log=log)
  try:
    launch.wait_ready(proc, log, timeout_s=900)
    base = f"http://127.0.0.1:{port}"
    common.progress(f"serve_http: {model} through HTTP (mlkit.serve.bench)")
    over_http(base, 2 * max(levels), max(levels), seed=99)  # connections, and the HTTP path
    for row in rows:
      c = row["concurrency"]
      with Client(control_address) as control:
        row["http"] = over_http(base, per_level(c), c, seed=c, control=control)
      row["http_over_in_process_tok_s"] = (row["http"]["output_tok_s"]
                                           / row["in_process"]["output_tok_s"])
      row["http_added_ttft_ms"] = (row["http"]["median_ttft_ms"]
                                   - row["in_process"]["median_ttft_ms"])
      common.progress(f"serve_http: {model}, concurrency {c}: engine loop "
                      f"{row['engine_loop']['output_tok_s']:.0f} tok/s, in process "
                      f"{row['in_process']['output_tok_s']:.0f} tok/s, HTTP "
                      f"{row['http']['output_tok_s']:.0f} tok/s "
                      f"({100 * row['http_over_in_process_tok_s']:.0f}%), TTFT "
                      f"{row['http_added_ttft_ms']:+.1f} ms, device ms per step "
                      f"{row['in_process']['device_ms_per_step']:.2f} in process, "
                      f"{row['http']['device_ms_per_step']:.2f} serving HTTP")
  finally:
    proc.terminate()
    proc.wait(timeout=30)
  return rows


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Runs the workload both ways at each concurrency; writes serve_http.{json,md,png}."""
  models = ("tiny-mla",) if smoke else MODELS
  levels = (1, 4) if smoke else (1, 8, 32)
  per_level = (lambda c: 4 * c) if smoke else (lambda c: max(32, 8 * c)) if quick else (
      lambda c: max(64, 16 * c))
  rows = [r for m in models for r in one_model(m, levels, per_level)]
  top = next(r for r in rows if r["model"] == models[0] and r["concurrency"] == levels[-1])
  record = common.record_header("serve_http", quick=quick, smoke=smoke, config={
      "models": list(models), "prompt_tokens": PROMPT, "output_tokens": OUTPUT, **ARGS})
  record.update(rows=rows, targets={"tok_s_ratio_at_32": 0.9, "added_ttft_ms": 5.0},
                tok_s_target_met=bool(top["http_over_in_process_tok_s"] >= 0.9),
                ttft_target_met=bool(top["http_added_ttft_ms"] <= 5.0))
  common.write_json(out_dir, "serve_http", record)
  md = ["# serve_http: in process vs through HTTP", "",
        f"Colocated, random params, f32 KV, {PROMPT}-token prompts, {OUTPUT} output tokens, a "
        f"closed loop at each concurrency. `python -m experiments serve_http"
        f"{'' if quick else ' --full'}`.", "",
        "Three ways: the **engine loop** submits between steps (no client reaction time); "
        "**in process**, asyncio clients hand requests to the server's own engine thread and "
        "read its updates as the HTTP handlers do, without HTTP; **HTTP** through the server "
        "process and `mlkit.serve.bench`. The targets compare HTTP with in process: what HTTP "
        "itself costs.", "",
        common.markdown_table(
            ["model", "concurrency", "engine-loop tok/s", "in-process tok/s", "HTTP tok/s",
             "HTTP / in-process", "engine-loop TTFT ms", "in-process TTFT ms", "HTTP TTFT ms",
             "added TTFT ms", "HTTP TPOT ms"],
            [[r["model"], r["concurrency"], r["engine_loop"]["output_tok_s"],
              r["in_process"]["output_tok_s"], r["http"]["output_tok_s"],
              f"{r['http_over_in_process_tok_s']:.2f}", r["engine_loop"]["median_ttft_ms"],
              r["in_process"]["median_ttft_ms"], r["http"]["median_ttft_ms"],
              f"{r['http_added_ttft_ms']:+.1f}", r["http"]["median_tpot_ms"]] for r in rows]),
        "", "## Where the added TTFT goes", "",
        "The engine's own TTFT runs from a request's arrival in the engine to its first token "
        "(its `Request` timestamps: in process from each request's last update, through HTTP "
        "from the server's `mlkit:time_to_first_token_seconds` histogram, so means); the "
        "client's adds the hand-off to the engine thread, HTTP and the client itself. Step "
        "times are the engine's (`Engine.metrics()`, through HTTP over the control channel): "
        "device ms is launch to results, host ms the engine thread's own work. The client, "
        "the HTTP thread and XLA's compute threads share this machine's two cores.", "",
        common.markdown_table(
            ["model", "concurrency", "device ms/step in process", "device ms/step HTTP",
             "host ms/step in process", "host ms/step HTTP", "engine TTFT ms in process",
             "engine TTFT ms HTTP", "client TTFT ms in process", "client TTFT ms HTTP",
             "outside the engine ms in process", "outside the engine ms HTTP"],
            [[r["model"], r["concurrency"], r["in_process"]["device_ms_per_step"],
              r["http"]["device_ms_per_step"], r["in_process"]["host_ms_per_step"],
              r["http"]["host_ms_per_step"], r["in_process"]["engine_mean_ttft_ms"],
              r["http"]["engine_mean_ttft_ms"], r["in_process"]["mean_ttft_ms"],
              r["http"]["mean_ttft_ms"],
              r["in_process"]["mean_ttft_ms"] - r["in_process"]["engine_mean_ttft_ms"],
              r["http"]["mean_ttft_ms"] - r["http"]["engine_mean_ttft_ms"]] for r in rows]),
        "", f"Targets ({top['model']}, concurrency {top['concurrency']}): HTTP keeps at least "
        f"90% of in-process output tok/s ({'met' if record['tok_s_target_met'] else 'not met'}), "
        f"adds at most 5 ms to median TTFT "
        f"({'met' if record['ttft_target_met'] else 'not met'}).", "",
        "![serve_http](serve_http.png)"]
  common.write_markdown(out_dir, "serve_http", "\n".join(md) + "\n")
  try:
    _plot(os.path.join(out_dir, "serve_http.png"), rows)
  except ImportError:
    pass
  return record
