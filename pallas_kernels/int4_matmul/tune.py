"""The INT4 [N, K] kernels' H200 block sizes, derived from ptxas readings and occupancy.

The H200 rows of ``pallas_kernels.int4_matmul.block_sizes.TUNED_NK`` (layout "nk")
come from this module (run by ``python -m experiments.int4_tune``), in three steps
(docs/int4_matmul.md, "Block sizes of the [N, K] kernels"):

1. **Readings.** Every candidate tile shape (tile_n x tile_m x tile_k, per group
   size) is compiled for sm_90a at a long K loop (LONG_LOOP_STEPS steps, the loop
   ptxas builds for every long target), and ptxas gives its registers, spills,
   stack, shared memory and whether it serialised the wgmmas
   (``pallas_kernels.h200.kernel_readings.compile_build``). Shapes that fail any
   of those are out (:func:`clean`).
2. **Occupancy.** CTAs per SM from the registers (65,536 per SM, one warpgroup of
   128 threads per CTA, allocated in 8-register steps), the shared memory
   (``BlockSizes.smem_bytes`` at the candidate's pipeline depth, plus the 1 KiB the
   SM reserves per CTA, out of 228 KiB) and the thread and CTA caps.
3. **A time model** of every target case (``pallas_kernels.targets``) under
   each candidate (tile shape x pipeline depth, with the K split count the dense
   decode kernel takes per call, ``BlockSizes.fit_splits_per_call``),
   :func:`modelled_seconds`.
   The work items (output tiles, times K splits; for the grouped kernel the tiles
   its schedule gives rows routed at random, ``routed_group_sizes``) run in rounds
   of SMs x occupancy CTAs. A round costs one HBM latency (the pipeline's fill)
   plus the largest of its weight traffic at the bandwidth its loads in flight
   can sustain (Little's law: CTAs x (depth - 1) steps of bytes over the latency,
   capped at the copy bandwidth), the busiest SM's MMA time and its conversion
   time (instructions per weight at four warp instructions per clock).
   Activations and outputs move once at the copy bandwidth, the dense kernel's
   f32 split partials (more than one split) twice: written, read back. Each shape class picks the
   candidate whose modelled times, over all the class's target cases, have the
   smallest geometric mean of time / the best candidate's time for that case.

None of this is timed: the model ranks candidates, and ``scripts/gpu_check.py``
times the chosen rows (``pallas_nk``) when a GPU is lent. The zero-spill check of
the chosen rows at every target shape (not just the long-loop tiles) is the
compile sweep (``tests/test_h200_compile_int4.py``).

Readings go to ``DATA_PATH`` (committed beside this module: they are the evidence
for TUNED_NK next door), so the selection can be rerun and checked without a
compiler (``tests/test_int4_tune.py``).

The compiles need ``pallas_kernels.h200.env.prepare()`` before jax is imported;
selecting from readings does not (``pallas_kernels.h200.kernel_readings`` is
imported only to compile).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from typing import Callable, Iterable, Sequence

import numpy as np

from pallas_kernels import targets as kt
from pallas_kernels.int4_matmul.block_sizes import BlockSizes
from pallas_kernels.int4_matmul.block_sizes import DECODE_MAX_M
from pallas_kernels.int4_matmul.block_sizes import GROUPED_DECODE_MAX_ROWS
from pallas_kernels.int4_matmul.block_sizes import H200_SMEM_BYTES
from pallas_kernels.int4_matmul.block_sizes import TUNED_NK
from pallas_kernels.int4_matmul import tile_model

H200 = "NVIDIA H200"
DATA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "int4_nk_tiles_h200.json")

# The occupancy and time model (and their H200 constants) live beside the kernels,
# which pick their dense decode split count with it (tile_model).
LONG_LOOP_STEPS = 8  # kernel_readings.INT4_LONG_LOOP_STEPS

# Candidates per (op, shape class): tile shapes (tile_n, tile_m, tile_k) and pipeline
# depths. tile_m is a cap: BlockSizes.fit shrinks it to the tokens (and the grouped
# table's cap to twice the rows per expert). The K split count is no candidate's
# choice: the dense decode class takes it per call (PER_CALL_SPLITS), the others
# run one split (prefill tiles fill the SMs; the grouped kernel has no splits).
CLASSES = (("dense", "decode"), ("dense", "prefill"), ("grouped", "decode"),
           ("grouped", "prefill"))
TILES = {
    ("dense", "decode"): list(itertools.product((64, 128, 256), (8, 16, 32, 64), (128, 256))),
    ("dense", "prefill"): list(itertools.product((64, 128), (64, 128, 256), (128,))),
    ("grouped", "decode"): list(itertools.product((64, 128, 256), (8, 16), (128, 256))),
    ("grouped", "prefill"): list(itertools.product((64, 128), (64, 128, 256), (128,))),
}
DEPTHS = (2, 3, 4, 6)
PER_CALL_SPLITS = frozenset({("dense", "decode")})
GROUPS = kt.GROUPS
# The depth tiles are compiled at: the shallowest, so a tile whose deeper pipelines
# overflow shared memory still gets its registers (smem_bytes gives each depth's).
COMPILE_DEPTH = 2


def shape_class(case: kt.KernelCase) -> tuple[str, str]:
  """(op, class) of a target case, as BlockSizes.get_default classifies it."""
  d = case.d
  if case.kernel == "int4_grouped_matmul":
    rows = -(-d["m"] // d["experts"])
    return "grouped", "decode" if rows <= GROUPED_DECODE_MAX_ROWS else "prefill"
  return "dense", "decode" if d["m"] <= DECODE_MAX_M else "prefill"


def class_cases(op: str, cls: str) -> list[kt.KernelCase]:
  """The INT4 target cases of one shape class."""
  cases = kt.int4_grouped_cases() if op == "grouped" else kt.int4_dense_cases()
  return [c for c in cases if shape_class(c) == (op, cls)]


def candidates(op: str, cls: str) -> list[BlockSizes]:
  """Every (tile shape, depth) candidate of one shape class (one K split: see
  PER_CALL_SPLITS)."""
  return [BlockSizes(tn, tm, tk, 1, depth)
          for (tn, tm, tk), depth in itertools.product(TILES[(op, cls)], DEPTHS)]


def resolve(bs: BlockSizes, case: kt.KernelCase, *, per_call: bool = False) -> BlockSizes:
  """``bs`` as a table row applied to ``case``: BlockSizes.get_default's tile_m rule
  for the grouped kernel, then ``fit``; with ``per_call`` (dense only) the K split
  count get_default picks for the call instead of ``bs.k_splits``."""
  d = case.d
  m, n, k = d["m"], d["n"], d["k"]
  if case.kernel == "int4_grouped_matmul":
    rows = -(-m // d["experts"])
    bs = dataclasses.replace(bs, tile_m=min(bs.tile_m, -(-2 * rows // 8) * 8))
  elif per_call:
    return bs.fit_splits_per_call(m, n, k, group_size=d["group_size"])
  return bs.fit(m, n, k)


def tile_key(op: str, bs: BlockSizes, group_size: int) -> str:
  """The readings' key of a tile shape: what its long-loop compile depends on."""
  return f"{op}/n{bs.tile_n}/m{bs.tile_m}/k{bs.tile_k}/g{group_size}"


