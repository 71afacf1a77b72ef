"""serve_processes: what moving prefill and decode into two processes costs over one process.

The same params are served twice: by the in-process ``DisaggEngine`` (two pools
in this process, KV moved by a device copy) and by a pair of server processes
(``python -m mlkit.serve --role prefill`` and ``--role decode``, KV pulled with
JAX's transfer server over 127.0.0.1, control messages over a socket). Both use
a bf16 prefill KV cache and an fp8 decode KV cache (the KV is converted on
landing), bf16 weights, one device each.

Per prompt length, single requests of 2 greedy tokens (prefill, transfer, one
decode step), alternating between the two setups after one warm-up each:

* end-to-end latency (client call to result), median; the added milliseconds;
* TTFT: arrival to first token, as each engine records it (in process: the
  prefill step's result; processes: the decode server has the prefill
  server's offer, so the control round trip and the KV gather are in it);
* transfer bytes/s: payload bytes over the decode server's pull time.

On a CPU both processes share the same cores, so the numbers are the plumbing's
cost, not a network's. docs/serving_processes.md describes the protocol.
"""

from __future__ import annotations

import os
import subprocess
import time

import jax
import numpy as np

from experiments import common
from mlkit.serve import launch

SHAPES = {
    "smoke": dict(lengths=(16,), reps=1, n_layers=1),
    "quick": dict(lengths=(16, 64, 192), reps=3, n_layers=3),
    "full": dict(lengths=(16, 64, 128, 224), reps=7, n_layers=3),
}
PAGE, NUM_PAGES, MAX_PAGES, CHUNK, RUNNING = 16, 64, 16, 32, 4


def _serve_args(n_layers: int, kv_dtype: str) -> list[str]:
  return ["--model", "tiny-mla", "--n-layers", str(n_layers), "--recipe", "bf16", "--kv-dtype",
          kv_dtype, "--page-size", str(PAGE), "--num-pages", str(NUM_PAGES), "--max-running",
          str(RUNNING), "--prefill-chunk", str(CHUNK), "--max-pages-per-seq", str(MAX_PAGES)]


