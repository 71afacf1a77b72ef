"""Block sizes for the INT4 matmul kernels: a frozen dataclass plus a tuned table."""

import dataclasses

from pallas_kernels import device
from pallas_kernels.int4_matmul import tile_model

# Token counts at or below this are "decode" (weight streaming, memory-bound);
# above it "prefill" (compute-bound). The kernels swap operands, so tokens sit
# in wgmma's N dimension, which goes up to 256.
DECODE_MAX_M = 64
# The grouped kernel's tiles never mix experts, so its shape class and tile_m
# follow the mean rows per expert (M / E), not M: tile_m is twice the mean
# (rounded up to 8, capped by the table) so that a ragged expert with more rows
# than the mean still fits one tile and streams its weights once. Means up to
# this many rows use the decode table.
GROUPED_DECODE_MAX_ROWS = 8
# Dynamic shared memory per CTA on Hopper (H100/H200), less a little slack for
# the pipeline's barriers.
H200_SMEM_BYTES = 227 * 1024 - 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the INT4 kernels (operands swapped: out^T = W^T @ x^T).

  Attributes:
    tile_n: weight columns per CTA; wgmma's M dimension, so a multiple of 64.
    tile_m: tokens per CTA; wgmma's N dimension, a multiple of 8 and <= 256.
    tile_k: K rows per pipeline step; a multiple of 128 (64 packed rows, one
      WGMMA-layout register tile) and of group_size.
    k_splits: dense only (the grouped kernel ignores it); K is split over
      this many CTAs whose f32 partials are summed outside the kernel, so a
      decode matmul with few N tiles still fills the 132 SMs of an H200.
    max_concurrent_steps: pipeline depth (TMA buffers in flight).
    max_ctas: grouped only; the persistent grid's CTAs, 0 for as many as fit
      the device at once (SMs x CTAs per SM by shared memory).
    overlap_dequant: dequantise step i+1 while step i's wgmmas run (two
      dequantisation slots, x buffers released a step late; needs at least
      two K steps and max_concurrent_steps >= 2, else it is ignored). Off in
      the tuned table until timed on a GPU: it doubles the dequantisation
      scratch, which can halve the CTAs per SM.
  """

  tile_n: int = 128
  tile_m: int = 8
  tile_k: int = 128
  k_splits: int = 1
  max_concurrent_steps: int = 2
  max_ctas: int = 0
  overlap_dequant: bool = False

  def __post_init__(self):
    if self.tile_n % 64 or self.tile_n <= 0:
      raise ValueError(f"tile_n={self.tile_n} must be a positive multiple of 64")
    if self.tile_m % 8 or not 8 <= self.tile_m <= 256:
      raise ValueError(f"tile_m={self.tile_m} must be a multiple of 8 in [8, 256]")
    if self.tile_k % 128 or self.tile_k <= 0:
      raise ValueError(f"tile_k={self.tile_k} must be a positive multiple of 128")
    if self.k_splits < 1:
      raise ValueError(f"k_splits={self.k_splits} must be >= 1")
    if self.max_concurrent_steps < 1:
      raise ValueError("max_concurrent_steps must be >= 1")
    if self.max_ctas < 0:
      raise ValueError(f"max_ctas={self.max_ctas} must be >= 0 (0: fill the device)")

  def smem_bytes(self, group_size: int = 32, scale_bytes: int = 4,
                 grouped: bool = False, layout: str = "kn") -> int:
    """Shared memory one CTA needs (pipeline buffers + scratches), in bytes.

    layout "kn" is the [K/2, N] uint8 kernel (a bf16 dequantisation scratch),
    "nk" the [N, K] int4 one (converted in registers, no scratch; at least two
    pipeline buffers, since x is released a step late). Lowering for an
    abstract H200 does not check this, so the tuned table is checked against
    H200_SMEM_BYTES in the tests instead.
    """
    per_step = (self.tile_m * self.tile_k * 2  # x (even + odd columns for "kn"), bf16
                + self.tile_k // 2 * self.tile_n  # packed weights, two per byte
                + self.tile_k // group_size * self.tile_n * scale_bytes)
    # The output tile: bf16 rows (grouped, and dense with one K split: the result
    # itself), or the dense kernel's f32 split partials.
    out = self.tile_n * self.tile_m * (2 if grouped or self.k_splits == 1 else 4)
    if layout == "nk":
      return max(2, self.max_concurrent_steps) * per_step + out
    dequant = self.tile_k * self.tile_n * 2 * (2 if self.overlap_dequant else 1)  # bf16
    return self.max_concurrent_steps * per_step + dequant + out

  @classmethod
  def get_default(cls, m: int, n: int, k: int, *, grouped: bool = False,
                  experts: int = 1, device_kind: str | None = None,
                  layout: str = "kn", group_size: int | None = None) -> "BlockSizes":
    """Tuned block sizes for an [m, k] x [k, n] problem on `device_kind`.

    Looks the device kind and shape class up in `TUNED` (layout "kn", the packed
    [K/2, N] kernels) or `TUNED_NK` (layout "nk", the [N, K] int4 kernels; device
    kinds it lacks fall back to `TUNED`), then shrinks the tiles
    to fit the problem (tile_n divides n, tile_k divides k, k_splits divides the
    K steps, tile_m no larger than m rounded up to 8). The dense class is set by
    m; the grouped one by the mean rows per expert, m / experts, which also sets
    tile_m (GROUPED_DECODE_MAX_ROWS). ``device_kind`` None reads it from the
    active abstract mesh (an AOT compile for a GPU topology) or jax.devices().

    Dense decode on the [N, K] kernel with a TUNED_NK row takes the row's tiles
    and depth but its own K split count: the divisor of its K steps (at most
    ``tile_model.MAX_SPLITS``) with the least modelled time for this m, n, k
    (``tile_model.best_splits``, at NK_MODEL_REGISTERS registers and
    ``group_size``'s scale bytes, 32 when None).

    Raises:
      ValueError: if n is not a multiple of 64, k not a multiple of 128, or the
        layout unknown.
    """
    if layout not in ("kn", "nk"):
      raise ValueError(f"layout must be 'kn' or 'nk', got {layout!r}")
    if device_kind is None:
      device_kind = device.device_kind()
    if grouped:
      rows = -(-m // max(experts, 1))
      shape_class = "decode" if rows <= GROUPED_DECODE_MAX_ROWS else "prefill"
    else:
      shape_class = "decode" if m <= DECODE_MAX_M else "prefill"
    op = "grouped" if grouped else "dense"
    base = ((layout == "nk" and TUNED_NK.get((device_kind, op, shape_class)))
            or TUNED.get((device_kind, op, shape_class))
            or TUNED[("default", op, shape_class)])
    if grouped:
      base = dataclasses.replace(base, tile_m=min(base.tile_m, -(-2 * rows // 8) * 8))
    if (layout == "nk" and not grouped and shape_class == "decode"
        and (device_kind, op, shape_class) in TUNED_NK):
      return base.fit_splits_per_call(m, n, k, group_size=group_size or 32)
    return base.fit(m, n, k)

  def fit_splits_per_call(self, m: int, n: int, k: int, *, group_size: int) -> "BlockSizes":
    """These tiles and depth fitted to an [m, k] x [k, n] dense problem, with the K
    split count the time model gives least time for it (``tile_model.best_splits``
    at NK_MODEL_REGISTERS; this row's own k_splits is not used). What
    ``get_default`` returns for dense decode on the [N, K] kernel, and how
    ``tune.py`` ranks that class's candidates."""
    fitted = dataclasses.replace(self, k_splits=1).fit(m, n, k)
    splits = tile_model.best_splits(fitted, m=m, n=n, k=k, group_size=group_size,
                                    registers=NK_MODEL_REGISTERS)
    return dataclasses.replace(fitted, k_splits=splits)

  def fit(self, m: int, n: int, k: int) -> "BlockSizes":
    """Returns these block sizes shrunk to divide an [m, k] x [k, n] problem."""
    if n % 64:
      raise ValueError(f"N={n} must be a multiple of 64")
    if k % 128:
      raise ValueError(f"K={k} must be a multiple of 128")
    tile_n = self.tile_n
    while n % tile_n:
      tile_n -= 64
    tile_k = self.tile_k
    while k % tile_k:
      tile_k -= 128
    tile_m = min(self.tile_m, -(-m // 8) * 8)
    k_steps = k // tile_k
    k_splits = max(1, min(self.k_splits, k_steps))
    while k_steps % k_splits:
      k_splits -= 1
    return dataclasses.replace(self, tile_n=tile_n, tile_k=tile_k,
                               tile_m=tile_m, k_splits=k_splits)


# Keyed by (device kind, "dense" | "grouped", "decode" | "prefill").
# H200 values are first guesses from the roofline, not yet timed on a GPU, and
# checked against ptxas 13.0 for sm_90a (registers per thread, spilled bytes; bf16
# x and scales, groups 32 and 128; tests/test_h200_compile_*.py and
# docs/h200_compile.md). Decode streams weights and is limited by how fast one
# warpgroup dequantises (about 8 integer/float ops per weight), so the decode
# rows keep a CTA under half of the SM's shared memory (~91 KiB): two CTAs per SM
# then overlap one's dequantisation with the other's TMA and wgmma waits. Split K
# fills the SMs: expert up (7168 -> 2048) gives 16 N tiles x 8 splits = 128 CTAs,
# expert down (2048 -> 7168) 56 x 8 = 448. Prefill is compute-bound: wide token
# tiles so each dequantised weight tile feeds more MMA work.
# Readings behind the H200 rows:
#   dense decode (128, 8|16, 128, 8 splits, 4 deep): 89-197 registers over every
#     projection of Kimi K2.6 and GLM 5.2 (the K steps per split, 1-7, and so the
#     pipeline depth vary with K), no spills, at most 94,240 B of shared memory.
#   grouped decode (128, 8|16, 128, 1, 4), the persistent kernel writing rows in
#     place: 187-197 registers, no spills, 76,832-90,144 B (two CTAs per SM);
#     grouped prefill (64, 128): 159-161 registers, 107,536 B.
#   prefill, tile_n x tile_m = 128 x 128 (the first guess): 255 registers and
#     12-108 B of spills (dense g128, grouped g32 and g128); its [128, 128] f32
#     accumulator is 128 registers per thread and each 64-row dequantisation
#     chunk [64, tile_n] of int32 codes, nibbles and scales needs as many again.
#     128 x 64: dense 236-244, grouped 249-252 registers (too close to 255).
#     64 x 256: dense 216-218 registers but 222,224 B of shared memory.
#     64 x 128: dense 153-157 registers, 123,920 B (107,536 since the one-split
#     kernel writes a bf16 output tile): the same 128 tokens per
#     dequantised weight, half the registers.
TUNED: dict[tuple[str, str, str], BlockSizes] = {
    ("default", "dense", "decode"): BlockSizes(128, 8, 128, 1, 2),
    ("default", "dense", "prefill"): BlockSizes(128, 64, 128, 1, 2),
    ("default", "grouped", "decode"): BlockSizes(128, 8, 128, 1, 2),
    ("default", "grouped", "prefill"): BlockSizes(128, 64, 128, 1, 2),
    ("NVIDIA H200", "dense", "decode"): BlockSizes(128, 16, 128, 8, 4),
    ("NVIDIA H200", "dense", "prefill"): BlockSizes(64, 128, 128, 1, 2),
    ("NVIDIA H200", "grouped", "decode"): BlockSizes(128, 16, 128, 1, 4),
    ("NVIDIA H200", "grouped", "prefill"): BlockSizes(64, 128, 128, 1, 2),
}


# The [N, K] int4 kernels (layout "nk"), keyed like TUNED. Derived, not guessed:
# tune.py (`python -m experiments.int4_tune`) compiles every candidate tile shape for sm_90a
# (ptxas registers, spills, stack, serialised wgmmas), takes the CTAs per SM from
# registers and shared memory, models every target case's time under every
# candidate (tile shape x pipeline depth x K splits) and keeps, per class, the
# candidate with the smallest geometric mean of time / the case's best. The
# readings are committed (int4_nk_tiles_h200.json, beside this file) and
# tests/test_int4_tune.py checks that they still select these rows. Modelled, not
# timed: scripts/gpu_check.py times them beside the packed table's tiles
# ("pallas_nk" and "pallas_nk_kn_tiles"). docs/int4_matmul.md explains the model.
#   dense decode: 64 x 64 x 256, depth 4, its K split count chosen per call
#     (fit_splits_per_call, which is also how the candidates were ranked; the
#     row's own count, 1, is not used). tile_m 64 reads each weight once at 64
#     tokens (the packed table's 16 reads it four times); 64-wide N tiles and K
#     splits give the small projections enough CTAs.
#   grouped decode: 128 x 16 x 128, depth 4: the packed table's row (128
#     registers, three CTAs per SM by shared memory); tile_m 16 keeps the experts
#     a random router sends more than 8 rows to in one tile.
#   dense prefill: 128 x 64 x 128, depth 2 (128 registers, [128, 64] f32
#     accumulator); grouped prefill: 64 x 64 x 128, depth 2.
# The registers the split model assumes for the dense decode row: ptxas reads 95-128
# at every tile it resolves to (tile_m 8-64, groups 32 and 128; the committed
# readings), and at 128 each tile's CTAs per SM are what its real count gives
# (shared memory is the tighter limit); tests/test_int4_tune.py checks both.
NK_MODEL_REGISTERS = 128
TUNED_NK: dict[tuple[str, str, str], BlockSizes] = {
    ("NVIDIA H200", "dense", "decode"): BlockSizes(64, 64, 256, 1, 4),
    ("NVIDIA H200", "dense", "prefill"): BlockSizes(128, 64, 128, 1, 2),
    ("NVIDIA H200", "grouped", "decode"): BlockSizes(128, 16, 128, 1, 4),
    ("NVIDIA H200", "grouped", "prefill"): BlockSizes(64, 64, 128, 1, 2),
}