def routed_group_sizes(m: int, e: int, seed: int = 0) -> np.ndarray:
  """[E] rows per expert for M routed rows, each sent to an expert uniformly at
  random (seeded): the imbalance a router gives even with balanced expert loads,
  which a tile_m sized for the mean rows would split into extra weight passes."""
  return np.random.RandomState(seed).multinomial(m, np.full(e, 1.0 / e))


def _grouped_items(m: int, e: int, tile_m: int) -> int:
  """Tiles the grouped kernel's schedule gives routed_group_sizes(m, e)."""
  from pallas_kernels.int4_matmul.int4_matmul import segment_tiles
  rows = routed_group_sizes(m, e)
  ends = np.cumsum(rows)
  return int(np.sum(segment_tiles(ends - rows, ends, tile_m)))


def modelled_seconds(case: kt.KernelCase, bs: BlockSizes, registers: int) -> float:
  """Modelled H200 time of ``case`` under the resolved block sizes ``bs``
  (``tile_model.seconds``; the grouped kernel's tiles for rows routed at random);
  ``registers`` per thread from ptxas. inf when a CTA does not fit."""
  d = case.d
  grouped = case.kernel == "int4_grouped_matmul"
  tiles = _grouped_items(d["m"], d["experts"], bs.tile_m) if grouped else None
  return tile_model.seconds(bs, m=d["m"], n=d["n"], k=d["k"], group_size=d["group_size"],
                            registers=registers, grouped_tiles=tiles)


@dataclasses.dataclass(frozen=True)
class Choice:
  """One shape class's pick: the row, its score and the runner-up's."""
  op: str
  cls: str
  block_sizes: BlockSizes
  score: float  # geometric mean over the class's cases of time / best time
  runner_up: BlockSizes | None
  runner_up_score: float
  cases: int
  candidates: int
  best: tuple[float, ...] = ()  # per case, the least modelled time of any candidate


