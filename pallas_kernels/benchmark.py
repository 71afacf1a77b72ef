"""Measuring one kernel case on a device: correctness, kernel time, roofline.

The kernel packages' ``bench`` modules describe a case as a :class:`Bench`: the
bytes the job must move and the FLOPs it must do, and a list of :class:`Impl`
(the Pallas kernel first, then XLA's path and any peers), each with a reference
output to compare against. :func:`run_bench` checks and times every impl in
turn and hands each result to a callback as soon as it exists, so a caller that
streams them (``scripts/gpu_check.py``) keeps what was measured when a later
impl crashes the process.

Timing (:func:`time_on_device`): on a GPU the kernel time is the sum of the
durations of the kernels one call launches, read from CUPTI (the
``jax.experimental.mosaic.gpu.profiler`` back end), so host launch and sync
costs (15-40 us, as large as a decode kernel) stay out. Inputs rotate over
enough copies that each call misses L2 (60 MB). Elsewhere, or if CUPTI cannot
be used, it falls back to host ``perf_counter`` around a blocking call; every
Timing says which source it came from.

Ceilings: about 4.3 TB/s for a device copy (bytes read + written) and 790
TFLOP/s for a bf16 matmul, both measured on an H200 (see docs/gpu_check.md);
:func:`ceiling_bench` measures them again on the device at hand.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

H200_COPY_BW = 4.3e12  # bytes/s, device-to-device copy, read + write counted
H200_BF16_FLOPS = 790e12  # FLOP/s, 8192^3 bf16 matmul on random data
# Modelled, not measured: Hopper's dense fp8 (e4m3) tensor-core rate is twice its
# bf16 rate, so twice the measured bf16 ceiling.
H200_FP8_FLOPS = 2 * H200_BF16_FLOPS
L2_BYTES = 60e6  # H200 L2
MAX_ROTATION = 256  # input copies at most; tiny cases stay L2-resident (flagged)
TOL = {"bf16": 1e-2, "f32": 1e-6, "fp8": 5e-2}  # relative-norm error vs reference


def rotation_sets(nbytes: int) -> int:
  """How many input copies to rotate so that the working set is over 2x L2.

  Args:
    nbytes: bytes of one input set.

  Returns:
    A count in [1, MAX_ROTATION]; 1 off a GPU (there, copies only cost time).
  """
  if jax.default_backend() != "gpu":
    return 1
  return int(min(MAX_ROTATION, max(1, -(-2 * L2_BYTES // max(nbytes, 1)))))


def roofline_s(nbytes: float, flops: float) -> float:
  """Lower bound on the time of a job: max(bytes / copy BW, FLOPs / bf16 rate)."""
  return max(nbytes / H200_COPY_BW, flops / H200_BF16_FLOPS)


def rel_err(out: jax.Array, ref: jax.Array) -> float:
  """||out - ref|| / ||ref|| in f32 (inf where ref is all zeros and out is not)."""
  o = jnp.asarray(out).astype(jnp.float32)
  r = jnp.asarray(ref).astype(jnp.float32)
  num, den = float(jnp.linalg.norm(o - r)), float(jnp.linalg.norm(r))
  return num / den if den else (0.0 if num == 0 else float("inf"))


def once(fn: Callable[[], Any]) -> Callable[[], Any]:
  """fn, computed on first call and cached (reference outputs shared by impls)."""
  return functools.cache(fn)


@dataclasses.dataclass(frozen=True)
class Timing:
  """Kernel time of one impl over rotated inputs.

  Attributes:
    median_s: median seconds per call.
    min_s: fastest call.
    max_s: slowest call.
    iters: timed calls.
    sets: input copies rotated through.
    source: "cupti" (sum of the call's kernel durations), "cupti_measure"
      (profiler.measure on one input set, no rotation) or "perf_counter" (host
      wall time around a blocking call, launch and sync included).
    kernels: names of the kernels one call launched (CUPTI only).
    note: why a fallback source was used, if one was.
  """

  median_s: float
  min_s: float
  max_s: float
  iters: int
  sets: int
  source: str
  kernels: tuple[str, ...] = ()
  note: str = ""

  def as_dict(self) -> dict:
    """The fields as a JSON-ready dict."""
    return dataclasses.asdict(self)


def _iters_for(per_call_s: float, smoke: bool) -> int:
  if smoke:
    return 2
  # ~0.3 s of timed calls per impl: many runs for us-scale kernels, >= 10 for slow references.
  return int(min(200, max(10, 0.3 / max(per_call_s, 1e-7))))


def _cupti_ext():
  from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # pylint: disable=g-import-not-at-top
  if mosaic_gpu_lib is None:
    raise RuntimeError("jaxlib has no Mosaic GPU extension (CUPTI)")
  return mosaic_gpu_lib._mosaic_gpu_ext  # noqa: SLF001 - profiler.measure's own back end


def _cupti_times(fn, arg_sets, iters) -> tuple[list[float], tuple[str, ...]]:
  """Per-call kernel seconds from CUPTI, rotating arg_sets (profiler.measure, with rotation).

  profiler.measure(f, iterations=n) times n calls on one input set, which leaves
  a small case's inputs in L2; this is the same CUPTI sequence with the inputs
  rotated between calls.
  """
  ext = _cupti_ext()
  ext._cupti_init()  # noqa: SLF001
  try:
    pending = []
    for i in range(iters):
      pending.append(fn(*arg_sets[i % len(arg_sets)]))
      if len(pending) >= 8:  # bounded outputs alive; CUPTI reads device time, not host gaps
        jax.block_until_ready(pending)
        pending.clear()
    jax.block_until_ready(pending)
  finally:
    timings = ext._cupti_get_timings(True)  # noqa: SLF001 - finalize: detach CUPTI
  if not timings or len(timings) % iters:
    raise RuntimeError(f"CUPTI returned {len(timings or [])} kernel timings for {iters} calls")
  per = len(timings) // iters
  calls = [timings[i * per:(i + 1) * per] for i in range(iters)]
  names = tuple(name for name, _ in calls[0])
  if any(tuple(n for n, _ in c) != names for c in calls):
    raise RuntimeError("kernel names differ between calls")
  return [sum(ms for _, ms in c) / 1e3 for c in calls], names


def _measure_times(fn, args, iters) -> tuple[list[float], tuple[str, ...]]:
  """Public profiler.measure on one input set (no rotation)."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=g-import-not-at-top
  _, ms = profiler.measure(fn, iterations=iters)(*args)
  if ms is None:
    raise RuntimeError("profiler.measure saw no kernels")
  return [m / 1e3 for m in ms], ()


def _wall_times(fn, arg_sets, iters) -> list[float]:
  times = []
  for i in range(iters):
    args = arg_sets[i % len(arg_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return times


def time_on_device(fn: Callable[..., Any], arg_sets: list[tuple], *,
                   smoke: bool = False) -> Timing:
  """Median kernel time of fn over rotated argument sets, after warm-up.

  Args:
    fn: a jitted function; called as fn(*arg_sets[i]).
    arg_sets: input copies to rotate through (see rotation_sets).
    smoke: 1 warm-up and 2 timed calls (checks the plumbing on a CPU).

  Returns:
    Timing. On a GPU its source is "cupti" when CUPTI works, else
    "cupti_measure" or "perf_counter" with the reason in ``note``.
  """
  for i in range(1 if smoke else 2):  # first call compiles; second estimates the call's cost
    args = arg_sets[i % len(arg_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    per_call = time.perf_counter() - t0
  iters = _iters_for(per_call, smoke)
  source, names, note = "perf_counter", (), ""
  times = None
  if jax.default_backend() == "gpu":
    try:
      times, names = _cupti_times(fn, arg_sets, iters)
      source = "cupti"
    except Exception as e:  # pylint: disable=broad-except
      note = f"cupti with rotation failed: {type(e).__name__}: {e}"[:300]
      try:
        times, names = _measure_times(fn, arg_sets[0], iters)
        source = "cupti_measure"
      except Exception as e2:  # pylint: disable=broad-except
        note += f"; profiler.measure failed: {type(e2).__name__}: {e2}"[:300]
  if times is None:
    times = _wall_times(fn, arg_sets, iters)
  return Timing(statistics.median(times), min(times), max(times), len(times),
                len(arg_sets) if source != "cupti_measure" else 1, source, names, note)


@dataclasses.dataclass
class Impl:
  """One way of doing a case's job: the kernel under test, XLA's path or a peer.

  Attributes:
    name: "pallas" (the kernel under test), "xla" (the pure-jnp reference compiled
      by XLA) or a peer's name ("jax_paged_attention", "xla_bf16_dot", ...).
    fn: jitted callable; fn(*args) for each set of ``args()``.
    args: builds the rotated argument sets when the impl runs (peers that need
      another layout build theirs here, so they live only while timed).
    expected: reference output for ``args()[0]`` (shared by impls via ``once``),
      or None for no numeric check.
    output: maps fn's output to the reference's layout before comparing.
    check: exact check instead of a norm (returns extra record fields, and
      "correct"); used for boolean outputs.
    tol: relative-norm tolerance (None: the case's).
    nbytes, flops: the job this impl does when it differs from the case's
      (e.g. a peer that skips part of it), for its roofline.
    note: how this impl's inputs or job differ from the kernel's.
  """

  name: str
  fn: Callable[..., Any]
  args: Callable[[], list[tuple]]
  expected: Callable[[], jax.Array] | None = None
  output: Callable[[Any], jax.Array] = lambda o: o
  check: Callable[[Any], dict] | None = None
  tol: float | None = None
  nbytes: int | None = None
  flops: int | None = None
  note: str = ""


@dataclasses.dataclass
class Bench:
  """One case: the job's size, tolerance and impls (the kernel under test first).

  Attributes:
    nbytes: bytes the job must move (each input read once, output written once).
    flops: floating-point operations the job must do.
    tol: relative-norm tolerance against the reference (TOL).
    impls: the kernel first, then XLA's path and peers.
    info: case facts for the record (block sizes, input copies, ...).
  """

  nbytes: int
  flops: int
  tol: float
  impls: list[Impl]
  info: dict = dataclasses.field(default_factory=dict)


def _metrics(t: Timing, nbytes: int, flops: int) -> dict:
  floor = roofline_s(nbytes, flops)
  return {"bytes": nbytes, "flops": flops, "roofline_s": floor,
          "bound": "memory" if nbytes / H200_COPY_BW >= flops / H200_BF16_FLOPS else "compute",
          "bytes_per_s": nbytes / t.median_s, "flops_per_s": flops / t.median_s,
          "copy_bw_fraction": nbytes / t.median_s / H200_COPY_BW,
          "bf16_flops_fraction": flops / t.median_s / H200_BF16_FLOPS,
          "roofline_fraction": floor / t.median_s}


def _error(e: Exception) -> dict:
  return {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}


def run_impl(bench: Bench, impl: Impl, *, smoke: bool) -> dict:
  """Checks and times one impl; never raises (errors go into the result).

  Returns:
    {"impl", "note", "correct", "rel_err", "finite", "tol", "timing",
     "bytes", "flops", "roofline_s", achieved rates and fractions}. If the
    impl fails: "error" and "traceback" with whatever was measured before. If
    only the reference fails (out of memory, say): "check_error", and the impl
    is still timed.
  """
  res: dict[str, Any] = {"impl": impl.name}
  if impl.note:
    res["note"] = impl.note
  try:
    t0 = time.perf_counter()
    arg_sets = impl.args()
    res["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = impl.output(jax.block_until_ready(impl.fn(*arg_sets[0])))
    res["first_call_s"] = time.perf_counter() - t0  # includes the compile
  except Exception as e:  # pylint: disable=broad-except
    return {**res, **_error(e)}
  try:
    if impl.check is not None:
      res.update(impl.check(out))
    elif impl.expected is not None:
      res["finite"] = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
      tol = impl.tol if impl.tol is not None else bench.tol
      err = rel_err(out, impl.expected())
      res.update(rel_err=err, tol=tol, correct=res["finite"] and err <= tol)
  except Exception as e:  # pylint: disable=broad-except
    res["check_error"] = _error(e)["error"]
  del out
  try:
    t = time_on_device(impl.fn, arg_sets, smoke=smoke)
    res["timing"] = t.as_dict()
    res.update(_metrics(t, impl.nbytes if impl.nbytes is not None else bench.nbytes,
                        impl.flops if impl.flops is not None else bench.flops))
  except Exception as e:  # pylint: disable=broad-except
    res.update(_error(e))
  return res


def run_bench(bench: Bench, emit: Callable[[dict], None], *, smoke: bool) -> None:
  """Runs every impl of bench in order, passing each result to emit at once."""
  for impl in bench.impls:
    emit(run_impl(bench, impl, smoke=smoke))


def ceiling_bench(name: str, dims: dict) -> Bench:
  """The device's own ceilings: an elementwise copy, a bf16 and an fp8 matmul.

  Args:
    name: "copy" (dims: elements, f32; read + written bytes counted),
      "matmul_bf16" or "matmul_fp8" (e4m3 operands, f32 accumulation, bf16
      result; the rate H200_FP8_FLOPS models) (dims: m, k, n).
    dims: as above.

  Returns:
    A Bench with one "xla" impl and no reference (its rates are the result).
  """
  key = jax.random.key(0)
  if name == "copy":
    n = dims["elements"]
    make = once(lambda: [(jax.random.normal(key, (n,), jnp.float32),)])
    fn = jax.jit(lambda x: -x)  # one read, one write; XLA keeps it (it is not a no-op)
    return Bench(nbytes=8 * n, flops=0, tol=0.0,
                 impls=[Impl("xla", fn, make, note="negate: read + write")])
  if name in ("matmul_bf16", "matmul_fp8"):
    m, k, n = dims["m"], dims["k"], dims["n"]
    dt = jnp.bfloat16 if name == "matmul_bf16" else jnp.float8_e4m3fn
    ka, kb = jax.random.split(key)
    make = once(lambda: [(jax.random.normal(ka, (m, k), jnp.float32).astype(dt),
                          jax.random.normal(kb, (k, n), jnp.float32).astype(dt))])
    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32
                                      ).astype(jnp.bfloat16))
    item = jnp.dtype(dt).itemsize
    return Bench(nbytes=item * (m * k + k * n) + 2 * m * n, flops=2 * m * k * n, tol=0.0,
                 impls=[Impl("xla", fn, make, note="random normal inputs (never zeros)")])
  raise ValueError(f"unknown ceiling {name!r}; known: copy, matmul_bf16, matmul_fp8")
