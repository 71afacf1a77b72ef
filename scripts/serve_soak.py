"""A soak of a served checkpoint under load and faults: `make soak` runs it (several minutes).

    python scripts/serve_soak.py [--duration 240] [--clients 12] [--out results/soak]

It saves a small checkpoint, serves it with a prefill server and a decode
server (bf16 KV on the prefill side, fp8 on the decode side, both with fault
injection on), records every distinct prompt's output served alone, and then
drives the pair with many concurrent clients for ``--duration`` seconds:

* clients that disconnect in the middle of their request, and clients whose
  requests another connection cancels;
* page faults injected into the decode server's allocator (use after free,
  double allocation, wrong page, stale tag) and corrupted KV transfers
  (a bit flipped after the prefill server's checksum).

It checks, and exits 1 if any fails:

* every request that finished has exactly the output it had when served alone
  (aborted ones stopped on a prefix of it);
* once idle, no page leaks: no page used on either side, every quarantined
  page healed, the decode pool whole;
* server RSS stays flat: start (after warm-up), peak and end are reported, and
  the growth over the run's second half must stay under 5% and 64 MB.

It writes ``serve_soak.json`` (figures, counts by outcome, RSS samples) under
``--out``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from pallas_kernels.h200 import env as h200_env  # noqa: E402

h200_env.prepare(ptxas_report=False)  # the CPU where there is no GPU, before jax is imported

PAGE_FAULTS = ("use_after_free", "double_allocation", "wrong_page", "stale_tag")


def rss_mb(pid: int) -> float:
  """Resident memory of a process (MB), from /proc."""
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return float("nan")


def save_model(path: str, seed: int) -> None:
  """A 2-layer TINY_MLA checkpoint with random params (orbax, mlkit.checkpoint)."""
  import jax

  from configs.models import MODEL_PRESETS
  from mlkit.checkpoint import save_checkpoint
  from mlkit.model import init_params
  cfg = MODEL_PRESETS["tiny-mla"].first_layers(2)
  save_checkpoint(path, init_params(cfg, jax.random.PRNGKey(seed)), cfg)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--duration", type=float, default=240.0, help="seconds of load")
  p.add_argument("--clients", type=int, default=12, help="concurrent client threads")
  p.add_argument("--prompts", type=int, default=24, help="distinct prompts")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=os.path.join(ROOT, "results", "soak"))
  args = p.parse_args(argv)

  from mlkit import wire
  from mlkit.serve import launch
  from mlkit.serve import protocol as proto
  from mlkit.serve.client import Client, ServerError

  rng = random.Random(args.seed)
  tmp = tempfile.mkdtemp(prefix="mlkit-soak-")
  os.environ.setdefault(wire.keys.ENV_KEY_FILE, os.path.join(tmp, "serve.key"))
  ckpt = os.path.join(tmp, "ckpt")
  print(f"soak: saving a checkpoint to {ckpt}", flush=True)
  save_model(ckpt, args.seed)
  # Both pools hold 64 tokens per sequence (16 pages of 4, 8 pages of 8).
  common = ["--checkpoint", ckpt, "--num-pages", "48", "--max-running", "4",
            "--prefill-chunk", "8", "--enable-fault-injection"]
  pre_addr, dec_addr = (f"127.0.0.1:{launch.free_port()}" for _ in range(2))
  logs = [os.path.join(tmp, f"{r}.log") for r in ("prefill", "decode")]
  pre = launch.start("prefill", pre_addr, [*common, "--kv-dtype", "bfloat16", "--page-size", "4",
                                           "--max-pages-per-seq", "16", "--offer-timeout", "20"],
                     log=logs[0])
  dec = launch.start("decode", dec_addr, [*common, "--kv-dtype", "float8_e4m3fn", "--page-size",
                                          "8", "--max-pages-per-seq", "8", "--prefill", pre_addr,
                                          "--connect-timeout", "300", "--prefill-timeout", "30"],
                     log=logs[1])
  failures: list[str] = []
  try:
    for proc, log in ((pre, logs[0]), (dec, logs[1])):
      launch.wait_ready(proc, log, timeout_s=600)
    print(f"soak: servers ready (prefill {pre_addr}, decode {dec_addr}; logs in {tmp})",
          flush=True)
    vocab = 256
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))]
               for _ in range(args.prompts)]
    samplings = [dict(max_new_tokens=rng.randint(2, 12), temperature=0.0 if i % 3 else 0.8,
                      top_k=0, top_p=1.0, seed=i, stop_tokens=[]) for i in range(args.prompts)]
    with Client(dec_addr, timeout_s=300) as c:
      alone = []
      for i in range(args.prompts):  # each distinct request, served alone
        (o,) = c.generate([prompts[i]], sampling=[samplings[i]])
        if o["status"] != "finished":
          raise RuntimeError(f"prompt {i} did not finish alone: {o}")
        alone.append(o["tokens"])
      total_pages = c.metrics()["pages_total"]
    print(f"soak: {args.prompts} reference outputs served alone", flush=True)

    rss = {"prefill": [], "decode": []}
    outcomes: collections.Counter = collections.Counter()
    wrong: list = []
    lock = threading.Lock()
    stop = threading.Event()
    t_start = time.monotonic()
    batch_ids = iter(range(1, 1 << 62))

    def record(idx, out):
      with lock:
        if out["status"] == "finished":
          outcomes["finished"] += 1
          if out["tokens"] != alone[idx]:
            wrong.append((idx, out["tokens"], alone[idx]))
        else:
          outcomes[f"aborted:{out['abort_reason']}"] += 1
          if out["tokens"] != alone[idx][:len(out["tokens"])]:
            wrong.append((idx, out["tokens"], alone[idx]))

    def client_loop(seed):
      r = random.Random(seed)
      while not stop.is_set():
        idxs = [r.randrange(args.prompts) for _ in range(r.randint(1, 3))]
        action = r.random()
        try:
          if action < 0.1:  # disconnect in the middle of it
            conn = wire.connect(proto.parse_address(dec_addr), wire.client_key())
            conn.send(proto.message("generate", prompts=[prompts[i] for i in idxs],
                                    sampling=[samplings[i] for i in idxs]))
            time.sleep(r.uniform(0.0, 0.3))
            conn.close()
            with lock:
              outcomes["disconnected_calls"] += 1
            continue
          with Client(dec_addr, timeout_s=300) as c:
            with lock:
              bid = next(batch_ids)
            if action < 0.2:  # cancelled from another connection
              def cancel(bid=bid, delay=r.uniform(0.0, 0.3)):
                time.sleep(delay)
                with Client(dec_addr, timeout_s=60) as other:
                  other.cancel(bid)
              threading.Thread(target=cancel, daemon=True).start()
            outs = c.generate([prompts[i] for i in idxs], sampling=[samplings[i] for i in idxs],
                              batch=bid)
          for i, o in zip(idxs, outs):
            record(i, o)
        except (ConnectionError, TimeoutError, ServerError) as e:
          with lock:
            outcomes[f"client_error:{type(e).__name__}"] += 1

    def faults_loop():
      r = random.Random(args.seed + 1)
      with Client(dec_addr, timeout_s=60) as d, Client(pre_addr, timeout_s=60) as pf:
        while not stop.wait(r.uniform(0.5, 2.0)):
          try:
            if r.random() < 0.6:
              d.request("fault", page_fault=r.choice(PAGE_FAULTS))
              with lock:
                outcomes["faults:page"] += 1
            else:
              pf.request("fault", corrupt=1)
              with lock:
                outcomes["faults:transfer"] += 1
          except ServerError:
            pass  # no running request to fault right now

    threads = [threading.Thread(target=client_loop, args=(args.seed * 1000 + i,), daemon=True)
               for i in range(args.clients)]
    threads.append(threading.Thread(target=faults_loop, daemon=True))
    rss_start = {"prefill": rss_mb(pre.pid), "decode": rss_mb(dec.pid)}
    for t in threads:
      t.start()
    next_report = 10.0
    while (elapsed := time.monotonic() - t_start) < args.duration:
      time.sleep(1.0)
      for name, proc in (("prefill", pre), ("decode", dec)):
        rss[name].append((round(elapsed, 1), rss_mb(proc.pid)))
      if elapsed >= next_report:
        next_report += 10.0
        with lock:
          done = sum(v for k, v in outcomes.items() if k == "finished" or k.startswith("aborted"))
          print(f"soak: [{elapsed:5.0f} s] {done} requests ended ({outcomes['finished']} "
                f"finished), {len(wrong)} wrong; RSS prefill {rss['prefill'][-1][1]:.0f} MB, "
                f"decode {rss['decode'][-1][1]:.0f} MB", flush=True)
    stop.set()
    for t in threads:
      t.join(120)
    print("soak: load stopped; checking the idle pair", flush=True)

    with Client(dec_addr, timeout_s=300) as c, Client(pre_addr, timeout_s=60) as pf:
      deadline = time.monotonic() + 60
      while True:  # the decode server notices the last disconnects and cancels
        m, mp = c.metrics(), pf.metrics()
        if (m["pages_used"] == 0 and m["serve"]["in_flight"] == 0 and mp["pages_used"] == 0) \
            or time.monotonic() > deadline:
          break
        time.sleep(0.5)
      # One request on the idle pair: its steps heal whatever is still quarantined.
      (o,) = c.generate([prompts[0]], sampling=[samplings[0]])
      if o["tokens"] != alone[0]:
        failures.append(f"after the load prompt 0 gave {o['tokens']}, alone {alone[0]}")
      m, mp = c.metrics(), pf.metrics()
    rss_end = {"prefill": rss_mb(pre.pid), "decode": rss_mb(dec.pid)}

    if wrong:
      failures.append(f"{len(wrong)} request(s) differ from the same request served alone; "
                      f"first: {wrong[0]}")
    if m["pages_used"] or mp["pages_used"]:
      failures.append(f"pages still used once idle: decode {m['pages_used']}, prefill "
                      f"{mp['pages_used']}")
    if m["pages_quarantined"] or m["pages_free"] != total_pages:
      failures.append(f"the decode pool is not whole once idle: {m['pages_free']} free, "
                      f"{m['pages_quarantined']} quarantined of {total_pages}")
    rss_summary = {}
    for name in ("prefill", "decode"):
      samples = [v for _, v in rss[name]]
      half = samples[len(samples) // 2] if samples else float("nan")
      growth = rss_end[name] - half
      rss_summary[name] = {"start_mb": rss_start[name], "peak_mb": max(samples + [rss_end[name]]),
                           "mid_mb": half, "end_mb": rss_end[name],
                           "second_half_growth_mb": growth}
      if growth > min(64.0, 0.05 * half):
        failures.append(f"{name} server RSS grew {growth:.0f} MB over the second half "
                        f"({half:.0f} -> {rss_end[name]:.0f} MB)")
    result = {
        "duration_s": args.duration, "clients": args.clients, "prompts": args.prompts,
        "outcomes": dict(outcomes), "wrong_outputs": len(wrong), "rss": rss_summary,
        "decode_metrics": {k: m[k] for k in ("pages_total", "pages_free", "pages_quarantined",
                                             "pages_quarantined_total", "pages_healed_total",
                                             "integrity_failures", "page_violations", "aborted")},
        "decode_serve": m["serve"], "prefill_serve": mp["serve"],
        "rss_samples": rss, "failures": failures,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "serve_soak.json")
    with open(path, "w") as f:
      json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=1))
    print(f"soak: wrote {path}")
  finally:
    for proc, addr in ((dec, dec_addr), (pre, pre_addr)):
      try:
        with Client(addr, timeout_s=10) as c:
          c.shutdown()
        proc.wait(timeout=30)
      except Exception:  # noqa: BLE001 - the soak's own verdict stands
        proc.kill()
        proc.wait()
  if failures:
    print("soak: FAILED\n  " + "\n  ".join(failures), file=sys.stderr)
    return 1
  print("soak: passed")
  return 0


if __name__ == "__main__":
  sys.exit(main())
