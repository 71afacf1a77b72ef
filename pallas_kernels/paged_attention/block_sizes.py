"""Block sizes for paged decode attention: data, not code."""

import dataclasses

from pallas_kernels import device


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
  """

  block_h: int = 16
  pages_per_block: int = 1
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2
  impl: str = "auto"

  def __post_init__(self):
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

    Looks up the tuned table by (device kind, op kind, shape class) and falls
    back to a heuristic: enough splits that batch * heads-blocks * splits
    covers the SMs, tokens per step ~64.

    Args:
      kind: "mla" or "gqa".
      num_heads: query heads per program group (MLA: all heads; GQA: the group).
      page_size: tokens per page.
      max_pages: block-table width P.
      batch: programs along the batch axis (GQA: requests * KV heads).
      device_kind: the target device; None reads it from the active abstract
        mesh (an AOT compile for a GPU topology) or jax.devices().
    """
    if device_kind is None:
      device_kind = device.device_kind()
    shape_class = "long" if max_pages * page_size >= 8192 else "short"
    tuned = _TUNED.get((device_kind, kind, shape_class))
    block_h = 64 if kind == "mla" else 16
    block_h = max(16, min(block_h, _next_pow2(num_heads)))
    ppb = max(1, 64 // page_size)
    ppb = min(ppb, _next_pow2(max_pages))
    if tuned is not None:
      return dataclasses.replace(tuned, block_h=min(tuned.block_h, block_h))
    head_blocks = -(-num_heads // block_h)
    programs = batch * head_blocks
    steps = -(-max_pages // ppb)
    splits = 1
    # 132 SMs on H100/H200; split until ~2 waves, each split >= 4 steps.
    while programs * splits < 264 and steps // (splits * 2) >= 4:
      splits *= 2
    return cls(block_h=block_h, pages_per_block=ppb, num_splits=splits)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


# Tuned values keyed by (device kind, op kind, shape class). Empty until the
# H200 check (scripts/gpu_check.py) has been run on a device; the heuristic in
# get_default applies meanwhile.
_TUNED: dict[tuple[str, str, str], BlockSizes] = {}
