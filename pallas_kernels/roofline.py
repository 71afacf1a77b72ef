"""The roofline sheet: what every kernel at every target shape can at best reach on an H200.

For each target case of ``pallas_kernels.targets`` (the report's deployments on
one H200) the sheet gives the bytes and FLOPs one call must at least move and do
(the bench modules' ``job_cost``, the same figures ``scripts/gpu_check.py`` rates
its timings against), the predicted time at the measured ceilings (4.3 TB/s device
copy, 790 TFLOP/s dense bf16: ``max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s)``),
which ceiling binds, the design's predicted time (the bytes and MMA FLOPs the
engine's kernel moves and executes, fp8 MMAs at twice the bf16 rate), the time
the case's target asks for, and how much its format
can gain over its bf16 twin at best. Where a ``gpu_check`` run has measured the
case, its kernel time and the fraction of the roofline it reached sit beside the
prediction; everything else in the sheet is modelled, and says so.

Targets (per H200, measured by ``gpu_check``):

- fp8 MLA decode, context >= 8K and batch >= 8: at least 80% of the copy bandwidth;
- INT4 dense matmul, M <= 16: at least 3x XLA's bf16 dot;
- INT4 grouped (MoE) matmul at decode rows (M <= 64): at least 2.5x XLA's bf16
  ragged dot.

The "bf16 twin" column is the twin's roofline over the case's: the most the
narrower format can gain when both are memory-bound at the same efficiency. An
INT4 target above it cannot be met by speed alone (it needs the bf16 path to fall
short of its own roofline).

The sheet is arithmetic on the kernels' own cost models and block-size tables, so
it lives beside them; the ``kernels`` experiment writes it into its report (with a
plot) and joins the times ``gpu_check`` measured.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import benchmark as bm
from pallas_kernels import tables
from pallas_kernels import targets as kt
from pallas_kernels.fp8_matmul import bench as fp8_bench
from pallas_kernels.indexer import bench as indexer_bench
from pallas_kernels.indexer import topk_bench
from pallas_kernels.int4_matmul import bench as int4_bench
from pallas_kernels.paged_attention import bench as attn_bench
from pallas_kernels.tag_check import bench as tag_bench

H200 = "NVIDIA H200"  # the device kind the block-size tables are read for
MLA_BW_TARGET = 0.8  # fraction of the copy bandwidth
INT4_DENSE_TARGET = 3.0  # x XLA's bf16 dot, M <= 16
INT4_GROUPED_TARGET = 2.5  # x XLA's bf16 ragged dot, decode rows


def job_cost(case: kt.KernelCase) -> tuple[int, int]:
  """(bytes, FLOPs) of one call of ``case``'s job (the bench module's ``job_cost``)."""
  if case.kernel in attn_bench.KERNELS:
    return attn_bench.job_cost(case.kernel, case.d)
  if case.kernel in int4_bench.KERNELS:
    return int4_bench.job_cost(case.kernel, case.d)
  if case.kernel == "tag_check":
    return tag_bench.job_cost(case.d)
  if case.kernel == "paged_index_scores":
    return indexer_bench.job_cost(case.d)
  if case.kernel == "topk_positions":
    return topk_bench.job_cost(case.d)
  if case.kernel == "fp8_grouped_matmul":
    return fp8_bench.job_cost(case.d)
  raise ValueError(f"unknown kernel {case.kernel!r}; known: {kt.KERNELS}")


def _grouped_expert_tiles(m: int, e: int, tile_m: int) -> int:
  """Tiles the grouped kernels' schedule (INT4 and FP8 share it) gives the bench's
  balanced rows."""
  import numpy as np
  from pallas_kernels.int4_matmul.int4_matmul import segment_tiles
  rows = np.asarray(int4_bench.balanced_group_sizes(m, e))
  ends = np.cumsum(rows)
  return int(np.sum(segment_tiles(ends - rows, ends, tile_m)))


def _mla_tokens_in_m(d: dict) -> bool:
  """Whether the engine runs the tokens-in-M MLA kernel (``mla_tokens_mgpu``) for
  these dims on an H200, rather than the heads-in-M one."""
  from pallas_kernels.paged_attention import BlockSizes as AttnBlockSizes
  from pallas_kernels.paged_attention import ops as attn_ops
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
  return attn_ops.mla_tokens_in_m(AttnBlockSizes(), spec(d["batch"], d["heads"], d["c"]),
                                  spec(1, d["page_size"], d["c"]),
                                  spec(1, d["page_size"], d["r"]))


def design_flops(case: kt.KernelCase) -> int:
  """MMA FLOPs the engine's kernel executes for ``case`` on an H200, padding included.

  The job's FLOPs (``job_cost``) count only the real rows; the kernels pad them to
  their MMA tiles, which at decode can make a kernel MMA-bound where the job is not:
  - MLA decode (Mosaic GPU): query heads padded to 8 (wgmma's N, the tokens-in-M
    kernel at most 32 heads) or to 64 per CTA (wgmma's M, the heads-in-M kernel),
    QK over latent + rope and PV over the latent for every cached token;
  - GQA decode (Mosaic GPU): each KV head's group padded to 64 rows;
  - sparse MLA decode (Triton): heads padded to the program's block_h, over the
    selected positions;
  - INT4 dense: tokens padded to tile_m (the [N, K] kernels' table, which the
    engine runs on a GPU); INT4 and FP8 grouped: every tile computes tile_m
    token columns (tiles from the kernel's schedule over the bench's balanced rows);
  - the others (indexer, top-k, tag check): the job's FLOPs.
  """
  d = case.d
  if case.kernel == "paged_mla_decode":
    pad = 8 if _mla_tokens_in_m(d) else 64
    rows = -(-d["heads"] // pad) * pad
    return d["batch"] * d["context"] * rows * 2 * (2 * d["c"] + d["r"])
  if case.kernel == "paged_gqa_decode":
    return d["batch"] * d["context"] * d["kv_heads"] * 64 * 2 * 2 * d["head_dim"]
  if case.kernel == "paged_mla_sparse_decode":
    from pallas_kernels.paged_attention.block_sizes import SparseBlockSizes
    bh = SparseBlockSizes.get_default(num_heads=d["heads"], num_indices=d["topk"],
                                      batch=d["batch"], device_kind=H200).block_h
    rows = -(-d["heads"] // bh) * bh
    return d["batch"] * d["topk"] * rows * 2 * (2 * d["c"] + d["r"])
  if case.kernel in int4_bench.KERNELS:
    from pallas_kernels.int4_matmul import BlockSizes
    m, k, n = d["m"], d["k"], d["n"]
    grouped = case.kernel == "int4_grouped_matmul"
    e = d.get("experts", 1)
    bs = BlockSizes.get_default(m, n, k, grouped=grouped, experts=e, device_kind=H200,
                                layout="nk", group_size=d["group_size"]).fit(m, n, k)
    if not grouped:
      return 2 * (-(-m // bs.tile_m) * bs.tile_m) * k * n
    return 2 * _grouped_expert_tiles(m, e, bs.tile_m) * bs.tile_m * k * n
  if case.kernel == "fp8_grouped_matmul":
    from pallas_kernels.fp8_matmul import grouped_block_sizes
    m, k, n, e = d["m"], d["k"], d["n"], d["experts"]
    tile_m = grouped_block_sizes(m, n, k, e, device_kind=H200).tile_m
    return 2 * _grouped_expert_tiles(m, e, tile_m) * tile_m * k * n
  return job_cost(case)[1]


def design_fp8_flops(case: kt.KernelCase) -> int:
  """Of ``design_flops``, those the engine's kernel runs as fp8 wgmmas (twice the
  bf16 rate): the QK product of the heads-in-M MLA kernel on an fp8 cache
  (``ops.mla_qk_fp8``); 0 elsewhere."""
  d = case.d
  if case.kernel != "paged_mla_decode" or d["kv"] != "fp8" or _mla_tokens_in_m(d):
    return 0
  from pallas_kernels.paged_attention import BlockSizes as AttnBlockSizes
  from pallas_kernels.paged_attention import ops as attn_ops
  pages = jax.ShapeDtypeStruct((1, d["page_size"], d["c"]), jnp.float8_e4m3fn)
  if not attn_ops.mla_qk_fp8(AttnBlockSizes(), False, pages):
    return 0
  # QK's share of design_flops (its padding included): C + R of the 2C + R columns.
  return design_flops(case) * (d["c"] + d["r"]) // (2 * d["c"] + d["r"])


def design_mma_s(case: kt.KernelCase) -> float:
  """The MMA time of the engine's kernel: ``design_flops`` at the bf16 rate, but
  ``design_fp8_flops`` of them at the fp8 rate."""
  f8 = design_fp8_flops(case)
  return (design_flops(case) - f8) / bm.H200_BF16_FLOPS + f8 / bm.H200_FP8_FLOPS


def design_bytes(case: kt.KernelCase) -> int:
  """Bytes the engine's kernel moves for ``case`` on an H200: the job's, plus the
  partials of the Mosaic GPU decode kernels' pieces, which each piece (CTA) writes
  and the merge (``merge_pieces_mgpu``) reads back:
  - MLA decode: [H, C] bf16 outputs (the real heads' rows, rounded up to 8) and
    f32 log-sum-exps (the heads rounded up to 8 in the tokens-in-M kernel, 64 per
    64-head block in the heads-in-M one), for each of ``ops.mla_mgpu_pieces``
    pieces;
  - GQA decode: [64, hd] f32 outputs and 64 log-sum-exps per KV head (the group padded
    to 64 rows), for each of ``ops.gqa_mgpu_pieces`` pieces;
  - INT4 dense with K splits: the kernel's f32 [k_splits, N, M padded to tile_m]
    partials, written and read back by the sum that casts them (the [N, K] kernels'
    table: at 64 tokens and 4 splits they outweigh the int4 weights);
  - the others: the job's bytes.
  """
  import numpy as np
  from pallas_kernels.paged_attention import gqa_mgpu
  from pallas_kernels.paged_attention import mla_mgpu
  from pallas_kernels.paged_attention import ops as attn_ops
  nbytes = job_cost(case)[0]
  d = case.d
  if case.kernel == "paged_mla_decode":
    g = attn_ops.mla_mgpu_pieces(d["batch"], d["heads"], d["max_pages"], kind=H200)
    rows = mla_mgpu.partial_rows(d["heads"])
    blocks = -(-d["heads"] // mla_mgpu.BLOCK_H)
    lse_rows = rows if _mla_tokens_in_m(d) else blocks * mla_mgpu.BLOCK_H
    out_item = np.dtype(mla_mgpu.PARTIAL_DTYPE).itemsize
    return nbytes + 2 * g * (rows * d["c"] * out_item + lse_rows * 4)
  if case.kernel == "paged_gqa_decode":
    blocks = -(-d["max_pages"] * d["page_size"] // gqa_mgpu.BLOCK_K)
    g = attn_ops.gqa_mgpu_pieces(d["batch"], d["kv_heads"], blocks, kind=H200)
    return nbytes + 2 * g * d["kv_heads"] * gqa_mgpu.BLOCK_H * (d["head_dim"] + 1) * 4
  if case.kernel == "int4_matmul":
    from pallas_kernels.int4_matmul import BlockSizes
    m, n, k = d["m"], d["n"], d["k"]
    bs = BlockSizes.get_default(m, n, k, device_kind=H200, layout="nk",
                                group_size=d["group_size"]).fit(m, n, k)
    if bs.k_splits > 1:  # one split writes the result itself
      return nbytes + 2 * bs.k_splits * n * (-(-m // bs.tile_m) * bs.tile_m) * 4
  return nbytes


def twin_cost(case: kt.KernelCase) -> tuple[int, int] | None:
  """(bytes, FLOPs) of the same job in bf16: bf16 pages (or index keys) for an fp8
  attention or indexer case, dequantised bf16 weights for an INT4 or FP8 one; None where
  there is no narrower format."""
  d = case.d
  if case.kernel in attn_bench.KERNELS:
    if d["kv"] != "fp8":
      return None
    return attn_bench.job_cost(case.kernel, d | {"kv": "bf16"})
  if case.kernel == "paged_index_scores":
    return indexer_bench.job_cost(d | {"kv": "bf16"}) if d["kv"] == "fp8" else None
  if case.kernel in int4_bench.KERNELS:
    return int4_bench.job_cost(case.kernel, d, weights="bf16")
  if case.kernel == "fp8_grouped_matmul":
    return fp8_bench.job_cost(d, weights="bf16")
  return None


def target(case: kt.KernelCase) -> tuple[str, float | None]:
  """(the case's target in words, the time in seconds it allows where the sheet can
  model it; None where it depends on a measured peer)."""
  d = case.d
  if case.kernel == "paged_mla_decode" and d["kv"] == "fp8" and d["context"] >= 8192 \
      and d["batch"] >= 8:
    nbytes, _ = job_cost(case)
    return f">= {MLA_BW_TARGET:.0%} of copy BW", nbytes / (MLA_BW_TARGET * bm.H200_COPY_BW)
  if case.kernel == "int4_matmul" and d["m"] <= 16:
    return f">= {INT4_DENSE_TARGET:g}x XLA bf16 dot", None
  if case.kernel == "int4_grouped_matmul" and d["m"] <= 64:
    return f">= {INT4_GROUPED_TARGET:g}x XLA bf16 ragged dot", None
  return "-", None


def rows(cases: list[kt.KernelCase] | None = None,
         measured: dict[str, dict] | None = None) -> list[dict]:
  """One sheet row per target case.

  Args:
    cases: the cases (default: every target case).
    measured: gpu_check case records by case name (``status`` "ok" ones count).

  Returns:
    Dicts with kernel, case, model, bytes, flops, intensity (FLOP/B), bound,
    roofline_s, design_bytes (``design_bytes``), design_flops (``design_flops``),
    design_fp8_flops (``design_fp8_flops``), design_s (max(design bytes / copy
    BW, ``design_mma_s``): the design's predicted time), design_bound, target,
    target_s, twin_gain (bf16 twin's roofline / the case's), time_s and
    roofline_fraction (None where not measured).
  """
  cases = kt.target_cases() if cases is None else cases
  measured = measured or {}
  out = []
  for c in cases:
    nbytes, flops = job_cost(c)
    floor = bm.roofline_s(nbytes, flops)
    twin = twin_cost(c)
    what, allowed = target(c)
    dflops = design_flops(c)
    dbytes = design_bytes(c)
    mma_s = design_mma_s(c)
    design = max(dbytes / bm.H200_COPY_BW, mma_s)
    rec = measured.get(c.name) or {}
    t = rec.get("time_s") if rec.get("status") == "ok" else None
    out.append({
        "kernel": c.kernel, "case": c.name, "model": c.model, "bytes": nbytes, "flops": flops,
        "intensity": flops / nbytes,
        "bound": "memory" if nbytes / bm.H200_COPY_BW >= flops / bm.H200_BF16_FLOPS
                 else "compute",
        "roofline_s": floor, "design_bytes": dbytes, "design_flops": dflops,
        "design_fp8_flops": design_fp8_flops(c), "design_s": design,
        "design_bound": "memory" if dbytes / bm.H200_COPY_BW >= mma_s else "MMA",
        "target": what, "target_s": allowed,
        "twin_gain": None if twin is None else bm.roofline_s(*twin) / floor,
        "time_s": t, "roofline_fraction": None if t is None else floor / t})
  return out


def _us(s):
  if s is None:
    return "-"
  us = s * 1e6
  return f"{us:.2f}" if us < 10 else (f"{us:,.1f}" if us < 1000 else f"{us:,.0f}")


def markdown(sheet: list[dict]) -> str:
  """The sheet as a markdown section: one table per kernel, then a summary."""
  measured = sum(r["time_s"] is not None for r in sheet)
  lines = ["## Roofline sheet (H200, per call)\n",
           f"{len(sheet)} target cases; {measured} measured on a GPU, the rest modelled. "
           f"Roofline = max(bytes / {bm.H200_COPY_BW / 1e12:.1f} TB/s, FLOPs / "
           f"{bm.H200_BF16_FLOPS / 1e12:.0f} TFLOP/s), the measured ceilings. 'target us' is "
           "the time the case's target allows where it is a bandwidth target; 'design us' is "
           "the same bound over the bytes and MMA FLOPs the engine's kernel moves and executes, "
           "its split partials and tile padding included, its fp8 MMAs (the heads-in-M MLA "
           f"kernel's QK on an fp8 cache) at {bm.H200_FP8_FLOPS / 1e12:.0f} TFLOP/s, twice the "
           "bf16 rate (modelled; gpu_check measures it as ceiling/matmul_fp8) "
           "(pallas_kernels.roofline.design_bytes, design_flops, design_mma_s); 'bf16 twin x' is "
           "the bf16 twin's roofline over this case's (the most the narrower format can gain "
           "when both run at the same efficiency).\n"]
  for kernel in dict.fromkeys(r["kernel"] for r in sheet):
    part = [r for r in sheet if r["kernel"] == kernel]
    lines.append(f"### {kernel}\n")
    lines.append(tables.markdown_table(
        ["case", "model", "MB", "GFLOP", "FLOP/B", "bound", "roofline us", "design MB",
         "design us",
         "design bound", "target", "target us", "bf16 twin x", "measured us", "of roofline"],
        [[r["case"], r["model"], f"{r['bytes'] / 1e6:,.2f}", f"{r['flops'] / 1e9:,.3f}",
          f"{r['intensity']:.1f}", r["bound"], _us(r["roofline_s"]),
          f"{r['design_bytes'] / 1e6:,.2f}", _us(r["design_s"]),
          r["design_bound"], r["target"],
          _us(r["target_s"]), "-" if r["twin_gain"] is None else f"{r['twin_gain']:.2f}",
          _us(r["time_s"]),
          "-" if r["roofline_fraction"] is None else f"{r['roofline_fraction']:.2f}"]
         for r in part]))
    lines.append("")
  lines += summary_lines(sheet)
  return "\n".join(lines)


def summary_lines(sheet: list[dict]) -> list[str]:
  """What the sheet says about the targets before any measurement."""
  out = ["### What the model says about the targets\n"]
  for kernel, need in (("int4_matmul", INT4_DENSE_TARGET), ("int4_grouped_matmul",
                                                            INT4_GROUPED_TARGET)):
    part = [r for r in sheet if r["kernel"] == kernel and r["target"] != "-"]
    if not part:
      continue
    gains = [r["twin_gain"] for r in part]
    short = [r["case"] for r in part if r["twin_gain"] < need]
    out.append(f"- {kernel}: the bf16 twin's roofline is {min(gains):.2f}-{max(gains):.2f}x "
               f"this kernel's at the target shapes, against a {need:g}x target"
               + (f"; below it at {len(short)} of {len(part)} ({', '.join(short[:3])}"
                  f"{' ...' if len(short) > 3 else ''}): there the target needs XLA's bf16 "
                  f"path to fall short of its own roofline." if short else
                  "; reaching it takes the kernel to at least "
                  f"{need / min(gains):.0%} of its roofline at the hardest shape if XLA's bf16 "
                  "path reaches its own."))
    # The design's time (split partials, tile padding) against the twin's roofline.
    design = {r["case"]: r["twin_gain"] * r["roofline_s"] / r["design_s"] for r in part}
    below = sorted((g, c) for c, g in design.items() if g < need)
    if below:
      slowest = max(r["design_s"] for r in part if r["case"] in {c for _, c in below})
      out.append(f"  By the design's time (its split partials and tile padding) the kernel "
                 f"gains {min(design.values()):.2f}-{max(design.values()):.2f}x over the twin's "
                 f"roofline, below the target at {len(below)} of {len(part)} "
                 f"({', '.join(sorted({c.split('/')[2] for _, c in below}))}); the slowest of "
                 f"those takes {slowest * 1e6:.2f} us at the design, under the few "
                 "microseconds a launch costs, so only a measurement can say how they compare.")
  mla = [r for r in sheet if r["kernel"] == "paged_mla_decode" and r["target_s"]]
  if mla:
    out.append(f"- paged_mla_decode, fp8: {len(mla)} cases with a bandwidth target, allowing "
               f"{_us(min(r['target_s'] for r in mla))}-{_us(max(r['target_s'] for r in mla))} us "
               "per call.")
    over = [r for r in mla if r["design_s"] > r["target_s"]]
    if not over:
      frac = [r["bytes"] / bm.H200_COPY_BW / r["design_s"] for r in mla]
      qk8 = [r for r in mla if r["design_fp8_flops"]]
      saved = [r for r in qk8 if r["design_flops"] / bm.H200_BF16_FLOPS > r["target_s"]]
      out.append(f"  The Mosaic GPU kernels' design meets it at all {len(mla)}, at "
                 f"{min(frac):.0%}-{max(frac):.0%} of the copy bandwidth"
                 + (f"; at {len(saved)} of them only through QK as fp8 MMA (twice the bf16 "
                    "rate; all MMAs at the bf16 rate would take longer than the target "
                    "allows)" if saved else "") + ".")
    if over:
      frac = [r["bytes"] / bm.H200_COPY_BW / r["design_s"] for r in over]
      mma = [r for r in over if r["design_bound"] == "MMA"]
      job_bound = [r for r in mma if r["bound"] == "compute"]
      partials = [r for r in over if r["design_bound"] == "memory"]
      ridge = bm.H200_BF16_FLOPS / bm.H200_COPY_BW
      out.append((f"  The Mosaic GPU kernel's design misses it at {len(over)} of them, reaching "
                 f"at most {min(frac):.0%}-{max(frac):.0%} of the copy bandwidth there. "
                 + (f"At {len(mma)} its MMA work takes longer than the target allows"
                    + (f"; at {len(job_bound)} of those the job itself is MMA-bound in bf16 "
                       f"({min(r['intensity'] for r in job_bound):.0f} FLOP per byte against "
                       f"the H200's {ridge:.0f}): only fp8 MMA (twice the bf16 rate) could "
                       "meet it" if job_bound else "")
                    + (f"; {'the other ' if job_bound else ''}{len(mma) - len(job_bound)} "
                       "are bound by the padding of their heads to wgmma's 64 rows (meeting it "
                       "there needs tokens in wgmma's M)" if len(job_bound) < len(mma) else "")
                    + ". " if mma else "")
                 + (f"At {len(partials)} the partials of its pieces, written and read "
                    f"back by the merge, add {min(r['design_bytes'] / r['bytes'] - 1 for r in partials):.0%}-"
                    f"{max(r['design_bytes'] / r['bytes'] - 1 for r in partials):.0%} to the "
                    "bytes (fewer, longer pieces or a merge inside the kernel would cut them)."
                    if partials else "")).rstrip())
  sparse = [r for r in sheet if r["kernel"] == "paged_mla_sparse_decode"]
  if sparse:
    # The dense job at the same shape reads every cached token instead of the selection.
    by_name = {c.name: c for c in kt.target_cases(("paged_mla_sparse_decode",))}
    gains = [bm.roofline_s(*attn_bench.job_cost("paged_mla_decode", by_name[r["case"]].d))
             / r["roofline_s"] for r in sparse if r["case"] in by_name]
    # The indexer's scoring at the same batch, context and dtype reads every cached key.
    index = {r["case"].removeprefix("indexer/"): r["roofline_s"] for r in sheet
             if r["kernel"] == "paged_index_scores"}
    ratios = [index[r["case"].split("/", 2)[2]] / r["roofline_s"] for r in sparse
              if r["case"].split("/", 2)[2] in index]
    if gains:
      out.append(f"- paged_mla_sparse_decode: the dense kernel's roofline at the same shape is "
                 f"{min(gains):.0f}-{max(gains):.0f}x this one's (the selected rows instead of "
                 "the whole context)"
                 + (f"; the indexer's scoring, which reads every cached index key, is "
                    f"{min(ratios):.1f}-{max(ratios):.0f}x the sparse kernel's at the same "
                    "batch, context and dtype: at these contexts the indexer, not the attention, "
                    "sets a sparse decode step's floor."
                    if ratios else "."))
  tag = [r for r in sheet if r["kernel"] == "tag_check"]
  if tag:
    out.append(f"- tag_check: {_us(min(r['roofline_s'] for r in tag))}-"
               f"{_us(max(r['roofline_s'] for r in tag))} us per step at the roofline; the "
               "target (< 0.3% of a decode step) is checked against the measured step.")
  return out + [""]