def score(times: Sequence[float], best: Sequence[float]) -> float:
  """The geometric mean over cases of time / the best candidate's time (1: best
  everywhere); what ``select`` ranks candidates by."""
  return float(np.exp(np.mean(np.log(np.asarray(times) / np.asarray(best)))))


def select(readings: dict, op: str, cls: str,
           cases: Sequence[kt.KernelCase] | None = None) -> Choice:
  """The class's best candidate by the model, from ``readings`` ({tile_key: reading}).

  A candidate is in only if every tile shape it resolves to at the class's cases
  has a clean reading (compiled, no spills) and fits the shared memory limit.

  Raises:
    KeyError: a tile shape the candidates need has no reading.
  """
  cases = list(cases) if cases is not None else class_cases(op, cls)
  per_call = (op, cls) in PER_CALL_SPLITS
  times = {}
  for cand in candidates(op, cls):
    row = [case_seconds(readings, op, cand, case, per_call=per_call) for case in cases]
    if not np.isnan(row).any():
      times[cand] = np.asarray(row)
  if not times:
    raise ValueError(f"no candidate of {op} {cls} compiles cleanly")
  best = np.min(np.stack(list(times.values())), axis=0)
  scores = {c: score(t, best) for c, t in times.items()}
  # Ties (within 0.1%) go to the smaller footprint: shallower pipeline, smaller tile.
  order = sorted(scores, key=lambda c: (round(scores[c], 3), c.max_concurrent_steps,
                                        c.tile_n * c.tile_m * c.tile_k))
  first = order[0]
  second = order[1] if len(order) > 1 else None
  return Choice(op, cls, first, scores[first], second,
                scores[second] if second else math.nan, len(cases), len(times),
                tuple(best.tolist()))


def case_seconds(readings: dict, op: str, bs: BlockSizes, case: kt.KernelCase, *,
                 per_call: bool = False) -> float:
  """Modelled time of one case under the table row ``bs`` (``per_call``: with the
  K split count chosen for the call, see ``resolve``); nan where the tile it
  resolves to is not clean or overflows the H200's shared memory.

  Raises:
    KeyError: that tile has no reading.
  """
  res = resolve(bs, case, per_call=per_call)
  g = case.d["group_size"]
  r = readings[tile_key(op, res, g)]
  smem = res.smem_bytes(group_size=g, scale_bytes=2, grouped=op == "grouped", layout="nk")
  if not clean(r) or smem > H200_SMEM_BYTES:
    return math.nan
  return modelled_seconds(case, res, r["registers"])


# The fixed K split counts the per-call choice is compared with (split_scores).
FIXED_SPLITS = (1, 2, 4, 8, 16)


def split_scores(readings: dict, choice: Choice | None = None) -> dict[int | str, float]:
  """The dense decode row's tiles with each fixed K split count (keys 1, 2, 4, 8,
  16: the count, or the largest divisor of a case's K steps below it) and with the
  count ``BlockSizes.get_default(layout="nk")`` picks per call ("per call"), each
  as ``score`` against the class's best candidates (``choice``: the dense decode
  ``select``, computed when None). A fixed count whose tile overflows or spills at
  some case is left out."""
  op, cls = "dense", "decode"
  choice = choice or select(readings, op, cls)
  cases = class_cases(op, cls)
  row = TUNED_NK[(H200, op, cls)]
  out: dict[int | str, float] = {}
  for ks in FIXED_SPLITS:
    times = [case_seconds(readings, op, dataclasses.replace(row, k_splits=ks), case)
             for case in cases]
    if not np.isnan(times).any():
      out[ks] = score(times, choice.best)
  out["per call"] = score([case_seconds(readings, op, BlockSizes.get_default(
      case.d["m"], case.d["n"], case.d["k"], device_kind=H200, layout="nk",
      group_size=case.d["group_size"]), case) for case in cases], choice.best)
  return out


def versus(readings: dict, op: str, cls: str, pick: BlockSizes,
           other: BlockSizes) -> tuple[float, float]:
  """(median, max) over the class's cases of other's modelled time (its own split
  count) / pick's (as the table runs it: per call in PER_CALL_SPLITS classes)."""
  per_call = (op, cls) in PER_CALL_SPLITS
  ratios = [case_seconds(readings, op, other, c)
            / case_seconds(readings, op, pick, c, per_call=per_call)
            for c in class_cases(op, cls)]
  return float(np.nanmedian(ratios)), float(np.nanmax(ratios))


