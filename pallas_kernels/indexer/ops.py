"""Public indexer ops: paged index scores (kernel or reference) and the top-k after them."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dispatch
from pallas_kernels.indexer import kernel as kernel_lib
from pallas_kernels.indexer import reference
from pallas_kernels.indexer import topk as topk_lib
from pallas_kernels.paged_attention.block_sizes import next_pow2

FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class IndexerBlockSizes:
  """Tiling of one paged index-scoring launch.

  Attributes:
    block_k: token positions scored per program, a power of two >= 16 (the
      dot's N; Triton tensors are powers of two).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages.
  """

  # ptxas 13.0 for sm_90a at GLM 5's shape (32 heads of 128, 64-token pages):
  # 128 positions on 8 warps read 64 (bf16) / 70 (fp8) registers, no spills;
  # 256 on 4 warps reaches 213 (docs/sparse_attention.md).
  block_k: int = 128
  num_warps: int = 8
  num_stages: int = 2

  def __post_init__(self):
    if self.block_k < 16 or self.block_k & (self.block_k - 1):
      raise ValueError(f"block_k must be a power of two >= 16, got {self.block_k}")
    if self.num_warps < 1 or self.num_stages < 1:
      raise ValueError(f"num_warps and num_stages must be >= 1, got {self.num_warps}, "
                       f"{self.num_stages}")


def _check_inputs(q, weights, index_k, index_k_scale, block_tables, lengths):
  """ValueError unless the scoring inputs agree in shape and dtype."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hi, Di], got {q.shape}")
  b, hi, di = q.shape
  if weights.shape != (b, hi):
    raise ValueError(f"weights must be [B={b}, Hi={hi}], got {weights.shape}")
  if index_k.ndim != 3 or index_k.shape[2] != di:
    raise ValueError(f"index_k must be [N, page_size, Di={di}], got {index_k.shape}")
  if index_k.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(FP8), jnp.dtype(jnp.float32)):
    raise ValueError(f"index_k must be bf16, f32 or float8_e4m3fn, got {index_k.dtype}")
  if (index_k.dtype == FP8) != (index_k_scale is not None):
    raise ValueError("index_k_scale must be given exactly when index_k is fp8")
  if index_k_scale is not None and index_k_scale.shape != index_k.shape[:2]:
    raise ValueError(f"index_k_scale: expected shape {index_k.shape[:2]}, got "
                     f"{index_k_scale.shape}")
  if block_tables.ndim != 2 or block_tables.shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"block_tables {block_tables.shape} / lengths {lengths.shape} do not "
                     f"match batch {b}")


