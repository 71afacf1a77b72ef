"""Block sizes for paged decode attention: data, not code."""

import dataclasses

from pallas_kernels import device

# BlockSizes.merge's values; the first is the default.
MERGES = ("mgpu", "mgpu_serial", "triton", "xla")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of one paged decode-attention launch.

  Attributes:
    block_h: query heads per program (MLA: heads; GQA: heads of one KV group,
      padded up). At least 16, because a Triton/wgmma dot needs M >= 16.
    pages_per_block: pages gathered per inner-loop step (block_k = this *
      page_size tokens). Bigger steps amortise the loop overhead of small
      pages (GQA's 16-token pages).
    num_splits: split-K partitions of each sequence's pages. Each partition
      writes a partial (max, sum, acc) and a combine step merges them; more
      splits fill the GPU when the batch is small and contexts are long.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages.
    impl: "auto" (Mosaic GPU where the op supports the shape, else Triton),
      "mgpu" (Mosaic GPU, error if unsupported) or "triton".
    mla_m: what fills wgmma's M in the Mosaic GPU MLA kernel: "tokens"
      (``mla_tokens_mgpu``, at most 32 heads, 64-token pages), "heads"
      (``mla_mgpu``, heads padded to 64) or "auto" (tokens where that kernel
      takes the shape, else heads).
    mla_qk: the QK product of the heads-in-M Mosaic GPU MLA kernel on an fp8
      cache: "f16" (pages converted to f16, query f16: exact products), "fp8"
      (fp8 wgmmas on the staged pages with an e4m3 query, per-row scale:
      twice the MMA rate, the query rounded to 4 significant bits) or "auto"
      (fp8 there, where the bf16-rate MMA binds; docs/paged_attention.md).
      Other kernels and caches compute as "f16".
    loads: who issues the query and page gathers of the Mosaic GPU MLA
      kernels: "producer" (a memory warpgroup that does nothing else: a third
      beside the heads-in-M kernel's two compute warpgroups, setmaxnreg moving
      its registers to them; a second beside the tokens-in-M kernel's one) or
      "compute" (a compute warpgroup, between its MMAs; the earlier schedule,
      kept to compare against and to ablate). The GQA and Triton kernels
      issue their own and ignore it.
    gqa_loads: the same for the Mosaic GPU GQA kernel: "compute" (the default:
      two CTAs of one warpgroup per SM, two staging slots each) or "producer"
      (one CTA per SM of a compute and a producer warpgroup, four slots; a
      producer costs the second CTA per SM, docs/paged_attention.md, so it
      waits for a GPU to time the two).
    merge: how the Mosaic GPU kernels' pieces are merged into each request's
      output: "mgpu" (the default: ``merge_pieces_mgpu``, a Mosaic GPU kernel
      reading every partial once, launched as a programmatic dependent of the
      decode kernel so that it overlaps its tail), "mgpu_serial" (the same
      kernel launched as an ordinary one, to time the overlap), "triton"
      (``merge_pieces``, the same merge on Pallas' Triton backend) or "xla"
      (``reference.combine_pieces``, XLA's one-hot product); the last three are
      kept to compare against and to ablate.
  """

  block_h: int = 16
  pages_per_block: int = 1
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2
  impl: str = "auto"
  mla_m: str = "auto"
  mla_qk: str = "auto"
  merge: str = "mgpu"
  loads: str = "producer"
  gqa_loads: str = "compute"

  def __post_init__(self):
    if self.gqa_loads not in ("compute", "producer"):
      raise ValueError(f"gqa_loads must be compute or producer, got {self.gqa_loads!r}")
    if self.loads not in ("compute", "producer"):
      raise ValueError(f"loads must be compute or producer, got {self.loads!r}")
    if self.merge not in MERGES:
      raise ValueError(f"merge must be one of {', '.join(MERGES)}; got {self.merge!r}")
    if self.mla_qk not in ("auto", "f16", "fp8"):
      raise ValueError(f"mla_qk must be auto, f16 or fp8, got {self.mla_qk!r}")
    if self.mla_m not in ("auto", "tokens", "heads"):
      raise ValueError(f"mla_m must be auto, tokens or heads, got {self.mla_m!r}")
    if self.block_h < 16 or self.block_h & (self.block_h - 1):
      raise ValueError(f"block_h must be a power of two >= 16, got {self.block_h}")
    if self.pages_per_block < 1 or self.pages_per_block & (self.pages_per_block - 1):
      raise ValueError(f"pages_per_block must be a power of two, got {self.pages_per_block}")
    if self.impl not in ("auto", "mgpu", "triton"):
      raise ValueError(f"impl must be auto, mgpu or triton, got {self.impl!r}")
    if self.num_splits < 1:
      raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")

  @classmethod
  def get_default(cls, kind: str, *, num_heads: int, page_size: int,
                  max_pages: int, batch: int,
                  device_kind: str | None = None) -> "BlockSizes":
    """Default block sizes for ``kind`` in {"mla", "gqa"} and this shape.

    The per-program tiles (block_h cap, warps, stages) come from TILES by
    device kind; pages_per_block makes ~64 tokens per step; the split count
    is a heuristic: enough splits that batch * head blocks * splits covers the
    SMs twice, each split keeping >= 4 steps.

    Args:
      kind: "mla" or "gqa".
      num_heads: query heads per program group (MLA: all heads; GQA: the group).
      page_size: tokens per page.
      max_pages: block-table width P.
      batch: programs along the batch axis (GQA: requests * KV heads).
      device_kind: the target device; None reads it from the active abstract
        mesh (an AOT compile for a GPU topology) or jax.devices().

    Raises:
      ValueError: for an unknown kind.
    """
    if kind not in ("mla", "gqa"):
      raise ValueError(f"kind must be mla or gqa, got {kind!r}")
    if device_kind is None:
      device_kind = device.device_kind()
    tiles = TILES.get((device_kind, kind)) or TILES[("default", kind)]
    block_h = max(16, min(tiles.block_h, next_pow2(num_heads)))
    ppb = min(max(1, 64 // page_size), next_pow2(max_pages))
    head_blocks = -(-num_heads // block_h)
    splits = _num_splits(batch * head_blocks, -(-max_pages // ppb), min_steps=4)
    return cls(block_h=block_h, pages_per_block=ppb, num_splits=splits,
               num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _num_splits(programs: int, steps: int, *, min_steps: int) -> int:
  """Split-K count: double while the programs cover fewer than 2 waves of the
  132 SMs of an H100/H200 and each split keeps >= min_steps steps."""
  splits = 1
  while programs * splits < 264 and steps // (splits * 2) >= min_steps:
    splits *= 2
  return splits


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Per-program tiling of the Triton kernels for one device kind and op kind.

  Attributes:
    block_h: the most heads one program takes (fewer when the op has fewer).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages.
  """

  block_h: int
  num_warps: int
  num_stages: int


# Keyed by (device kind, "mla" | "gqa"); "default" serves every other device.
# Only the Triton kernels read these: the Mosaic GPU kernels (mla_mgpu,
# gqa_mgpu, the engine's choice at every target shape) fix their own tiles.
# Readings are ptxas 13.0 for sm_90a (registers per thread / spilled bytes;
# tests/test_h200_compile_attention.py, docs/h200_compile.md), 64-token
# pages, latent 512 + rope 64, 4 splits, batch 8, 32K context:
#   MLA bf16, block_h 16: 4 warps 255 regs + 48 B spills; 8 warps 218 regs.
#   MLA bf16, block_h 32: 4 warps 255 + 664 B; 8 warps 243 (240 with the 64-bit
#     addressing of a > 4 GiB pool).
#   MLA bf16, block_h 64: 4 warps 255 + 4.5 KB; 8 warps 255 + 404 B.
#   MLA fp8, 8 warps: block_h 16 135 regs, block_h 32 178 regs.
#   MLA with 1 stage instead of 2: no fewer registers (bf16 block_h 16: 222).
# So MLA takes 8 warps and at most 32 heads per program (each latent page is
# read once per 32 heads; 64 cannot be held). GQA (head_dim 128, 16-token pages,
# 4 pages per step, groups padded to 16 rows) reads 124 (bf16) / 128 (fp8)
# registers with 4 warps, no spills. The default row follows the H200's: H100s
# are the same sm_90 and other GPUs take the Triton path with no better data.
TILES: dict[tuple[str, str], Tiles] = {
    ("NVIDIA H200", "mla"): Tiles(block_h=32, num_warps=8, num_stages=2),
    ("NVIDIA H200", "gqa"): Tiles(block_h=16, num_warps=4, num_stages=2),
    ("default", "mla"): Tiles(block_h=32, num_warps=8, num_stages=2),
    ("default", "gqa"): Tiles(block_h=16, num_warps=4, num_stages=2),
}


@dataclasses.dataclass(frozen=True)
class SparseBlockSizes:
  """Tiling of one sparse paged MLA decode launch (ops.paged_mla_sparse_decode).

  Attributes:
    block_h: query heads per program, a power of two >= 16 (dot M >= 16).
    block_k: selected token rows gathered per inner-loop step, a power of two
      >= 16 (Triton tensors are powers of two; it is the dot's N and K).
    num_splits: split-K partitions of each request's K selected indices,
      merged afterwards as in the dense kernel.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages.
  """

  block_h: int = 32
  block_k: int = 32
  num_splits: int = 1
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_h", "block_k"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if self.num_splits < 1:
      raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")

  @classmethod
  def get_default(cls, *, num_heads: int, num_indices: int, batch: int,
                  device_kind: str | None = None) -> "SparseBlockSizes":
    """Default tiling: the dense MLA kernel's heads, warps and stages (TILES
    "mla") with 32-row steps, and splits until batch * head blocks * splits
    covers the 132 SMs twice, each split keeping >= 2 steps.

    Why 32 rows and not the dense kernel's 64-token page: ptxas 13.0 for
    sm_90a (C 512, R 64, 32 heads, 8 warps) reads 186 registers, no spills,
    for a bf16 cache at 32 rows, but 255 (the cap, zero spills, no margin) at
    64; fp8 reads 182 / 190. 64 heads spill at either dtype
    (docs/sparse_attention.md).

    Args:
      num_heads: query heads.
      num_indices: K, the selected positions per request.
      batch: requests.
      device_kind: the target device (None: the active abstract mesh's GPU,
        else jax.devices()).
    """
    if device_kind is None:
      device_kind = device.device_kind()
    tiles = TILES.get((device_kind, "mla")) or TILES[("default", "mla")]
    block_h = max(16, min(tiles.block_h, next_pow2(num_heads)))
    block_k = 32
    splits = _num_splits(batch * -(-num_heads // block_h), -(-num_indices // block_k),
                         min_steps=2)
    return cls(block_h=block_h, block_k=block_k, num_splits=splits,
               num_warps=tiles.num_warps, num_stages=tiles.num_stages)
