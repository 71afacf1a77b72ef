"""The one prepared device check: every kernel at its target shapes, checked and timed, as JSONL.

On an H200 (its image's python3, nothing installed):

    python3 scripts/gpu_check.py --out $OUT/gpu_check.jsonl

On a CPU (tiny shapes, kernels in interpret mode; proves the script before device
time is spent; its timings mean nothing):

    python scripts/gpu_check.py --smoke --out /tmp/gpu_check.jsonl

What it does (docs/gpu_check.md has the whole story and the record format):

* **Plan.** The device's own ceilings first (a copy, a bf16 and an fp8 matmul), then the
  target cases of ``pallas_kernels.targets`` in tiers: tier 1 holds the most
  important point of every kernel x variant (MLA, dense and sparse: TP-8 or
  data-parallel heads x bf16/fp8 pages; INT4: group size, ...), tier 2 the next
  point of each, and so on, so whatever the time allows covers every kernel.
  Twins (bf16 and fp8 pages of one shape) run back to back.
* **Isolation.** Cases run in a worker process that starts jax once (start-up
  costs seconds per process, so one worker runs case after case) and streams each
  result back as it is measured. A case that crashes the worker or runs past
  ``--case-timeout-s`` is recorded as ``crashed`` / ``timeout`` with the tail of
  the worker's stderr, the worker is replaced and the run goes on.
* **Records survive.** Each record is one JSON line, written, flushed and
  fsynced as soon as it exists: a crash, a hang or a killed run loses only the
  case in flight (and that case keeps the parts already streamed).
* **Budget.** ``--budget-s`` (default 480 s) bounds the whole run: a case starts
  only if its estimated time (the median of that kernel's earlier cases, or a
  prior) fits in what is left, a running case is stopped at the budget, and a
  ``budget`` record lists the cases not started.
* **Per case:** the Pallas kernel, XLA's path (the jnp reference) and, in the
  first ``--peer-tiers`` tiers, peers (our other attention kernel, JAX's own
  Pallas GPU kernels for the same job, bf16 twins of the INT4 matmuls, the dense
  MLA kernel over the whole context beside the sparse one), each
  with its relative-norm error against the f32 reference, its kernel time from
  CUPTI (perf_counter where CUPTI is unavailable; each timing names its
  source), achieved bytes/s and FLOP/s against the H200 ceilings, and the
  roofline lower bound of the job.
"""

from __future__ import annotations

import time

_START = time.monotonic()  # the budget counts from here, imports included

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import select  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

SCHEMA = 1
DEFAULT_BUDGET_S = 480.0  # 8 minutes: one device command, with room for a rerun in the lease
DEFAULT_CASE_TIMEOUT_S = 90.0  # the slowest legitimate case (grouped INT4 prefill + peers) ~1 min
DEFAULT_STARTUP_TIMEOUT_S = 180.0
RESERVE_S = 3.0  # kept back from the budget for the summary
# GLM 5's sparse decode kernels follow dense MLA: together they are a GLM decode step's
# attention, and they have never run on a GPU.
KERNEL_ORDER = ("paged_mla_decode", "paged_mla_sparse_decode", "paged_index_scores",
                "topk_positions", "int4_grouped_matmul", "fp8_grouped_matmul", "tag_check",
                "int4_matmul", "paged_gqa_decode")

