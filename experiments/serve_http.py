"""serve_http: the same workload in process and through the OpenAI-compatible HTTP API.

What the front door costs. A colocated pool (random params, f32 KV, batch buckets
1 to 32, every bucket compiled before timing) serves random token-id prompts of
32 tokens, 64 output tokens each, at a fixed concurrency (a new request as soon
as one ends):

* **engine loop**: ``Engine.submit`` / ``step`` in this process, on the engine the
  server builds (``mlkit.serve.model.build_engine``); a request is submitted
  between steps, the moment the one before it ends; TTFT from submit;
* **in process**: the server's own engine thread (``ColocatedServer``) and its
  hand-off to asyncio, driven by asyncio clients in this process as the HTTP
  handlers drive it (``mlkit.serve.local_load``): everything but HTTP and the
  second process; TTFT from the hand-off to the first token's arrival;
* **HTTP**: ``python -m mlkit.serve --role colocated --http`` as a separate
  process, driven by ``mlkit.serve.bench`` (streamed completions) from this one;
  TTFT from the request's send to its first content chunk.

The three run one after the other, at concurrency 1, 8 and 32. Then in process
and HTTP run an open loop (Poisson arrivals, the same times both ways) at a third
and two thirds of the in-process request rate at concurrency 32. All of it runs
on SMALL_MLA (a decode step of 32 rows takes ~20 ms here) and on TINY_MLA (~2 ms: the front
door's cost per token is the same, so this is its worst case). The client runs
on the same two cores as the server. Targets (SMALL_MLA, concurrency 32): HTTP
keeps at least 90% of the in-process output tok/s and adds at most 5 ms to the
median TTFT. Writes serve_http.{json,md,png}.
"""

from __future__ import annotations

import os
import tempfile

from experiments import common

PROMPT, OUTPUT, PAGE = 32, 64, 16
VOCAB = 256  # prompt token ids are drawn below it (every model here has at least 256)
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
  """The token ids ``mlkit.serve.bench`` sends with this seed: one workload every way."""
  from mlkit.serve.bench import random_token_prompts
  return [p.prompt for p in random_token_prompts(n, PROMPT, OUTPUT, VOCAB, seed)]


def over_http(base: str, n: int, seed: int, *, concurrency=None, rate=None,
              control=None) -> dict:
  """``n`` streamed completions through ``mlkit.serve.bench`` (``bench.summary``'s figures);
  with ``control`` (an ``mlkit.serve.client.Client`` on the server's control channel), also
  the server's own step times and mean TTFT over the run (``local_load.server_figures``)."""
  import math

  from mlkit.serve import bench
  from mlkit.serve.local_load import server_figures, server_snapshot
  if control is not None:
    before = server_snapshot(base, control.metrics())
  out = bench.summary(bench.benchmark(bench.BenchConfig(
      base_url=base, num_prompts=n, max_concurrency=concurrency,
      request_rate=math.inf if rate is None else rate, random_input_len=PROMPT,
      random_output_len=OUTPUT, random_vocab_size=VOCAB, ignore_eos=True, seed=seed,
      progress_interval_s=0)))
  if control is not None:
    out.update(server_figures(before, server_snapshot(base, control.metrics())))
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