def _in_process(n_layers: int):
  from mlkit.engine.disagg import DisaggConfig, DisaggEngine, PoolConfig
  from mlkit.parallel import MeshConfig
  from mlkit.quant import BF16
  from mlkit.serve.model import ServeConfig, engine_config, load_model
  kw = dict(model="tiny-mla", n_layers=n_layers, recipe="bf16", page_size=PAGE,
            num_pages=NUM_PAGES, max_running=RUNNING, prefill_chunk=CHUNK,
            max_pages_per_seq=MAX_PAGES)
  pre = ServeConfig(role="prefill", kv_dtype="bfloat16", **kw)
  dec = ServeConfig(role="decode", kv_dtype="float8_e4m3fn", **kw)
  params, mcfg = load_model(pre)
  cfg = DisaggConfig(prefill=PoolConfig(engine_config(pre, mcfg), BF16, MeshConfig()),
                     decode=PoolConfig(engine_config(dec, mcfg), BF16, MeshConfig()))
  return DisaggEngine(params, cfg, devices=jax.devices()[:2])


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Runs the comparison and writes serve_processes.{json,md,png}; returns the record."""
  from mlkit.engine import request_metrics
  from mlkit.sampling import SamplingParams
  from mlkit.serve.client import Client
  shape = SHAPES["smoke" if smoke else ("quick" if quick else "full")]
  if len(jax.devices()) < 2:
    raise ValueError("serve_processes needs 2 devices for the in-process reference; on CPU set "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=2 (python -m experiments does)")
  # The servers' logs sit beside the results, so a run's output is one folder.
  logs = os.path.join(out_dir, "serve_processes_logs")
  os.makedirs(logs, exist_ok=True)
  pre_addr, dec_addr = f"127.0.0.1:{launch.free_port()}", f"127.0.0.1:{launch.free_port()}"
  common.progress(f"serve_processes: starting a prefill and a decode server (logs in {logs})")
  pre = launch.start("prefill", pre_addr, _serve_args(shape["n_layers"], "bfloat16"),
                     log=os.path.join(logs, "prefill.log"))
  dec = launch.start("decode", dec_addr, _serve_args(shape["n_layers"], "float8_e4m3fn")
                     + ["--prefill", pre_addr, "--connect-timeout", "300"],
                     log=os.path.join(logs, "decode.log"))
  rows, record_rows = [], []
  try:
    engine = _in_process(shape["n_layers"])
    launch.wait_ready(dec, os.path.join(logs, "decode.log"))
    client = Client(dec_addr, timeout_s=300)
    rng = np.random.default_rng(0)
    sampling = SamplingParams(max_new_tokens=2)
    for n in shape["lengths"]:
      prompt = [int(t) for t in rng.integers(0, 256, n)]
      res = {"inproc_e2e": [], "inproc_ttft": [], "proc_e2e": [], "proc_ttft": []}
      bytes0 = secs0 = 0
      for rep in range(shape["reps"] + 1):  # rep 0 warms up both (compiles for this length)
        t0 = time.perf_counter()
        rid = engine.submit(prompt, sampling)
        engine.run_until_done()
        e2e = time.perf_counter() - t0
        ttft = request_metrics(engine.get(rid))["ttft_s"]
        in_tokens = list(engine.get(rid).output)
        t0 = time.perf_counter()
        (out,) = client.generate([prompt], max_new_tokens=2)
        p_e2e = time.perf_counter() - t0
        if out["tokens"] != in_tokens:
          common.progress(f"serve_processes: length {n}: tokens differ {out['tokens']} vs "
                          f"{in_tokens}")
        if rep == 0:
          m = client.metrics()["serve"]
          bytes0, secs0 = m["transfer_bytes"], m["transfer_seconds"]
          continue
        res["inproc_e2e"].append(e2e)
        res["inproc_ttft"].append(ttft)
        res["proc_e2e"].append(p_e2e)
        res["proc_ttft"].append(out["ttft_s"])
      m = client.metrics()["serve"]
      nbytes, secs = m["transfer_bytes"] - bytes0, m["transfer_seconds"] - secs0
      med = {k: float(np.median(v)) for k, v in res.items()}
      row = dict(prompt_tokens=n, payload_bytes=nbytes // shape["reps"],
                 transfer_mb_s=nbytes / secs / 1e6 if secs > 0 else None,
                 **{f"{k}_ms": 1e3 * v for k, v in med.items()},
                 added_e2e_ms=1e3 * (med["proc_e2e"] - med["inproc_e2e"]),
                 added_ttft_ms=1e3 * (med["proc_ttft"] - med["inproc_ttft"]),
                 same_tokens=out["tokens"] == in_tokens)
      record_rows.append(row)
      common.progress(f"serve_processes: {n} tokens: {row['transfer_mb_s'] or 0:.1f} MB/s, "
                      f"e2e {row['inproc_e2e_ms']:.1f} -> {row['proc_e2e_ms']:.1f} ms "
                      f"({row['added_e2e_ms']:+.1f}), TTFT {row['inproc_ttft_ms']:.1f} -> "
                      f"{row['proc_ttft_ms']:.1f} ms ({row['added_ttft_ms']:+.1f})")
      rows.append([n, row["payload_bytes"], f"{row['transfer_mb_s'] or 0:.1f}",
                   f"{row['inproc_e2e_ms']:.1f}", f"{row['proc_e2e_ms']:.1f}",
                   f"{row['added_e2e_ms']:+.1f}", f"{row['inproc_ttft_ms']:.1f}",
                   f"{row['proc_ttft_ms']:.1f}", f"{row['added_ttft_ms']:+.1f}",
                   "yes" if row["same_tokens"] else "no"])
    for addr in (dec_addr, pre_addr):
      with Client(addr, timeout_s=10) as c:
        c.shutdown()
  finally:
    for proc in (dec, pre):
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        proc.kill()
  config = dict(model="tiny-mla", n_layers=shape["n_layers"], page_size=PAGE,
                prefill_kv="bfloat16", decode_kv="float8_e4m3fn", weights="bf16",
                new_tokens=2, reps=shape["reps"], lengths=list(shape["lengths"]))
  record = common.record_header("serve_processes", quick=quick, smoke=smoke, config=config)
  record["rows"] = record_rows
  common.write_json(out_dir, "serve_processes", record)
  table = common.markdown_table(
      ["prompt tokens", "payload bytes", "transfer MB/s", "in-process e2e ms", "processes e2e ms",
       "added e2e ms", "in-process TTFT ms", "processes TTFT ms", "added TTFT ms", "same tokens"],
      rows)
  common.write_markdown(out_dir, "serve_processes",
                        "# Prefill and decode as two processes vs one\n\n" + table + "\n\n"
                        "Single requests, 2 greedy tokens, medians; a bf16 prefill KV pool, an "
                        "fp8 decode KV pool, one CPU device each; KV pulled with "
                        "jax.experimental.transfer over 127.0.0.1.\n")
  try:
    xs = [r["prompt_tokens"] for r in record_rows]
    common.plot_lines(os.path.join(out_dir, "serve_processes.png"),
                      {"in-process e2e": (xs, [r["inproc_e2e_ms"] for r in record_rows]),
                       "processes e2e": (xs, [r["proc_e2e_ms"] for r in record_rows]),
                       "in-process TTFT": (xs, [r["inproc_ttft_ms"] for r in record_rows]),
                       "processes TTFT": (xs, [r["proc_ttft_ms"] for r in record_rows])},
                      xlabel="prompt tokens", ylabel="ms (median)",
                      title="prefill + transfer + 1 decode step: one process vs two")
  except ImportError:
    pass
  return record