# How target cases are ranked. "variant": the facets every value of which tier 1 covers (the
# dtype axis and the like). "prefs": preferred values, most important first, per facet; a
# case's rank is the sum of its facets' positions (ties broken in facet order), so tiers sweep
# outwards from the most important point of each variant.
PRIORITY = {
    "paged_mla_decode": {"variant": ("par", "kv"),
                         "prefs": {"par": ("tp8", "dp"), "kv": ("bf16", "fp8"),
                                   "batch": (64, 8, 1), "context": (32768, 131072, 4096)}},
    "int4_grouped_matmul": {"variant": ("model", "group_size"),
                            "prefs": {"model": ("Kimi K2.6", "GLM 5.2"), "group_size": (32, 128),
                                      "rows": ("r8", "r1", "r64", "prefill"),
                                      "proj": ("up", "down")}},
    "fp8_grouped_matmul": {"variant": (), "prefs": {"rows": ("r8", "r1", "r64", "prefill"),
                                                    "proj": ("up", "down")}},
    "tag_check": {"variant": (), "prefs": {"batch": (64, 1)}},
    "int4_matmul": {"variant": ("group_size",),
                    "prefs": {"group_size": (32, 128), "m": (8, 1, 64, 4096),
                              "model": ("Kimi K2.6", "GLM 5.2"),
                              "proj": ("ffn_up", "wo", "wq_b", "wkv_b", "ffn_down", "wq_a",
                                       "wkv_a")}},
    "paged_gqa_decode": {"variant": ("kv",),
                         "prefs": {"kv": ("bf16", "fp8"), "batch": (64, 1),
                                   "group": (8, 1, 16, 4, 2)}},
    "paged_mla_sparse_decode": {"variant": ("par", "kv"),
                                "prefs": {"par": ("tp8", "dp"), "kv": ("bf16", "fp8"),
                                          "batch": (64, 8, 1), "context": (32768, 131072)}},
    "paged_index_scores": {"variant": ("kv",),
                           "prefs": {"kv": ("bf16", "fp8"), "batch": (64, 8, 1),
                                     "context": (32768, 131072)}},
    "topk_positions": {"variant": (), "prefs": {"batch": (64, 1, 8),
                                                "context": (32768, 131072)}},
}
# Facets read from a case's name (position in name.split("/")) rather than its dims.
NAME_FACETS = {"paged_mla_decode": {"par": 1}, "paged_mla_sparse_decode": {"par": 1},
               "int4_matmul": {"proj": 2}, "int4_grouped_matmul": {"proj": 2, "rows": 3},
               "fp8_grouped_matmul": {"proj": 2, "rows": 3}}

# matmul_fp8 checks the roofline's modelled fp8 rate (benchmark.H200_FP8_FLOPS).
CEILINGS = {"copy": {"elements": 1 << 30}, "matmul_bf16": {"m": 8192, "k": 8192, "n": 8192},
            "matmul_fp8": {"m": 8192, "k": 8192, "n": 8192}}
SMOKE_CEILINGS = {"copy": {"elements": 1 << 16}, "matmul_bf16": {"m": 128, "k": 128, "n": 128},
                  "matmul_fp8": {"m": 128, "k": 128, "n": 128}}
# Seconds a case is expected to take before one has been seen (then: the median seen).
PRIOR_S = {"ceiling": 15.0, "paged_mla_decode": 20.0, "paged_gqa_decode": 15.0,
           "int4_matmul": 12.0, "int4_grouped_matmul": 25.0, "tag_check": 6.0,
           "paged_mla_sparse_decode": 20.0, "paged_index_scores": 10.0, "topk_positions": 6.0,
           "fp8_grouped_matmul": 15.0, "fault": 1.0}
SMOKE_PRIOR_S = {"ceiling": 1.0, "fault": 0.5}
PRIOR_STARTUP_S = {False: 30.0, True: 3.0}


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class PlanItem:
  """One case to run.

  Attributes:
    order: position in the plan (records carry it; they appear in this order).
    tier: 0 for the ceilings, 1.. for target tiers, -1 for injected faults.
    group: "ceiling", "target" or "fault".
    kernel: the op ("ceiling" / "fault" for those groups).
    name: the target case's name (unique).
    model: which deployment the shape comes from.
    dims: the shape parameters (smoke: shrunk).
    peers: whether peers are timed too.
  """

  order: int
  tier: int
  group: str
  kernel: str
  name: str
  model: str
  dims: dict
  peers: bool

  def message(self) -> dict:
    return dataclasses.asdict(self)


def facets(case) -> dict:
  """A target case's facets for ranking: its dims, its model and parts of its name."""
  f = dict(case.d, model=case.model)
  parts = case.name.split("/")
  f.update({k: parts[i] for k, i in NAME_FACETS.get(case.kernel, {}).items()})
  return f


def _positions(case, keys) -> tuple[int, ...]:
  prefs = PRIORITY[case.kernel]["prefs"]
  f = facets(case)
  return tuple(prefs[k].index(f[k]) if f[k] in prefs[k] else len(prefs[k]) for k in keys)


