"""Public tag-check op: one launch for the whole batch, no host round trip."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dispatch
from pallas_kernels.tag_check import kernel as kernel_lib
from pallas_kernels.tag_check.reference import tag_check_reference


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the tag check.

  Attributes:
    block_b: requests per program (power of two). The whole check is a few
      KB, so one or a few programs suffice; larger tiles mean fewer launches'
      worth of programs but more registers.
    num_warps: Triton warps per program.
  """

  block_b: int = 16
  num_warps: int = 4

  def __post_init__(self):
    if self.block_b < 1 or self.block_b & (self.block_b - 1):
      raise ValueError(f"block_b must be a power of two, got {self.block_b}")

  @classmethod
  def get_default(cls, batch: int, max_pages: int) -> "BlockSizes":
    """Keeps block_b * P_pad around 4K elements per program."""
    p = 1 << max(0, (max_pages - 1).bit_length())
    bb = 1
    while bb < batch and bb * 2 * p <= 4096:
      bb *= 2
    return cls(block_b=bb)


@functools.partial(jax.jit, static_argnames=("page_size", "backend", "block_sizes"))
def tag_check(page_tags, block_tables, expected_tags, lengths, *, page_size,
              backend=None, block_sizes=None):
  """Per-request page-integrity check: do the used pages still carry our tags?

  Request b is ok iff page_tags[block_tables[b, i]] == expected_tags[b, i]
  for every i < ceil(lengths[b] / page_size); a used id outside the pool
  fails. Entries past that are ignored (stale ids or tags, or PAD_PAGE = -1).
  One kernel launch for the whole batch; the result stays on device so the
  attention launch follows without a host round trip.

  Args:
    page_tags: [N] int32 current tag of each physical page.
    block_tables: [B, P] int32 page ids.
    expected_tags: [B, P] int32 tags recorded when the pages were allocated.
    lengths: [B] int32 tokens in use per request (0 <= lengths[b] <= P * page_size).
    page_size: tokens per page.
    backend: "pallas" | "interpret" | "xla" | None (pallas on GPU, else xla).
    block_sizes: BlockSizes, or None for BlockSizes.get_default.

  Returns:
    [B] bool, True where every used page's tag matches.

  Raises:
    ValueError: on inconsistent shapes or an unknown backend.
  """
  backend = dispatch.resolve_backend(backend)
  b, p = block_tables.shape
  if expected_tags.shape != (b, p) or lengths.shape != (b,) or page_tags.ndim != 1:
    raise ValueError(f"shape mismatch: page_tags {page_tags.shape}, block_tables "
                     f"{block_tables.shape}, expected_tags {expected_tags.shape}, "
                     f"lengths {lengths.shape}")
  if backend == "xla":
    return tag_check_reference(page_tags, block_tables, expected_tags, lengths,
                               page_size=page_size)
  bs = block_sizes or BlockSizes.get_default(b, p)
  bb = bs.block_b
  p_pad = (1 << max(0, (p - 1).bit_length())) - p  # Triton tiles are powers of two.
  b_pad = -b % bb
  pad2 = ((0, b_pad), (0, p_pad))
  bt = jnp.pad(block_tables.astype(jnp.int32), pad2)
  et = jnp.pad(expected_tags.astype(jnp.int32), pad2)
  ln = jnp.pad(lengths.astype(jnp.int32), (0, b_pad))  # padded rows: 0 pages, ok
  pp = p + p_pad
  ok = pl.pallas_call(
      functools.partial(kernel_lib.tag_check_kernel, page_size=page_size),
      grid=((b + b_pad) // bb,),
      in_specs=[
          pl.BlockSpec(page_tags.shape, lambda i: (0,)),
          pl.BlockSpec((bb, pp), lambda i: (i, 0)),
          pl.BlockSpec((bb, pp), lambda i: (i, 0)),
          pl.BlockSpec((bb,), lambda i: (i,)),
      ],
      out_specs=pl.BlockSpec((bb,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct((b + b_pad,), jnp.int32),
      compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps),
      interpret=backend == "interpret",
      name="tag_check",
  )(page_tags.astype(jnp.int32), bt, et, ln)
  return ok[:b] == 1
