"""Every Pallas kernel at its H200 target shapes through XLA's GPU compiler and ptxas.

The sweep behind the deviceless compile tests (tests/test_h200_compile_*.py), the
``experiments.kernel_compile`` command line and the ``kernels`` experiment's compile
table; docs/h200_compile.md explains the method.

* :func:`builds` turns a target case (``pallas_kernels.targets``) into what the
  engine runs for it on an H200: the op, its abstract arguments, the block sizes of
  the H200 rows of the tables and the kernel (Mosaic GPU or Triton) the op's
  ``impl="auto"`` picks; optionally the other attention kernel too.
* :func:`kernel_key` names what the compiled kernel depends on. Cases with the same
  key compile to the same kernel up to grid extents and address constants, so
  :func:`plan` compiles one build per key (the one with the largest arguments) and
  :func:`sweep` gives every case the readings of the compile that covers it.
  :func:`verify_dedup` compiles each build on its own and checks that every member
  of a key group reads the same, which is the evidence for the dedup.
* Records (one dict per case and kernel) go to JSON with :func:`write_records`;
  :func:`load_records` and :func:`markdown` are the stable reading API.

It lives beside ``compile`` (one compile, its ptxas report) because it is the
kernels' own account of themselves at the shapes they are for: what each target
case builds, what that build's compile depends on, and whether it fits an H200.
Where the records are kept is the caller's choice (the tests and the command line
use results/h200_kernel_compile/).

Needs ``pallas_kernels.h200.env.prepare()`` before jax is imported (the tests'
conftest does it) for the compiles; loading and rendering records do not.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import subprocess
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import tables
from pallas_kernels import targets as kt
from pallas_kernels.h200 import compile as hc
from pallas_kernels.h200 import env
from pallas_kernels.indexer import IndexerBlockSizes
from pallas_kernels.indexer import TopkBlockSizes
from pallas_kernels.fp8_matmul import fp8_grouped_matmul, grouped_block_sizes as fp8_block_sizes
from pallas_kernels.indexer import paged_index_scores
from pallas_kernels.indexer import topk_positions
from pallas_kernels.int4_matmul import HARDWARE_LAYOUT as INT4_HARDWARE_LAYOUT
from pallas_kernels.int4_matmul import BlockSizes as Int4BlockSizes
from pallas_kernels.int4_matmul import int4_grouped_matmul
from pallas_kernels.int4_matmul import int4_grouped_matmul_nk
from pallas_kernels.int4_matmul import int4_matmul
from pallas_kernels.int4_matmul import int4_matmul_nk
from pallas_kernels.paged_attention import SparseBlockSizes
from pallas_kernels.paged_attention import mla_mgpu
from pallas_kernels.paged_attention import ops as attention_ops
from pallas_kernels.paged_attention.block_sizes import next_pow2
from pallas_kernels.tag_check import BlockSizes as TagBlockSizes
from pallas_kernels.tag_check import tag_check

H200 = "NVIDIA H200"
# H200 limits: shared memory per block (opt-in) and registers per thread.
SMEM_LIMIT_BYTES = hc.SMEM_LIMIT_BYTES
MAX_REGISTERS = hc.MAX_REGISTERS
# Triton addresses an operand with 64-bit offsets once it is larger than this
# (jax/_src/pallas/triton/lowering.py), which changes the kernel's registers.
TRITON_WIDE_OFFSET_BYTES = 2**32
READINGS = ("registers", "spill_stores", "spill_loads", "stack", "smem", "wgmma_serialized")
# How far ptxas' register count moves for one kernel structure: the same PTX under
# different heap layouts (191 / 193), or other address constants (+-1). Witnesses
# of a shared compile must read within this of it.
REGISTER_NOISE = 4
# From this many pipeline steps on, the INT4 loop's trip count no longer changes the
# kernel ptxas builds (a short constant-trip loop is unrolled; a long one is not).
INT4_LONG_LOOP_STEPS = 8
# The same for the sparse MLA decode kernel's loop over a split's selected rows
# (indices per split / block_k): ptxas reads 1, 2 and 3 steps differently and 4 to
# 32 alike (docs/h200_compile.md).
SPARSE_LONG_LOOP_STEPS = 4
# Kernels an op launches beside its own, read and checked with it (their spills and
# shared memory are the record's problems too) but not what the record is of: the
# merge of the Mosaic GPU decode kernels' pieces (paged_attention/merge_pieces_mgpu.py,
# or merge_pieces.py on the Triton backend), whose own target configurations
# tests/test_merge_pieces_kernel.py compiles; and the grouped matmuls' schedule
# (int4_matmul/schedule_kernel.py, compiled at its own shapes by
# tests/test_grouped_schedule_kernel.py); and the MLA decode kernels' scaled query over an
# fp8 cache (paged_attention/query.py, tests/test_scaled_query_kernel.py).
COMPANION_KERNELS = ("merge_pieces_mgpu_mosaic_gpu_kernel", "merge_pieces", "grouped_schedule",
                     "scaled_query")
# A shared compile covers its other cases only with this much headroom below the
# register limit; closer to 255 every case of the group is compiled on its own,
# so "zero spills" never rests on a neighbour's reading.
DEDUP_MAX_REGISTERS = MAX_REGISTERS - 2 * REGISTER_NOISE


@dataclasses.dataclass(frozen=True)
class Build:
  """One target case compiled with one kernel, exactly as the op is called.

  Attributes:
    case: the target case (shapes and static arguments).
    impl: "mgpu" (Mosaic GPU), "triton", or the kernel family for ops with one.
    engine: whether the engine runs this kernel on an H200 (the op's "auto" choice).
    block_sizes: the op's resolved BlockSizes (H200 rows), passed explicitly.
    key: what the compiled kernel depends on, as sorted (name, value) pairs.
  """

  case: kt.KernelCase
  impl: str
  engine: bool
  block_sizes: Any
  key: tuple

  def call(self) -> tuple[Callable[..., Any], list, dict]:
    """(op, abstract arguments on one H200, static keyword arguments)."""
    shapes = self.case.arg_shapes()
    op = OPS[self.case.kernel]
    if self.impl == "nk":  # the INT4 kernels on [.., N, K] int4 weights (the engine's on a GPU)
      (wshape, _), op = shapes[1], NK_OPS[self.case.kernel]
      shapes = [shapes[0], ((*wshape[:-2], wshape[-1], 2 * wshape[-2]), jnp.int4), *shapes[2:]]
    specs = [None if a is None else hc.spec(*a) for a in shapes]
    kwargs = dict(self.case.static_kwargs(), backend="pallas", block_sizes=self.block_sizes)
    return op, specs, kwargs

  @property
  def variant(self) -> str:
    """impl, and for the Mosaic GPU MLA kernels which one ("mgpu-tokens",
    "mgpu-heads": what fills wgmma's M; "-qk8" where QK runs as fp8 wgmmas;
    "-compute-loads" without the producer warpgroup); "mgpu-producer" for the
    GQA kernel with one."""
    m = getattr(self.block_sizes, "mla_m", None)
    if self.case.kernel == "paged_mla_decode" and self.impl == "mgpu" and m != "auto":
      return (f"mgpu-{m}" + ("-qk8" if self.block_sizes.mla_qk == "fp8" else "")
              + ("-compute-loads" if self.block_sizes.loads == "compute" else ""))
    if (self.case.kernel == "paged_gqa_decode" and self.impl == "mgpu"
        and self.block_sizes.gqa_loads == "producer"):
      return "mgpu-producer"
    return self.impl

  @property
  def arg_bytes(self) -> int:
    """Bytes of all arguments; the largest build of a key group is compiled."""
    return sum(math.prod(s) * _itemsize(dt) for s, dt in filter(None, self.case.arg_shapes()))

  @property
  def key_str(self) -> str:
    return " ".join(f"{k}={v}" for k, v in self.key)


OPS: dict[str, Callable[..., Any]] = {
    "paged_mla_decode": attention_ops.paged_mla_decode,
    "paged_gqa_decode": attention_ops.paged_gqa_decode,
    "int4_matmul": int4_matmul,
    "int4_grouped_matmul": int4_grouped_matmul,
    "tag_check": tag_check,
    "paged_mla_sparse_decode": attention_ops.paged_mla_sparse_decode,
    "paged_index_scores": paged_index_scores,
    "topk_positions": topk_positions,
    "fp8_grouped_matmul": fp8_grouped_matmul,
}
# The INT4 kernels on [N, K] int4 weights (Int4Weight layout "nk"), impl "nk".
NK_OPS: dict[str, Callable[..., Any]] = {
    "int4_matmul": int4_matmul_nk,
    "int4_grouped_matmul": int4_grouped_matmul_nk,
}


def _itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


def _abstract(case) -> list:
  return [None if a is None else jax.ShapeDtypeStruct(*a) for a in case.arg_shapes()]


def _dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def _attention_builds(case, other_impl: bool) -> list[Build]:
  args = _abstract(case)
  mla = case.kernel == "paged_mla_decode"
  if mla:
    q, _, pages, k_rope, *_, tables, _ = args
    choose = functools.partial(attention_ops.mla_kernel_choice, q, pages, k_rope, tables)
  else:
    q, pages, _, _, _, tables, _ = args
    choose = functools.partial(attention_ops.gqa_kernel_choice, q, pages, tables)

  def resolved(bs):
    """bs with the Mosaic GPU MLA kernel named ("tokens" / "heads" in wgmma's M,
    QK "fp8" / "f16"), so the key and the record say which one compiled; raises
    ValueError where the shape has no such kernel."""
    choose(bs)
    if mla and bs.impl == "mgpu":
      tokens = attention_ops.mla_tokens_in_m(bs, q, pages, k_rope)
      qk8 = attention_ops.mla_qk_fp8(bs, tokens, pages)
      bs = dataclasses.replace(bs, mla_m="tokens" if tokens else "heads",
                               mla_qk="fp8" if qk8 else "f16")
    return bs

  bs, impl = choose(device_kind=H200)  # the engine's choice: impl "auto"
  engine = resolved(dataclasses.replace(bs, impl=impl))
  variants = [engine]
  if other_impl:
    variants += [dataclasses.replace(bs, impl=i) for i in ("mgpu", "triton") if i != impl]
    if mla and impl == "mgpu":  # the other Mosaic GPU MLA kernel
      variants.append(dataclasses.replace(
          engine, mla_m="heads" if engine.mla_m == "tokens" else "tokens", mla_qk="auto"))
      if engine.mla_qk == "fp8":  # the same kernel with f16 QK
        variants.append(dataclasses.replace(engine, mla_qk="f16"))
      # the same kernel without its producer warpgroup
      variants.append(dataclasses.replace(engine, loads="compute"))
    if not mla and impl == "mgpu":  # the GQA kernel with a producer warpgroup
      variants.append(dataclasses.replace(engine, gqa_loads="producer"))
  out = []
  for v in variants:
    try:
      pinned = resolved(v)
    except ValueError:  # this shape has no such kernel
      continue
    out.append(Build(case, pinned.impl, pinned == engine, pinned,
                     kernel_key(case, pinned.impl, pinned)))
  return out


def _int4_block_sizes(case, impl: str = "nk"):
  """The H200 rows the op resolves for ``case``: impl "nk" (the [N, K] int4 kernels)
  reads TUNED_NK, "mgpu" (packed) TUNED."""
  d = case.d
  grouped = case.kernel == "int4_grouped_matmul"
  return Int4BlockSizes.get_default(d["m"], d["n"], d["k"], grouped=grouped,
                                    experts=d.get("experts", 1), device_kind=H200,
                                    layout="nk" if impl == "nk" else "kn",
                                    group_size=d["group_size"]).fit(d["m"], d["n"], d["k"])


def _tag_block_sizes(case):
  d = case.d
  return TagBlockSizes.get_default(d["batch"], d["max_pages"])


def _sparse_block_sizes(case):
  d = case.d
  return SparseBlockSizes.get_default(num_heads=d["heads"], num_indices=d["topk"],
                                      batch=d["batch"], device_kind=H200)


def _indexer_block_sizes(case):
  del case  # one tiling for every shape (IndexerBlockSizes' defaults are the H200's)
  return IndexerBlockSizes()


def _topk_block_sizes(case):
  del case  # one tiling for every shape (TopkBlockSizes' defaults are the H200's)
  return TopkBlockSizes()


def builds(case, *, other_impl: bool = False) -> list[Build]:
  """What the engine compiles for ``case`` on an H200 (and optionally the other kernel).

  Args:
    case: a ``pallas_kernels.targets.KernelCase``.
    other_impl: for paged attention, also the kernel "auto" does not pick
      (Triton where Mosaic GPU runs, and the reverse where the shape allows); for
      the INT4 matmuls, also the packed-layout kernel ("mgpu") beside the engine's
      "nk" one.
      The sparse-attention kernels have one implementation (Triton).

  Returns:
    The builds, the engine's first.
  """
  if case.kernel in ("paged_mla_decode", "paged_gqa_decode"):
    return _attention_builds(case, other_impl)
  if case.kernel in ("int4_matmul", "int4_grouped_matmul"):
    # The serving engines quantise into the layout whose kernels are right on an H200
    # (INT4_HARDWARE_LAYOUT): "mgpu" is the packed-layout kernel, "nk" the [N, K] one.
    engine, other = ("nk", "mgpu") if INT4_HARDWARE_LAYOUT == "nk" else ("mgpu", "nk")
    impls = (engine, other) if other_impl else (engine,)
    return [Build(case, i, i == engine, bs, kernel_key(case, i, bs))
            for i in impls for bs in [_int4_block_sizes(case, i)]]
  if case.kernel == "fp8_grouped_matmul":
    d = case.d
    bs = fp8_block_sizes(d["m"], d["n"], d["k"], d["experts"], device_kind=H200)
    return [Build(case, "mgpu", True, bs, kernel_key(case, "mgpu", bs))]
  block_sizes = {"tag_check": _tag_block_sizes, "paged_mla_sparse_decode": _sparse_block_sizes,
                 "paged_index_scores": _indexer_block_sizes, "topk_positions": _topk_block_sizes}
  if case.kernel in block_sizes:
    bs = block_sizes[case.kernel](case)
    return [Build(case, "triton", True, bs, kernel_key(case, "triton", bs))]
  raise ValueError(f"unknown kernel {case.kernel!r}")


def kernel_key(case, impl: str, block_sizes) -> tuple:
  """What the compiled kernel of ``case`` depends on, as sorted (name, value) pairs.

  Every static value the kernel body is built from is in the key: dtypes, the
  per-token entry widths, page size, softmax scale, every block size the kernel
  reads (the Mosaic GPU attention kernels read none of the Triton tiles), and for
  INT4 and sparse MLA decode the loop's static step count (a short constant-trip
  loop is compiled differently: INT4 140 registers at 1 step, 184 at 5; sparse
  MLA fp8 176 at 2 steps, 182 at 4 or more). Left out are the dims that only set
  grid extents, global-memory extents and address constants: batch, context
  (block-table width), pool pages, experts, the number of selected positions,
  token rows beyond one tile, columns beyond one tile and the split-K count
  (dense attention's per-split page count is an address constant, its loop over
  a split's pages runs to a length read at run time; the sparse kernel's splits
  matter only through its step count, which is in the key). Three exceptions
  keep the key honest, each seen in ptxas' readings: a grid axis of extent 1
  turns its program index into a constant (GQA at one request or one split: up
  to 11 registers apart), so which axes have extent 1 is in the key; a Triton
  kernel switches to 64-bit addressing once an operand exceeds 4 GiB (MLA bf16,
  16 heads: 218 against 168 registers; sparse MLA fp8, 16 heads: 106 against
  128); and GQA's KV head count sizes a shared-memory scale tile. What is left moves the register
  count by a register or two (REGISTER_NOISE); :func:`verify_dedup` measures it.

  Args:
    case: the target case.
    impl: "mgpu" or "triton".
    block_sizes: the resolved block sizes the op is called with.

  Returns:
    A hashable, sorted tuple of (name, value).
  """
  d = case.d
  key = {"kernel": case.kernel, "impl": impl}
  fields = dataclasses.asdict(block_sizes)
  if case.kernel in ("paged_mla_decode", "paged_gqa_decode"):
    fields.pop("num_splits")
    fields.pop("merge")  # a companion kernel's choice (COMPANION_KERNELS), not this kernel's
    if not (impl == "mgpu" and case.kernel == "paged_mla_decode"):
      fields.pop("loads")  # read by the Mosaic GPU MLA kernels only
    if not (impl == "mgpu" and case.kernel == "paged_gqa_decode"):
      fields.pop("gqa_loads")  # read by the Mosaic GPU GQA kernel only
    if impl == "mgpu":  # the Triton tiles: the Mosaic GPU kernels fix their own
      for name in ("block_h", "pages_per_block", "num_warps", "num_stages"):
        fields.pop(name)
    else:  # the Mosaic GPU MLA kernels' choices
      fields.pop("mla_m", None)
      fields.pop("mla_qk", None)
    key.update(kv=d["kv"], page_size=d["page_size"], **case.static_kwargs())
    if case.kernel == "paged_mla_decode":
      key.update(c=d["c"], r=d["r"])
      if impl == "mgpu" and block_sizes.mla_m == "tokens":
        # mla_tokens_mgpu: the heads, padded to 8, are wgmma's N; one program.
        key["heads_n"] = -(-d["heads"] // 8) * 8
        head_programs = 1
      else:
        heads_per_program = 64 if impl == "mgpu" else block_sizes.block_h  # mla_mgpu.BLOCK_H
        head_programs = -(-d["heads"] // heads_per_program)
        if impl == "mgpu":
          # mla_mgpu writes the real heads' partial rows (rounded up to 8): a
          # block of 8 rows and a full 64-row block are different stores.
          key["partial_rows"] = -(-d["heads"] // 8) * 8
    else:
      key.update(head_dim=d["head_dim"], kv_heads=d["kv_heads"])
      head_programs = d["kv_heads"]
    if impl == "mgpu":
      # Grid (head blocks, pieces): the balanced schedule has no batch or split axis.
      key["unit_axes"] = _unit_axes(heads=head_programs)
    else:
      key["unit_axes"] = _unit_axes(batch=d["batch"], heads=head_programs,
                                    splits=block_sizes.num_splits)
  elif case.kernel in ("int4_matmul", "int4_grouped_matmul"):
    grouped = case.kernel == "int4_grouped_matmul"
    steps = d["k"] // block_sizes.tile_k // (1 if grouped else block_sizes.k_splits)
    key.update(group_size=d["group_size"],
               k_steps=steps if steps < INT4_LONG_LOOP_STEPS else f">={INT4_LONG_LOOP_STEPS}",
               pipeline_depth=min(block_sizes.max_concurrent_steps, steps),
               **{f"{n}_dtype": _dtype_name(a[1])
                  for n, a in zip(("x", "packed", "scales"), case.arg_shapes())})
    if not grouped:  # the grouped grid is persistent: one axis of many CTAs
      key["unit_axes"] = _unit_axes(n=d["n"] // block_sizes.tile_n,
                                    tiles=-(-d["m"] // block_sizes.tile_m),
                                    splits=block_sizes.k_splits)
  elif case.kernel == "fp8_grouped_matmul":
    # One K step per 128-row scale block; the grid is persistent (one axis of many CTAs).
    steps = d["k"] // block_sizes.tile_k
    key.update(k_steps=steps if steps < INT4_LONG_LOOP_STEPS else f">={INT4_LONG_LOOP_STEPS}",
               pipeline_depth=min(block_sizes.max_concurrent_steps, steps))
  elif case.kernel == "tag_check":
    key.update(page_size=d["page_size"],
               padded_pages=next_pow2(d["max_pages"]))
    key["unit_axes"] = _unit_axes(programs=-(-d["batch"] // block_sizes.block_b))
  elif case.kernel == "paged_mla_sparse_decode":
    # The splits set a grid axis and an index offset; the indices per split set the
    # loop's constant trip count (ops.paged_mla_sparse_decode pads K to whole steps).
    fields.pop("num_splits")
    bk, splits = block_sizes.block_k, block_sizes.num_splits
    steps = max(-(-d["topk"] // (splits * bk)), 2)  # the op runs at least two steps
    long_loop = SPARSE_LONG_LOOP_STEPS
    key.update(kv=d["kv"], page_size=d["page_size"], c=d["c"], r=d["r"],
               k_steps=steps if steps < long_loop else f">={long_loop}",
               **case.static_kwargs())
    key["unit_axes"] = _unit_axes(batch=d["batch"],
                                  heads=-(-d["heads"] // block_sizes.block_h),
                                  splits=block_sizes.num_splits)
  elif case.kernel == "paged_index_scores":
    key.update(kv=d["kv"], page_size=d["page_size"], index_dim=d["index_dim"],
               # the op pads heads to a power of two >= 16 (the dot's M) before the kernel
               index_heads=max(16, next_pow2(d["index_heads"])))
    key["unit_axes"] = _unit_axes(batch=d["batch"],
                                  blocks=-(-d["context"] // block_sizes.block_k))
  elif case.kernel == "topk_positions":
    # k sizes the output and the kernel's arithmetic; the context only its passes' trip
    # counts (run-time loops) and the input's extent.
    key.update(k=d["topk"])
    key["unit_axes"] = _unit_axes(batch=d["batch"])
  if impl == "triton":
    big = max(math.prod(s) * _itemsize(dt) for s, dt in filter(None, case.arg_shapes()))
    key["wide_offsets"] = big > TRITON_WIDE_OFFSET_BYTES
  if case.kernel == "int4_matmul":
    fields.pop("k_splits")  # the splits set a grid axis and a K offset (steps are per split)
  key.update({f"bs.{k}": v for k, v in fields.items()})
  return tuple(sorted(key.items()))


def _unit_axes(**extents: int) -> str:
  """The grid axes of extent 1 (their program index is a compile-time 0), e.g. "batch+splits"."""
  return "+".join(name for name, n in extents.items() if n == 1) or "none"


@dataclasses.dataclass(frozen=True)
class Group:
  """Builds that share one kernel key; ``builds[0]`` (the largest) is compiled."""

  key: tuple
  builds: tuple[Build, ...]

  @property
  def compiled(self) -> Build:
    return self.builds[0]

  @property
  def name(self) -> str:
    b = self.compiled
    return f"{b.case.name}@{b.variant}"


def plan(all_builds: Iterable[Build]) -> list[Group]:
  """Groups builds by kernel key, in first-seen order, largest arguments first."""
  groups: dict[tuple, list[Build]] = {}
  for b in all_builds:
    groups.setdefault(b.key, []).append(b)
  return [Group(k, tuple(sorted(v, key=lambda b: -b.arg_bytes))) for k, v in groups.items()]


def target_groups(kernels: Sequence[str] | None = None, *, other_impl: bool = False,
                  only: Sequence[str] = ()) -> list[Group]:
  """The compile plan for the target cases of ``kernels`` (None: all).

  Args:
    kernels: kernel names from ``pallas_kernels.targets.KERNELS``.
    other_impl: include the attention kernel the engine does not pick.
    only: keep cases whose name contains one of these substrings.
  """
  cases = kt.target_cases(tuple(kernels) if kernels else kt.KERNELS)
  if only:
    cases = [c for c in cases if any(o in c.name for o in only)]
  return plan(b for c in cases for b in builds(c, other_impl=other_impl))


def compile_build(build: Build) -> dict:
  """Compiles one build for an H200 and returns its readings.

  Returns:
    {"kernel_name", "registers", "spill_stores", "spill_loads", "stack", "smem",
    "wgmma_serialized", "seconds", "error"}; readings are None and "error" says why when the compile
    failed (e.g. shared memory overflow, which Mosaic GPU raises at lowering and
    Triton at compile).

  Raises:
    pallas_kernels.h200.compile.H200CompileUnavailable: the compiler packages or
      the environment are missing (never turned into a failed reading).
  """
  fn, specs, kwargs = build.call()
  t0 = time.perf_counter()
  try:
    report = hc.compile_for_h200(fn, *specs, **kwargs)
  except hc.H200CompileUnavailable:
    raise
  except Exception as e:  # a kernel that does not compile is a reading, not a crash
    msg = f"{type(e).__name__}: {e}".strip()
    return dict.fromkeys(READINGS) | {"kernel_name": None, "seconds": time.perf_counter() - t0,
                                      "error": msg[:2000]}
  own = {n: st for n, st in report.kernels.items() if n not in COMPANION_KERNELS}
  if len(own) != 1:
    return dict.fromkeys(READINGS) | {
        "kernel_name": ",".join(sorted(report.kernels)) or None, "seconds": report.seconds,
        "error": f"expected one Pallas kernel besides {COMPANION_KERNELS} in ptxas' report, "
                 f"got {sorted(report.kernels)}"}
  (name, st), = own.items()
  companions = {n: {k: getattr(c, k) for k in READINGS}
                for n, c in sorted(report.kernels.items()) if n in COMPANION_KERNELS}
  return {"kernel_name": name, **{k: getattr(st, k) for k in READINGS},
          "companions": companions, "seconds": report.seconds, "error": None}


def problems(readings: dict) -> list[str]:
  """What is wrong with one compile's readings; [] when it compiled with zero spills,
  its wgmmas not serialised by ptxas, and shared memory within the H200's per-block
  limit."""
  if readings.get("error"):
    return [readings["error"]]
  out = []
  for name, c in (readings.get("companions") or {}).items():
    out += [f"{name}: {p}" for p in problems(c | {"error": None})]
  if readings["spill_stores"] or readings["spill_loads"]:
    out.append(f"register spills: {readings['spill_stores']} B stored, "
               f"{readings['spill_loads']} B loaded ({readings['registers']} registers)")
  if readings.get("wgmma_serialized"):
    out.append(f"ptxas serialised the wgmmas: {readings['wgmma_serialized']}")
  if readings["smem"] is None:
    out.append("shared memory not read")
  elif readings["smem"] > SMEM_LIMIT_BYTES:
    out.append(f"shared memory {readings['smem']} B > {SMEM_LIMIT_BYTES} B")
  return out


def compile_group(group: Group, compile_fn: Callable[[Build], dict] = None) -> dict:
  """Readings for every build of ``group``: {Build: readings}.

  The group's compile (its largest build) covers every build, unless it reads
  clean but above DEDUP_MAX_REGISTERS registers: then each build is compiled on
  its own. A failing compile covers the group (its other builds share the fault).

  Args:
    group: from :func:`plan`.
    compile_fn: Build -> readings (default :func:`compile_build`; the tests pass a
      cached one).
  """
  compile_fn = compile_fn or compile_build
  first = compile_fn(group.compiled)
  out = {b: first for b in group.builds}
  if not problems(first) and first["registers"] > DEDUP_MAX_REGISTERS:
    out.update({b: compile_fn(b) for b in group.builds[1:]})
  return out


def records_for(group: Group, readings: dict) -> list[dict]:
  """One record per build of ``group`` (readings from :func:`compile_group`).

  Each record names the case, its dims, the kernel (``impl``, and ``engine``:
  whether the engine runs it), the block sizes, the kernel key, ``compiled_as``
  (the build whose compile gave these readings), the readings, ``ok`` and
  ``problems``.
  """
  first = readings[group.compiled]
  now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
  recs = []
  for b in group.builds:
    r = readings[b]
    own = b is group.compiled or r is not first
    bad = problems(r)
    recs.append({
        "case": b.case.name, "kernel": b.case.kernel, "model": b.case.model,
        "dims": b.case.d, "impl": b.impl, "variant": b.variant, "engine": b.engine,
        "block_sizes": dataclasses.asdict(b.block_sizes), "key": b.key_str,
        "compiled_as": f"{b.case.name}@{b.variant}" if own else group.name, "compiled": own,
        **{k: r.get(k) for k in ("kernel_name",) + READINGS},
        "companions": r.get("companions") or {},
        "compile_seconds": r.get("seconds") if own else 0.0,
        "smem_limit": SMEM_LIMIT_BYTES, "ok": not bad, "problems": bad,
        "ptxas": ptxas_version(), "time_utc": now,
    })
  return recs


def sweep(groups: Sequence[Group], *, progress: Callable[[str], None] | None = None
          ) -> list[dict]:
  """Compiles every group (see compile_group); returns one record per build."""
  records = []
  for i, g in enumerate(groups):
    readings = compile_group(g)
    r = readings[g.compiled]
    if progress:
      extra = len({id(v) for v in readings.values()}) - 1
      progress(f"[{i + 1}/{len(groups)}] {g.name} ({len(g.builds)} cases"
               f"{f', {extra} compiled on their own' if extra else ''}): "
               f"{_short(r)} in {r['seconds']:.1f}s")
    records.extend(records_for(g, readings))
  return records


def agree(a: dict, b: dict) -> bool:
  """Whether two builds of one key read alike: same error, spills, stack and shared
  memory, registers within REGISTER_NOISE."""
  if a["error"] or b["error"]:
    return bool(a["error"]) == bool(b["error"])
  return (all(a.get(k) == b.get(k)
              for k in ("spill_stores", "spill_loads", "stack", "smem", "wgmma_serialized"))
          and abs(a["registers"] - b["registers"]) <= REGISTER_NOISE)


def _short(r: dict) -> str:
  if r.get("error"):
    return "ERROR " + r["error"][:200]
  return (f"{r['registers']} regs, spills {r['spill_stores']}/{r['spill_loads']} B, "
          f"stack {r['stack']} B, smem {r['smem']} B")


def verify_dedup(groups: Sequence[Group], *, progress: Callable[[str], None] | None = None
                 ) -> list[dict]:
  """Compiles every build of every multi-build group on its own (the evidence for the dedup).

  Returns:
    One dict per group with more than one build: {"compiled_as", "key", "cases",
    "readings" (per case), "register_spread" (max - min registers), "agree" (every
    build agrees with the group's compile, see :func:`agree`)}.
  """
  out = []
  for g in groups:
    if len(g.builds) < 2:
      continue
    readings = {b.case.name: compile_build(b) for b in g.builds}
    first = readings[g.compiled.case.name]
    regs = [r["registers"] for r in readings.values() if r["registers"] is not None]
    ok = all(agree(first, r) for r in readings.values())
    spread = max(regs) - min(regs) if regs else None
    if progress:
      progress(f"{g.name}: {len(g.builds)} builds, registers {min(regs, default=None)}-"
               f"{max(regs, default=None)}, {'agree' if ok else 'DISAGREE'}")
    out.append({"compiled_as": g.name, "key": g.compiled.key_str, "cases": list(readings),
                "readings": {k: {f: v[f] for f in READINGS + ("error",)}
                             for k, v in readings.items()},
                "register_spread": spread, "agree": ok})
  return out


@functools.cache
def ptxas_version() -> str | None:
  """The version of the ptxas that the compiles use, e.g. "13.0.88"."""
  path = env.wheel_ptxas()
  if path is None:
    return None
  try:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  tail = out.strip().split("V")[-1] if "V" in out else ""
  return tail.split()[0] if tail else None


def write_records(records: Sequence[dict], path: str) -> str:
  """Writes ``records`` as a JSON list to ``path`` (a file; parent folders are created)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(list(records), f, indent=1, sort_keys=True, default=str)
  os.replace(tmp, path)  # readers never see a half-written file
  return path


def record_id(r: dict) -> tuple[str, str]:
  """What one record stands for: its case and kernel (``Build.variant``; records
  written before variants existed name the kernel by ``impl``)."""
  return r["case"], r.get("variant", r["impl"])


def load_records(path: str) -> list[dict]:
  """The compile records under ``path`` (a folder of *.json files, or one file; the
  tests and the command line keep theirs in results/h200_kernel_compile/).

  Returns:
    Records as written by the tests or the CLI (see :func:`records_for`), the
    newest per ``record_id`` where several files hold one, sorted by kernel, case
    and kernel implementation; [] when there are none.
  """
  files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.json")))
  latest: dict[tuple[str, str], dict] = {}
  for f in files:
    with open(f) as fh:
      for r in json.load(fh):
        k = record_id(r)
        if k not in latest or r.get("time_utc", "") >= latest[k].get("time_utc", ""):
          latest[k] = r
  return sorted(latest.values(),
                key=lambda r: (r["kernel"], r["case"], not r["engine"], r["impl"]))


def _fmt_bs(bs: dict, kernel: str, impl: str) -> str:
  if kernel in ("paged_mla_decode", "paged_gqa_decode"):
    if impl == "mgpu":  # the Mosaic GPU kernels fix their own tiles; splits vary by case
      m = {"tokens": "tokens in M", "heads": "heads in M"}.get(bs.get("mla_m"), "own tiles")
      m += ", fp8 QK" if bs.get("mla_qk") == "fp8" else ""
      if kernel == "paged_gqa_decode":
        m += ", producer" if bs.get("gqa_loads") == "producer" else ""
      elif bs.get("mla_m") in ("heads", "tokens"):  # ptxas reads the heads-in-M kernel
        # with a producer at its launch allocation (168 for 384 threads); its compute
        # warpgroups run at mla_mgpu.COMPUTE_REGS
        m += ", producer" if bs.get("loads") == "producer" else ", compute loads"
      return m
    return (f"h{bs['block_h']} ppb{bs['pages_per_block']} w{bs['num_warps']} "
            f"st{bs['num_stages']}")
  if kernel in ("int4_matmul", "int4_grouped_matmul", "fp8_grouped_matmul"):
    return (f"n{bs['tile_n']} m{bs['tile_m']} k{bs['tile_k']} ks{bs['k_splits']} "
            f"p{bs['max_concurrent_steps']}")
  if kernel == "paged_mla_sparse_decode":  # splits vary by case (the step count is keyed)
    return f"h{bs['block_h']} k{bs['block_k']} w{bs['num_warps']} st{bs['num_stages']}"
  if kernel == "paged_index_scores":
    return f"k{bs['block_k']} w{bs['num_warps']} st{bs['num_stages']}"
  if kernel == "topk_positions":
    return f"block{bs['block']} w{bs['num_warps']}"
  return " ".join(f"{k}{v}" for k, v in bs.items())


def _sets_max_registers(record: dict) -> bool:
  """Whether the record's kernel moves registers between warpgroups (setmaxnreg)."""
  bs = record.get("block_sizes") or {}
  return (record["kernel"] == "paged_mla_decode" and record["impl"] == "mgpu"
          and bs.get("mla_m") == "heads" and bs.get("loads") == "producer")


def markdown(records: Sequence[dict]) -> str:
  """A markdown summary of compile records: one row per distinct compile.

  Each row shows the compiled kernel's readings, the block sizes, and how many
  target cases (and which) it covers; a header line counts cases, compiles and
  failures. Every case in ``records`` is covered by exactly one row.
  """
  if not records:
    return "No H200 compile records (run the tests or `python -m experiments.kernel_compile`).\n"
  by_compile: dict[str, list[dict]] = {}
  for r in records:
    by_compile.setdefault(r["compiled_as"], []).append(r)
  rows = []
  order = {k: i for i, k in enumerate(kt.KERNELS)}
  for name, rs in sorted(by_compile.items(),
                         key=lambda kv: (order.get(kv[1][0]["kernel"], len(order)), kv[0])):
    r = rs[0]
    names = sorted(x["case"] for x in rs)
    covered = names[0] if len(names) == 1 else f"{len(names)}: {', '.join(names)}"
    spills = "—" if r["spill_stores"] is None else f"{r['spill_stores']}/{r['spill_loads']}"
    rows.append([r["kernel"], r["impl"] + ("" if r["engine"] else " (alt)"),
                 _fmt_bs(r["block_sizes"], r["kernel"], r["impl"]),
                 "—" if r["registers"] is None else r["registers"], spills,
                 "—" if r["stack"] is None else r["stack"],
                 "—" if r["smem"] is None else r["smem"],
                 "ok" if r["ok"] else "FAIL: " + "; ".join(r["problems"])[:160], covered])
  cases = {record_id(r) for r in records}
  failing = sorted({r["compiled_as"] for r in records if not r["ok"]})
  ptxas = sorted({str(r.get("ptxas")) for r in records})
  head = (f"{len(cases)} kernel builds of {len({r['case'] for r in records})} target cases, "
          f"{len(by_compile)} distinct compiles for an H200 (sm_90a, ptxas {', '.join(ptxas)}); "
          f"{len(failing)} failing. Shared-memory limit {SMEM_LIMIT_BYTES} B per block.\n\n")
  if any(_sets_max_registers(r) for r in records):
    head += ("The heads-in-M MLA kernel with a producer warpgroup reads its launch "
             "allocation (65,536 / 384 threads: 168 registers); `setmaxnreg` then gives its "
             f"compute warpgroups {mla_mgpu.COMPUTE_REGS}, so what they need shows only as "
             "spills (`scripts/mla_producer_registers.py` lowers the limit to find it).\n\n")
  return head + tables.markdown_table(
      ["kernel", "impl", "block sizes", "registers", "spills st/ld (B)", "stack (B)",
       "smem (B)", "status", "cases covered"], rows)