def prioritise(cases) -> list[tuple[int, object]]:
  """Orders target cases in tiers: (tier, case) pairs, tier 1 first.

  Tier t holds, for every kernel (KERNEL_ORDER) and variant, the variant's t-th
  most important case, so the first tier covers every kernel x variant and
  bf16/fp8 twins stay adjacent.

  Args:
    cases: pallas_kernels.targets.KernelCase list.

  Returns:
    Every case once, with its tier.

  Raises:
    ValueError: for a kernel with no PRIORITY entry.
  """
  missing = sorted({c.kernel for c in cases} - set(PRIORITY))
  if missing:
    raise ValueError(f"no PRIORITY entry for kernel(s) {missing}")
  groups: dict[tuple, list] = {}
  for c in cases:
    spec = PRIORITY[c.kernel]
    groups.setdefault((c.kernel, _positions(c, spec["variant"])), []).append(c)
  for (kernel, _), members in groups.items():
    others = [k for k in PRIORITY[kernel]["prefs"] if k not in PRIORITY[kernel]["variant"]]
    members.sort(key=lambda c, o=others: (sum(_positions(c, o)), _positions(c, o), c.name))
  keys = sorted(groups, key=lambda k: (KERNEL_ORDER.index(k[0]), k[1]))
  out = []
  for tier in range(1, max(len(g) for g in groups.values()) + 1 if groups else 1):
    out += [(tier, groups[k][tier - 1]) for k in keys if len(groups[k]) >= tier]
  return out