@functools.partial(jax.jit, static_argnames=("backend", "block_sizes"))
def paged_index_scores(q, weights, index_k, index_k_scale, block_tables, lengths, *,
                       backend=None, block_sizes=None):
  """Index scores of one decode query per request over its paged index keys.

  I[b, t] = sum_h weights[b, h] * relu(q[b, h] . k_t * Di^-1/2) over the first
  lengths[b] tokens, -inf past them (docs/sparse_attention.md). The Pallas
  kernel (kernel.index_scores_kernel, Triton backend) reads each cached key
  once per request: the memory-bound half of a sparse-attention decode step.

  Args:
    q: [B, Hi, Di] indexer queries (rope applied), bf16 or f32.
    weights: [B, Hi] f32 head weights.
    index_k: [N, page_size, Di] index-key pages, bf16, f32 or float8_e4m3fn.
    index_k_scale: [N, page_size] f32 per-token scales when fp8, else None.
    block_tables: [B, M] int32 page ids (PAD_PAGE = -1 past the used pages).
    lengths: [B] int32 cached tokens per request.
    backend: "pallas" | "interpret" | "xla" | None (pallas on GPU, else xla).
    block_sizes: IndexerBlockSizes, or None for the default.

  Returns:
    [B, M * page_size] f32.

  Raises:
    ValueError: on inconsistent shapes or dtypes, a Pallas launch whose Di is
      not a power of two >= 16, or an unknown backend.
  """
  backend = dispatch.resolve_backend(backend)
  _check_inputs(q, weights, index_k, index_k_scale, block_tables, lengths)
  if backend == "xla":
    return reference.paged_index_scores_reference(q, weights, index_k, index_k_scale,
                                                  block_tables, lengths)
  b, hi, di = q.shape
  n, ps, _ = index_k.shape
  m = block_tables.shape[1]
  if di < 16 or di & (di - 1):
    raise ValueError(f"the Pallas indexer kernel needs Di a power of two >= 16, got {di}")
  bs = block_sizes or IndexerBlockSizes()
  bk = bs.block_k
  # Heads pad to a power of two >= 16 (the dot's M) with zero weights.
  hp = max(16, next_pow2(hi))
  if hp != hi:
    q = jnp.pad(q, ((0, 0), (0, hp - hi), (0, 0)))
    weights = jnp.pad(weights, ((0, 0), (0, hp - hi)))
  s = m * ps
  blocks = -(-s // bk)
  rows = index_k.reshape(n * ps, di)  # a free reshape of the contiguous pool
  scale_rows = None if index_k_scale is None else index_k_scale.reshape(n * ps)
  flat_tables = block_tables.astype(jnp.int32).reshape(b * m)
  full = lambda x: None if x is None else pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
  kernel = functools.partial(kernel_lib.index_scores_kernel, page_size=ps, table_width=m,
                             block_k=bk)
  out = pl.pallas_call(
      kernel,
      grid=(b, blocks),
      in_specs=[
          pl.BlockSpec((None, hp, di), lambda i, j: (i, 0, 0)),
          pl.BlockSpec((None, hp), lambda i, j: (i, 0)),
          full(rows), full(scale_rows), full(flat_tables), full(lengths),
      ],
      out_specs=pl.BlockSpec((None, bk), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((b, blocks * bk), jnp.float32),
      compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps,
                                              num_stages=bs.num_stages),
      interpret=backend == "interpret",
      name="paged_index_scores",
  )(q, weights.astype(jnp.float32), rows, scale_rows, flat_tables, lengths.astype(jnp.int32))
  return out[:, :s]


@dataclasses.dataclass(frozen=True)
class TopkBlockSizes:
  """Tiling of the top-k kernel (one program per row).

  Attributes:
    block: positions per step of each pass over a row, a power of two >= 16.
    num_warps: Triton warps per program.
  """

  # ptxas 13.0 for sm_90a at GLM 5's shapes (32K-128K positions, k 2048): 60-64
  # registers, no spills, 8 KB of shared memory (docs/sparse_attention.md).
  block: int = 1024
  num_warps: int = 8

  def __post_init__(self):
    if self.block < 16 or self.block & (self.block - 1):
      raise ValueError(f"block must be a power of two >= 16, got {self.block}")
    if self.num_warps < 1:
      raise ValueError(f"num_warps must be >= 1, got {self.num_warps}")


@functools.partial(jax.jit, static_argnames=("k", "backend", "block_sizes"))
def topk_positions(scores, *, k, backend=None, block_sizes=None):
  """The positions of each row's k largest finite scores, ascending, then -1.

  ``backend="xla"`` is :func:`reference.topk_positions` (``lax.top_k``); the
  Pallas kernel (topk.topk_kernel: a radix select, one program per row) gives
  the same positions, ties toward the earlier position.

  Args:
    scores: [B, S] f32, -inf where a key is hidden.
    k: how many to keep (>= 1).
    backend: "pallas" | "interpret" | "xla" | None (pallas on GPU, else xla).
    block_sizes: TopkBlockSizes, or None for the default.

  Returns:
    [B, min(k, S)] int32.

  Raises:
    ValueError: scores not [B, S] f32, k < 1, or an unknown backend.
  """
  backend = dispatch.resolve_backend(backend)
  if scores.ndim != 2 or scores.dtype != jnp.float32:
    raise ValueError(f"scores must be [B, S] float32, got {scores.shape} {scores.dtype}")
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  if backend == "xla":
    return reference.topk_positions(scores, k)
  bs = block_sizes or TopkBlockSizes()
  block = bs.block
  b, s = scores.shape
  kk = min(k, s)
  s_pad = -(-s // block) * block
  k_pad = -(-kk // block) * block
  if s_pad != s:  # padding is hidden
    scores = jnp.pad(scores, ((0, 0), (0, s_pad - s)), constant_values=-jnp.inf)
  out = pl.pallas_call(
      functools.partial(topk_lib.topk_kernel, k=kk, block=block),
      grid=(b,),
      in_specs=[pl.BlockSpec((None, s_pad), lambda i: (i, 0))],
      # One spare block past k_pad: the masked lanes' store addresses (topk_kernel).
      out_specs=pl.BlockSpec((None, k_pad + block), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((b, k_pad + block), jnp.int32),
      compiler_params=pltriton.CompilerParams(num_warps=bs.num_warps, num_stages=1),
      interpret=backend == "interpret",
      name="topk_positions",
  )(scores)
  return out[:, :kk]


@functools.partial(jax.jit, static_argnames=("k", "backend", "block_sizes"))
def paged_index_topk(q, weights, index_k, index_k_scale, block_tables, lengths, *, k,
                     backend=None, block_sizes=None):
  """The positions each decode query selects: its k best-scoring cached tokens.

  :func:`paged_index_scores` then :func:`topk_positions` (both kernels on the
  Pallas backends, ``lax.top_k`` on "xla"). A request with at most k cached
  tokens keeps them all.

  Args:
    q, weights, index_k, index_k_scale, block_tables, lengths, backend,
      block_sizes: as :func:`paged_index_scores`.
    k: index_topk.

  Returns:
    [B, min(k, M * page_size)] int32 positions ascending, then -1: the
    ``indices`` of paged_mla_sparse_decode.
  """
  scores = paged_index_scores(q, weights, index_k, index_k_scale, block_tables, lengths,
                              backend=backend, block_sizes=block_sizes)
  return topk_positions(scores, k=k, backend=backend)