def one_model(model: str, levels, per_level, loads, open_n: int) -> tuple[list, list]:
  """Every way at every concurrency level, then the open loop at each fraction of the
  in-process top level's request rate (``loads``), for one model: (closed rows, open rows)."""
  import jax

  from mlkit.sampling import SamplingParams
  from mlkit.serve import launch, local_load
  from mlkit.serve.client import Client
  from mlkit.serve.model import ServeConfig, build_engine, load_model, warm_up_colocated
  cfg = ServeConfig(role="colocated", model=model, **ARGS)
  common.progress(f"serve_http: {model} in process (compiling every batch bucket first)")
  params, mcfg = load_model(cfg)
  engine = build_engine(cfg, params, mcfg)
  warm_up_colocated(engine)  # as the server does at start-up
  # The engine loop submits between steps in this thread (local_load.engine_loop); in process,
  # asyncio clients drive the server's own engine thread (local_load.drive), as HTTP does.
  sampling = SamplingParams(max_new_tokens=OUTPUT)
  rows = [{"model": model, "concurrency": c,
           "engine_loop": local_load.engine_loop(engine, _prompts(per_level(c), c), sampling,
                                                 concurrency=c),
           "in_process": local_load.drive(engine, _prompts(per_level(c), c), sampling,
                                          concurrency=c, seed=c)}
          for c in levels]
  capacity = rows[-1]["in_process"]["output_tok_s"] / OUTPUT  # requests per second
  # Open loop: Poisson arrivals seeded as mlkit.serve.bench's, so both ways see the same ones.
  opened = [{"model": model, "load": f, "rate": f * capacity,
             "in_process": local_load.drive(engine, _prompts(open_n, 7), sampling,
                                            rate=f * capacity, seed=7)}
            for f in loads]
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
    # Connections, and the HTTP path, warmed first.
    over_http(base, 2 * max(levels), 99, concurrency=max(levels))
    with Client(control_address) as control:
      for row in rows:
        c = row["concurrency"]
        row["http"] = over_http(base, per_level(c), c, concurrency=c, control=control)
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
      for row in opened:
        row["http"] = over_http(base, open_n, 7, rate=row["rate"], control=control)
        row["http_added_ttft_ms"] = (row["http"]["median_ttft_ms"]
                                     - row["in_process"]["median_ttft_ms"])
        common.progress(f"serve_http: {model}, open loop at {row['rate']:.1f} req/s "
                        f"({100 * row['load']:.0f}% of in-process capacity): TTFT "
                        f"{row['in_process']['median_ttft_ms']:.1f} ms in process, "
                        f"{row['http']['median_ttft_ms']:.1f} ms through HTTP")
  finally:
    proc.terminate()
    proc.wait(timeout=30)
  return rows, opened


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Runs the workload every way at each concurrency and load; writes serve_http.{json,md,png}."""
  models = ("tiny-mla",) if smoke else MODELS
  levels = (1, 4) if smoke else (1, 8, 32)
  per_level = (lambda c: 4 * c) if smoke else (lambda c: max(32, 8 * c)) if quick else (
      lambda c: max(64, 16 * c))
  loads = (1 / 3,) if smoke else (1 / 3, 2 / 3)
  open_n = 16 if smoke else 128 if quick else 256
  rows, opened = [], []
  for m in models:
    closed_rows, open_rows = one_model(m, levels, per_level, loads, open_n)
    rows += closed_rows
    opened += open_rows
  top = next(r for r in rows if r["model"] == models[0] and r["concurrency"] == levels[-1])
  record = common.record_header("serve_http", quick=quick, smoke=smoke, config={
      "models": list(models), "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
      "open_loop_requests": open_n, **ARGS})
  record.update(rows=rows, open_loop=opened,
                targets={"tok_s_ratio_at_32": 0.9, "added_ttft_ms": 5.0},
                tok_s_target_met=bool(top["http_over_in_process_tok_s"] >= 0.9),
                ttft_target_met=bool(top["http_added_ttft_ms"] <= 5.0))
  common.write_json(out_dir, "serve_http", record)
  common.write_markdown(out_dir, "serve_http", _markdown(record, top, quick))
  try:
    _plot(os.path.join(out_dir, "serve_http.png"), rows)
  except ImportError:
    pass
  return record


def _markdown(record: dict, top: dict, quick: bool) -> str:
  rows, opened = record["rows"], record["open_loop"]
  side = lambda r, k: [r["in_process"][k], r["http"][k]]  # noqa: E731
  md = ["# serve_http: in process vs through HTTP", "",
        f"Colocated, random params, f32 KV, {PROMPT}-token prompts, {OUTPUT} output tokens. "
        f"`python -m experiments serve_http{'' if quick else ' --full'}`.", "",
        "A closed loop at each concurrency, three ways: the **engine loop** submits between "
        "steps (no client reaction time); **in process**, asyncio clients hand requests to the "
        "server's own engine thread and read its updates as the HTTP handlers do, without HTTP "
        "(`mlkit.serve.local_load`); **HTTP** through the server process and "
        "`mlkit.serve.bench`. The targets compare HTTP with in process: what HTTP itself costs.",
        "", common.markdown_table(
            ["model", "concurrency", "engine-loop tok/s", "in-process tok/s", "HTTP tok/s",
             "HTTP / in-process", "engine-loop TTFT ms", "in-process TTFT ms", "HTTP TTFT ms",
             "added TTFT ms", "HTTP TPOT ms"],
            [[r["model"], r["concurrency"], r["engine_loop"]["output_tok_s"],
              *side(r, "output_tok_s"), f"{r['http_over_in_process_tok_s']:.2f}",
              r["engine_loop"]["median_ttft_ms"], *side(r, "median_ttft_ms"),
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
            [[r["model"], r["concurrency"], *side(r, "device_ms_per_step"),
              *side(r, "host_ms_per_step"), *side(r, "engine_mean_ttft_ms"),
              *side(r, "mean_ttft_ms"),
              r["in_process"]["mean_ttft_ms"] - r["in_process"]["engine_mean_ttft_ms"],
              r["http"]["mean_ttft_ms"] - r["http"]["engine_mean_ttft_ms"]] for r in rows]),
        "", "## Open loop", "",
        f"{record['config']['open_loop_requests']} requests at Poisson arrival times, the same "
        "times both ways (`mlkit.serve.bench.arrival_times`), at fractions of the in-process "
        "closed loop's top request rate: a client's reaction time no longer decides when its "
        "next request arrives, so the TTFTs differ only by what the front door costs, and by "
        "what its load does to the steps.", "",
        common.markdown_table(
            ["model", "load", "req/s", "in-process TTFT ms", "HTTP TTFT ms", "added TTFT ms",
             "engine TTFT ms in process", "engine TTFT ms HTTP", "device ms/step in process",
             "device ms/step HTTP"],
            [[r["model"], f"{100 * r['load']:.0f}%", r["rate"], *side(r, "median_ttft_ms"),
              f"{r['http_added_ttft_ms']:+.1f}", *side(r, "engine_mean_ttft_ms"),
              *side(r, "device_ms_per_step")] for r in opened]),
        "", f"Targets ({top['model']}, concurrency {top['concurrency']}): HTTP keeps at least "
        f"90% of in-process output tok/s ({'met' if record['tok_s_target_met'] else 'not met'}), "
        f"adds at most 5 ms to median TTFT "
        f"({'met' if record['ttft_target_met'] else 'not met'}).", "",
        "![serve_http](serve_http.png)"]
  return "\n".join(md) + "\n"