def _smoke_mla(d: dict) -> dict:
  # c % 128, page_size % 64 and r % 64 keep the Mosaic GPU kernel in play (as on the GPU).
  b, ps, ctx = 2, 64, 128
  return dict(d, batch=b, heads=min(d["heads"], 16), c=128, r=64, page_size=ps, context=ctx,
              max_pages=ctx // ps, num_pages=b * ctx // ps + 1)


def _smoke_gqa(d: dict) -> dict:
  # 8 KV heads: the Mosaic GPU kernel takes fp8 pages only for KV % 8 == 0.
  b, ps, ctx = 2, 16, 64
  return dict(d, batch=b, kv_heads=8, group=min(d["group"], 2), head_dim=64, page_size=ps,
              context=ctx, max_pages=ctx // ps, num_pages=b * ctx // ps + 1)


def _smoke_sparse_mla(d: dict) -> dict:
  # As _smoke_mla (the dense peer keeps its Mosaic GPU kernel), with a selection of a
  # quarter of the context: two 32-row steps of the sparse kernel.
  m = _smoke_mla(d)
  b, ps, ctx = m["batch"], m["page_size"], 256
  return dict(m, context=ctx, max_pages=ctx // ps, num_pages=b * ctx // ps + 1, topk=64)


def _smoke_indexer(d: dict) -> dict:
  # 8 heads pad to the kernel's 16; two 128-position blocks per request.
  b, ps, ctx = min(d["batch"], 2), 16, 256
  return dict(d, batch=b, index_heads=8, index_dim=64, page_size=ps, context=ctx,
              max_pages=ctx // ps, num_pages=b * ctx // ps + 1)


# Tiny dims of the same kind per kernel (interpret mode on a CPU): dtypes, group sizes,
# one-vs-many requests and head counts stay; sizes shrink.
SMOKE_DIMS = {
    "paged_mla_decode": _smoke_mla,
    "paged_gqa_decode": _smoke_gqa,
    "int4_matmul": lambda d: dict(d, m=min(d["m"], 8), k=256, n=128),
    "int4_grouped_matmul": lambda d: dict(d, m=16, k=256, n=128, experts=4),
    "fp8_grouped_matmul": lambda d: dict(d, m=16, k=256, n=128, experts=4),
    "tag_check": lambda d: dict(d, batch=min(d["batch"], 7), max_pages=5, num_pages=40,
                                page_size=4),
    "paged_mla_sparse_decode": _smoke_sparse_mla,
    "paged_index_scores": _smoke_indexer,
    # Two 1024-position blocks, k below and above the context's half.
    "topk_positions": lambda d: dict(d, batch=min(d["batch"], 2), context=2048, topk=300),
}


def build_plan(*, smoke: bool, kernels: set[str] | None = None, peer_tiers: int = 1,
               max_tier: int = 0, faults: tuple[str, ...] = (),
               cases: tuple[str, ...] = ()) -> list[PlanItem]:
  """The run's cases in order: ceilings, then target tiers (faults after the first case).

  Args:
    smoke: shrink every case (interpret mode on a CPU).
    kernels: run only these kernels ("ceiling" for the ceilings); None for all.
    peer_tiers: time peers in tiers 1..peer_tiers.
    max_tier: leave out target tiers past this (0: none left out).
    faults: injected test faults ("crash", "hang"), placed after the first case.
    cases: keep only target cases whose name contains one of these substrings (a
      rerun of chosen cases); empty keeps all. Tiers are those of the whole plan.

  Returns:
    PlanItems with increasing ``order``.
  """
  from pallas_kernels import targets as kt
  items = []
  if kernels is None or "ceiling" in kernels:
    for name, dims in (SMOKE_CEILINGS if smoke else CEILINGS).items():
      items.append(("ceiling", 0, "ceiling", f"ceiling/{name}", "-", dict(dims), False))
  targets = [c for c in kt.target_cases() if kernels is None or c.kernel in kernels]
  for tier, c in prioritise(targets):
    if max_tier and tier > max_tier:
      break
    if cases and not any(sub in c.name for sub in cases):
      continue
    dims = SMOKE_DIMS[c.kernel](c.d) if smoke else c.d
    items.append(("target", tier, c.kernel, c.name, c.model, dims, tier <= peer_tiers))
  for i, fault in enumerate(faults):
    items.insert(min(1 + i, len(items)), ("fault", -1, "fault", f"fault/{fault}", "-", {}, False))
  return [PlanItem(order, tier, group, kernel, name, model, dims, peers)
          for order, (group, tier, kernel, name, model, dims, peers) in enumerate(items)]


# ----------------------------------------------------------------------------- the worker


def _bench_for(item: dict, smoke: bool):
  backend = "interpret" if smoke else "pallas"
  kernel, dims = item["kernel"], item["dims"]
  if kernel == "ceiling":
    from pallas_kernels import benchmark
    return benchmark.ceiling_bench(item["name"].split("/", 1)[1], dims)
  if kernel in ("paged_mla_decode", "paged_gqa_decode", "paged_mla_sparse_decode"):
    from pallas_kernels.paged_attention import bench
    return bench.bench_case(kernel, dims, backend=backend, peers=item["peers"])
  if kernel in ("int4_matmul", "int4_grouped_matmul"):
    from pallas_kernels.int4_matmul import bench
    return bench.bench_case(kernel, dims, backend=backend, peers=item["peers"])
  if kernel == "fp8_grouped_matmul":
    from pallas_kernels.fp8_matmul import bench
    return bench.bench_case(dims, backend=backend)
  if kernel == "tag_check":
    from pallas_kernels.tag_check import bench
    return bench.bench_case(dims, backend=backend)
  if kernel == "paged_index_scores":
    from pallas_kernels.indexer import bench
    return bench.bench_case(dims, backend=backend)
  if kernel == "topk_positions":
    from pallas_kernels.indexer import topk_bench
    return topk_bench.bench_case(dims, backend=backend)
  raise ValueError(f"unknown kernel {kernel!r}")


def _inject(fault: str) -> None:
  """Test-only faults: a hard crash or a hang of the worker."""
  sys.stderr.write(f"gpu_check worker: injected {fault}\n")
  sys.stderr.flush()
  if fault == "crash":
    os.abort()
  while True:
    time.sleep(3600)


def worker_main(smoke: bool) -> int:
  """Runs cases read from stdin (one JSON line each), streaming results on the original stdout.

  Messages: "@@READY {...}" once jax is up, then per case "@@CASE {...}" (the
  job's size), one "@@PART {...}" per impl as soon as it is measured, and
  "@@DONE {...}". Anything else written to stdout goes to stderr instead.
  """
  result = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)

  def send(tag, payload):
    result.write(f"@@{tag} {json.dumps(payload, default=str)}\n")
    result.flush()

  t0 = time.monotonic()
  import jax
  devices = jax.devices()
  cupti = False
  try:
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
    cupti = mosaic_gpu_lib is not None and hasattr(mosaic_gpu_lib._mosaic_gpu_ext, "_cupti_init")  # noqa: SLF001
  except Exception:  # pylint: disable=broad-except
    pass
  send("READY", {"pid": os.getpid(), "startup_s": time.monotonic() - t0,
                 "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
                 "devices": len(devices), "jax": jax.__version__, "cupti_ext": cupti})
  from pallas_kernels import benchmark
  for line in sys.stdin:
    item = json.loads(line)
    if item["kernel"] == "fault":
      _inject(item["name"].split("/", 1)[1])
    t = time.monotonic()
    try:
      bench = _bench_for(item, smoke)
      send("CASE", {"bytes": bench.nbytes, "flops": bench.flops, "tol": bench.tol,
                    "roofline_s": benchmark.roofline_s(bench.nbytes, bench.flops),
                    "info": bench.info})
      benchmark.run_bench(bench, lambda part: send("PART", part), smoke=smoke)
      del bench
    except Exception as e:  # pylint: disable=broad-except
      send("PART", {"impl": "build", "error": f"{type(e).__name__}: {e}"[:2000],
                    "traceback": traceback.format_exc()[-4000:]})
    gc.collect()
    send("DONE", {"wall_s": time.monotonic() - t})
  return 0


# ----------------------------------------------------------------------------- the parent


class JsonlWriter:
  """Appends one JSON object per line, flushed and fsynced at once."""

  def __init__(self, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.path = path
    self._f = open(path, "a")

  def write(self, record: dict) -> None:
    self._f.write(json.dumps(record, default=str) + "\n")
    self._f.flush()
    os.fsync(self._f.fileno())

  def close(self) -> None:
    self._f.close()


class WorkerGone(Exception):
  """The worker exited (crashed) before answering."""


class Worker:
  """A worker process; its stderr is appended to the run's log file."""

  def __init__(self, smoke: bool, log_path: str):
    env = dict(os.environ)
    if smoke:
      env.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin may be installed without a GPU
    self.log_path = log_path
    log = open(log_path, "ab")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + (["--smoke"] if smoke else [])
    # Own session, so a hung worker and anything it started die together.
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                 cwd=_REPO, env=env, start_new_session=True)
    log.close()
    self._buf = b""

  def read(self, deadline: float) -> tuple[str, dict] | None:
    """Next message, or None at the deadline; raises WorkerGone if the worker exited."""
    fd = self.proc.stdout.fileno()
    while b"\n" not in self._buf:
      left = deadline - time.monotonic()
      if left <= 0:
        return None
      ready, _, _ = select.select([fd], [], [], min(left, 1.0))
      if ready:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
          raise WorkerGone()
        self._buf += chunk
    line, self._buf = self._buf.split(b"\n", 1)
    text = line.decode(errors="replace")
    if not text.startswith("@@"):
      return self.read(deadline)
    tag, _, payload = text[2:].partition(" ")
    return tag, json.loads(payload)

  def send(self, item: dict) -> None:
    """Hands the worker one case (a JSON line on its stdin)."""
    self.proc.stdin.write((json.dumps(item) + "\n").encode())
    self.proc.stdin.flush()

  def kill(self) -> None:
    """Kills the worker's whole process group and reaps it."""
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.proc.wait()

  @property
  def returncode(self):
    return self.proc.poll()


def log_tail(path: str, offset: int, limit: int = 3000) -> str:
  """The last ``limit`` characters written to the log after ``offset``."""
  try:
    with open(path, "rb") as f:
      f.seek(offset)
      return f.read().decode(errors="replace")[-limit:]
  except OSError:
    return ""


def _log_size(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:
    return 0


class Estimator:
  """Expected seconds of the next case of a kernel and of a worker start-up."""

  def __init__(self, smoke: bool):
    self.smoke = smoke
    self.seen: dict[str, list[float]] = {}
    self.startups: list[float] = []

  def case(self, kernel: str) -> float:
    """Median wall time of this kernel's finished cases, else its prior."""
    if self.seen.get(kernel):
      return statistics.median(self.seen[kernel])
    return (SMOKE_PRIOR_S.get(kernel, 5.0) if self.smoke else PRIOR_S.get(kernel, 20.0))

  def startup(self) -> float:
    """Median worker start-up seen so far, else the prior."""
    return statistics.median(self.startups) if self.startups else PRIOR_STARTUP_S[self.smoke]


def _summary_of_parts(parts: list[dict]) -> dict:
  """Top-level fields of a case record from its impls' results (the kernel's first)."""
  by = {p["impl"]: p for p in parts}
  main = by.get("pallas") or (parts[0] if parts else {})
  out = {}
  if "timing" in main:
    out.update(time_s=main["timing"]["median_s"], timing_source=main["timing"]["source"],
               roofline_fraction=main.get("roofline_fraction"),
               copy_bw_fraction=main.get("copy_bw_fraction"),
               bf16_flops_fraction=main.get("bf16_flops_fraction"))
  for k in ("rel_err", "finite", "correct"):
    if k in main:
      out[k] = main[k]
  xla = by.get("xla")
  if "pallas" in by and xla and "timing" in xla and "timing" in main:
    out["speedup_vs_xla"] = xla["timing"]["median_s"] / main["timing"]["median_s"]
  peers = {p["impl"]: p["timing"]["median_s"] for p in parts
           if p["impl"] not in ("pallas", "xla") and "timing" in p}
  if peers:
    out["peer_time_s"] = peers
  return out


def _status(parts: list[dict], ended: str) -> str:
  if ended != "done":
    return ended
  main = next((p for p in parts if p["impl"] in ("pallas", "build")), parts[0] if parts else {})
  if "error" in main or not parts:
    return "error"
  if main.get("correct") is False:
    return "incorrect"
  if "check_error" in main:
    return "unchecked"  # timed, but its reference failed
  return "ok"


def run_case(worker: Worker, item: PlanItem, timeout_s: float) -> dict:
  """Sends one case to the worker and collects its messages until DONE, a crash or the timeout."""
  offset = _log_size(worker.log_path)
  t0 = time.monotonic()
  deadline = t0 + timeout_s
  facts, parts, ended = {}, [], "done"
  try:
    worker.send(item.message())
    while True:
      msg = worker.read(deadline)
      if msg is None:
        ended = "timeout"
        break
      tag, payload = msg
      if tag == "CASE":
        facts = payload
      elif tag == "PART":
        parts.append(payload)
      elif tag == "DONE":
        break
  except (WorkerGone, BrokenPipeError):
    ended = "crashed"
  if ended == "timeout":
    worker.kill()
  elif ended == "crashed":
    worker.proc.wait()
  rec = {"type": "case", "order": item.order, "tier": item.tier, "group": item.group,
         "kernel": item.kernel, "name": item.name, "model": item.model, "dims": item.dims,
         "peers": item.peers, "status": _status(parts, ended),
         "wall_s": time.monotonic() - t0, "timeout_s": timeout_s,
         "worker_pid": worker.proc.pid, **facts, **_summary_of_parts(parts), "impls": parts}
  if ended == "crashed":
    rec["returncode"] = worker.returncode
  if rec["status"] != "ok":
    rec["stderr_tail"] = log_tail(worker.log_path, offset)
  if item.kernel == "ceiling" and "time_s" in rec:
    rec["measured"] = (
        {"copy_bytes_per_s": rec["bytes"] / rec["time_s"]} if "copy" in item.name else
        {"matmul_fp8_flops_per_s": rec["flops"] / rec["time_s"]} if "fp8" in item.name else
        {"matmul_flops_per_s": rec["flops"] / rec["time_s"]})
  return rec


def _start_worker(args, out: JsonlWriter, est: Estimator, deadline: float
                  ) -> tuple[Worker | None, dict]:
  """A ready worker, or None with the failure record written."""
  log_path = args.out + ".stderr.log"
  offset = _log_size(log_path)
  t0 = time.monotonic()
  w = Worker(args.smoke, log_path)
  rec = {"type": "worker", "pid": w.proc.pid}
  try:
    msg = w.read(min(deadline, t0 + args.startup_timeout_s))
    if msg and msg[0] == "READY":
      rec.update(status="ready", wall_s=time.monotonic() - t0, **msg[1])
      est.startups.append(rec["wall_s"])
      out.write(rec)
      return w, rec
    rec["status"] = "startup_timeout"
  except WorkerGone:
    rec["status"] = "startup_crashed"
  w.kill()
  rec.update(wall_s=time.monotonic() - t0, returncode=w.returncode,
             stderr_tail=log_tail(log_path, offset))
  out.write(rec)
  return None, rec


def _twins(records: list[dict]) -> list[dict]:
  """fp8-page cases against their bf16 twins (same shape): kernel time ratio."""
  by_name = {r["name"]: r for r in records if "time_s" in r}
  out = []
  for name, r in by_name.items():
    if "/fp8/" in name and name.replace("/fp8/", "/bf16/") in by_name:
      twin = by_name[name.replace("/fp8/", "/bf16/")]
      out.append({"fp8": name, "bf16": twin["name"], "fp8_time_s": r["time_s"],
                  "bf16_time_s": twin["time_s"], "speedup_fp8_vs_bf16": twin["time_s"] / r["time_s"]})
  return out


def _print_row(rec: dict, elapsed: float, total: int) -> None:
  t = rec.get("time_s")
  extra = ""
  if t is not None:
    extra = f" {t * 1e6:9.1f} us"
    if rec.get("speedup_vs_xla"):
      extra += f"  x{rec['speedup_vs_xla']:.1f} vs xla"
    if rec.get("roofline_fraction") is not None:
      extra += f"  {rec['roofline_fraction']:.2f} of roofline"
    extra += f" [{rec.get('timing_source')}]"
  print(f"[{rec['order'] + 1}/{total} {elapsed:5.0f}s] {rec['name']:<40} {rec['status']:<9}"
        f"{extra}", flush=True)


def orchestrate(args) -> int:
  """Runs the plan within the budget; returns 0 if it was not aborted and every case is ok."""
  kernels = set(args.kernels.split(",")) if args.kernels else None
  faults = tuple(f for f in args.inject_fault.split(",") if f) if args.inject_fault else ()
  max_tier = args.max_tier if args.max_tier is not None else (1 if args.smoke else 0)
  plan = build_plan(smoke=args.smoke, kernels=kernels, peer_tiers=args.peer_tiers,
                    max_tier=max_tier, faults=faults,
                    cases=tuple(c for c in args.cases.split(",") if c))
  if os.path.exists(args.out):
    os.remove(args.out)  # one run per file; earlier results are not mixed in
  out = JsonlWriter(args.out)
  from importlib import metadata
  from pallas_kernels import benchmark as bm  # constants; no backend starts in this process
  from pallas_kernels import targets as kt
  out.write({"type": "header", "schema": SCHEMA, "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                           time.gmtime()),
             "argv": sys.argv[1:], "smoke": args.smoke, "budget_s": args.budget_s,
             "case_timeout_s": args.case_timeout_s, "peer_tiers": args.peer_tiers,
             "host": platform.node(), "platform": platform.platform(),
             "python": platform.python_version(), "jax": metadata.version("jax"),
             "ceilings_nominal": {"copy_bytes_per_s": bm.H200_COPY_BW,
                                  "bf16_flops_per_s": bm.H200_BF16_FLOPS,
                                  "fp8_flops_per_s_modelled": bm.H200_FP8_FLOPS,
                                  "l2_bytes": bm.L2_BYTES},
             "targets_total": len(kt.target_cases()), "plan_size": len(plan),
             "plan": [p.name for p in plan]})
  print(f"gpu_check: {len(plan)} cases planned, budget {args.budget_s:.0f} s, "
        f"writing {args.out}", flush=True)
  est = Estimator(args.smoke)
  worker, records, stop = None, [], None
  try:
    for i, item in enumerate(plan):
      elapsed = time.monotonic() - _START
      left = args.budget_s - RESERVE_S - elapsed
      need = est.case(item.kernel) + (0.0 if worker else est.startup())
      if need > left:
        stop = {"type": "budget", "stopped": True, "elapsed_s": elapsed,
                "budget_s": args.budget_s, "next_case": item.name, "next_estimate_s": need,
                "unstarted": [p.name for p in plan[i:]]}
        break
      if worker is None:
        worker, wrec = _start_worker(args, out, est, _START + args.budget_s - RESERVE_S)
        if worker is None:
          worker, wrec = _start_worker(args, out, est, _START + args.budget_s - RESERVE_S)
        if worker is None:
          stop = {"type": "aborted", "reason": f"the worker failed to start twice "
                  f"({wrec['status']})", "unstarted": [p.name for p in plan[i:]]}
          break
        if not args.smoke and wrec.get("backend") != "gpu":
          stop = {"type": "aborted", "reason": f"no GPU: jax's backend is "
                  f"{wrec.get('backend')!r} (use --smoke on a CPU)",
                  "unstarted": [p.name for p in plan[i:]]}
          break
        left = args.budget_s - RESERVE_S - (time.monotonic() - _START)
      timeout = min(args.case_timeout_s, max(left, 0.1))
      rec = run_case(worker, item, timeout)
      if rec["status"] == "timeout" and timeout < args.case_timeout_s:
        rec["cut_by_budget"] = True
      if rec["status"] in ("crashed", "timeout"):
        worker = None
      else:
        est.seen.setdefault(item.kernel, []).append(rec["wall_s"])
      records.append(rec)
      out.write(rec)
      _print_row(rec, time.monotonic() - _START, len(plan))
  finally:
    if worker is not None:
      worker.proc.stdin.close()
      worker.kill()
  if stop:
    out.write(stop)
    print(f"gpu_check: {stop['type']}: {stop.get('reason', 'budget would be exceeded')}; "
          f"{len(stop['unstarted'])} cases not started", flush=True)
  counts: dict[str, int] = {}
  for r in records:
    counts[r["status"]] = counts.get(r["status"], 0) + 1
  measured = {}
  for r in records:
    measured.update(r.get("measured", {}))
  summary = {"type": "summary", "elapsed_s": time.monotonic() - _START, "counts": counts,
             "cases_run": len(records), "plan_size": len(plan),
             "stopped": stop["type"] if stop else None, "ceilings_measured": measured,
             "worker_startups_s": est.startups, "fp8_vs_bf16": _twins(records),
             "failed": [r["name"] for r in records if r["status"] != "ok"
                        and r["group"] != "fault"]}
  out.write(summary)
  out.close()
  print(f"gpu_check: {len(records)} cases in {summary['elapsed_s']:.0f} s: {counts}; "
        f"measured ceilings {measured}", flush=True)
  for t in summary["fp8_vs_bf16"]:
    print(f"  fp8 vs bf16  {t['fp8']:<36} x{t['speedup_fp8_vs_bf16']:.2f}", flush=True)
  return 1 if summary["failed"] or summary["stopped"] == "aborted" else 0


def main(argv=None) -> int:
  """The command line: the parent run, or (hidden --worker) one worker process."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", help="JSONL output path (its worker log: PATH.stderr.log)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes, interpret mode: checks the script on a CPU")
  p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                 help="wall-clock budget of the whole run (default 480 s)")
  p.add_argument("--case-timeout-s", type=float, default=DEFAULT_CASE_TIMEOUT_S,
                 help="a case running longer is stopped and recorded as a timeout")
  p.add_argument("--startup-timeout-s", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                 help="a worker not ready after this is recorded and replaced")
  p.add_argument("--kernels", default="",
                 help="comma-separated kernels to run (and 'ceiling'); default all")
  p.add_argument("--peer-tiers", type=int, default=1,
                 help="time peers (JAX's kernels, our other kernel) in tiers 1..N")
  p.add_argument("--max-tier", type=int, default=None,
                 help="run target tiers 1..N only (default: all; --smoke: 1)")
  p.add_argument("--cases", default="",
                 help="comma-separated substrings: run only target cases whose name "
                 "contains one (e.g. a rerun of failed cases); default all")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--inject-fault", default="", help=argparse.SUPPRESS)  # tests: crash,hang
  args = p.parse_args(argv)
  if args.worker:
    return worker_main(args.smoke)
  if not args.out:
    p.error("--out is required")
  return orchestrate(args)


if __name__ == "__main__":
  sys.exit(main())