def clean(reading: dict) -> bool:
  """Compiled, with no spills, no stack frame, and wgmmas that ptxas did not
  serialise (what it does when the converted weight tile and the accumulator
  outgrow the registers: 256 x 256 tiles read 55-72 registers and no spills, but
  every wgmma then waits for the one before)."""
  return (not reading.get("error") and not reading["spill_stores"]
          and not reading["spill_loads"] and not reading["stack"]
          and not reading.get("wgmma_serialized"))


def needed_tiles(op: str, cls: str) -> dict[str, tuple[BlockSizes, int]]:
  """{tile_key: (tile shape, group size)} of every tile the class's candidates resolve to."""
  out = {}
  for cand, case in itertools.product(candidates(op, cls), class_cases(op, cls)):
    bs = resolve(cand, case)
    g = case.d["group_size"]
    out.setdefault(tile_key(op, bs, g), (bs, g))
  return out


def tile_build(op: str, bs: BlockSizes, group_size: int):
  """The compile behind a tile's reading: the nk kernel on a problem of two tiles by
  two (grouped: two experts of tile_m rows) and LONG_LOOP_STEPS K steps, depth
  COMPILE_DEPTH, bf16 scales."""
  from pallas_kernels.h200 import kernel_readings as kc
  k = bs.tile_k * LONG_LOOP_STEPS
  tiles = BlockSizes(bs.tile_n, bs.tile_m, bs.tile_k, 1, COMPILE_DEPTH)
  if op == "grouped":
    case = kt.kernel_case("int4_grouped_matmul", "tile", "tune", m=2 * bs.tile_m, k=k,
                    n=2 * bs.tile_n, group_size=group_size, experts=2)
  else:
    case = kt.kernel_case("int4_matmul", "tile", "tune", m=2 * bs.tile_m, k=k, n=2 * bs.tile_n,
                    group_size=group_size)
  return kc.Build(case, "nk", True, tiles, kc.kernel_key(case, "nk", tiles))


def compile_tiles(keys: dict[str, tuple[BlockSizes, int]], readings: dict, *,
                  compile_fn: Callable | None = None,
                  progress: Callable[[str], None] | None = None) -> dict:
  """Adds a reading for every key of ``keys`` missing from ``readings``; returns them."""
  from pallas_kernels.h200 import kernel_readings as kc
  compile_fn = compile_fn or kc.compile_build
  todo = [k for k in keys if k not in readings]
  for i, key in enumerate(sorted(todo)):
    op = key.split("/")[0]
    bs, g = keys[key]
    r = compile_fn(tile_build(op, bs, g))
    readings[key] = {f: r[f] for f in ("registers", "spill_stores", "spill_loads", "stack",
                                       "smem", "wgmma_serialized", "error")}
    if progress:
      status = r["error"][:60] if r["error"] else (
          f"{r['registers']} regs, {r['spill_stores']} B spilled, {r['stack']} B stack, "
          f"{r['smem']} B smem" + (", wgmma serialised" if r["wgmma_serialized"] else ""))
      progress(f"[{i + 1}/{len(todo)}] {key}: {status}")
  return readings


def load_readings(path: str = DATA_PATH) -> dict:
  """The committed tile readings ({tile_key: reading}); {} when the file is absent."""
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    data = json.load(f)
  return data["tiles"]


def save_readings(readings: dict, path: str = DATA_PATH, *, ptxas: str | None = None) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump({"ptxas": ptxas, "compile_depth": COMPILE_DEPTH,
               "long_loop_steps": LONG_LOOP_STEPS,
               "tiles": dict(sorted(readings.items()))}, f, indent=1)
    f.write("\n")


def format_block_sizes(bs: BlockSizes | None) -> str:
  """A table row in words, e.g. "128 x 64 x 128, depth 2" ("-" for None)."""
  if bs is None:
    return "-"
  return (f"{bs.tile_n} x {bs.tile_m} x {bs.tile_k}, depth {bs.max_concurrent_steps}"
          + (f", {bs.k_splits} splits" if bs.k_splits > 1 else ""))


def markdown(choices: Iterable[Choice]) -> str:
  """The picks as a table (modelled, not timed)."""
  lines = ["| op | class | cases | candidates | pick (tile_n x tile_m x tile_k) | score "
           "| runner-up | its score |", "|---|---|---|---|---|---|---|---|"]
  for c in choices:
    lines.append(f"| {c.op} | {c.cls} | {c.cases} | {c.candidates} "
                 f"| {format_block_sizes(c.block_sizes)} | {c.score:.3f} "
                 f"| {format_block_sizes(c.runner_up)} | {c.runner_up_score:.3f} |")
  return "\n".join(lines)
