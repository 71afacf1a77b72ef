"""The (token, choice) pairs sorted by expert in one Pallas Triton launch: ``sort_by_expert``.

The grouped matmuls read their rows sorted by expert. XLA built that order as a sort
(``argsort``), a scatter for the inverse permutation, a reduction for the row offsets
and gathers of each row's token and weight. At a decode step's few rows (N x k =
512 for 64 tokens and k = 8) this kernel does it by counting: pair i's row is the
number of pairs with a smaller expert, plus those with its expert and a smaller
index (a stable sort), found in [block, chunk] comparisons against every pair. Each
program places a block of pairs and scatters their token and weight to their rows
(every row once: no two lanes share an address); program 0 also counts the row
offsets of every expert. The comparisons grow with the square of the rows, so the
op runs it up to ``MAX_ROWS`` pairs and the jnp reference
(``sort_by_expert_reference``) above. docs/moe_router.md has the design.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dispatch
from pallas_kernels.moe_router.reference import sort_by_expert_reference
from pallas_kernels.schedule import pow2_at_least

MAX_ROWS = 4096  # N x k up to which the kernel runs (the comparisons are (N x k)^2)
_BLOCK = 32  # pairs a program places
_CHUNK_ELEMENTS = 4096  # comparisons a [block, chunk] step holds
MAX_EXPERTS = _CHUNK_ELEMENTS - 1  # the row offsets' [E + 1, chunk] step fits one
_NUM_WARPS = 4


def _kernel(ids_ref, w_ref, token_ref, roww_ref, slot_ref, cum_ref, *, p: int, k: int, e: int,
            bi: int, bj: int, be: int, bje: int):
  """Refs: the flat [P] experts and weights; out: token_of [P], row_weights [P], slot
  [P] and cum [be] (experts 0..E, then padding)."""
  i = pl.program_id(0) * bi + lax.broadcasted_iota(jnp.int32, (bi,), 0)  # [bi] pairs
  e_i = pltriton.load(ids_ref.at[i])

  def chunk(c, size):  # experts of pairs [c * size, c * size + size); past P: E (before none)
    j = c * size + lax.broadcasted_iota(jnp.int32, (size,), 0)
    return j, pltriton.load(ids_ref.at[jnp.minimum(j, p - 1)], mask=j < p, other=e)

  def before(c, count):  # pairs placed before each of ours: smaller expert, or same and earlier
    j, e_j = chunk(c, bj)
    first = ((e_j[None, :] < e_i[:, None])
             | ((e_j[None, :] == e_i[:, None]) & (j[None, :] < i[:, None])))
    return count + jnp.sum(first.astype(jnp.int32), axis=1)

  row = lax.fori_loop(0, pl.cdiv(p, bj), before, jnp.zeros((bi,), jnp.int32))
  pltriton.store(slot_ref.at[i], row)
  pltriton.store(token_ref.at[row], i // k)
  pltriton.store(roww_ref.at[row], pltriton.load(w_ref.at[i]))

  @pl.when(pl.program_id(0) == 0)
  def _():
    ee = lax.broadcasted_iota(jnp.int32, (be,), 0)

    def below(c, cum):  # pairs with an expert below each e
      _, e_j = chunk(c, bje)
      return cum + jnp.sum((e_j[None, :] < ee[:, None]).astype(jnp.int32), axis=1)

    pltriton.store(cum_ref.at[ee], lax.fori_loop(0, pl.cdiv(p, bje), below,
                                                 jnp.zeros((be,), jnp.int32)))


@functools.partial(jax.jit, static_argnames=("n_experts", "interpret"))
def _sort_pallas(expert_ids, weights, *, n_experts, interpret):
  n, k = expert_ids.shape
  p = n * k
  bi = min(p & -p, _BLOCK)  # divides P: every store is whole, unmasked
  be = pow2_at_least(n_experts + 1)
  bj = min(pow2_at_least(p), _CHUNK_ELEMENTS // bi)
  bje = max(1, min(pow2_at_least(p), _CHUNK_ELEMENTS // be))
  kernel = functools.partial(_kernel, p=p, k=k, e=n_experts, bi=bi, bj=bj, be=be, bje=bje)
  token_of, row_weights, slot, cum = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((p,), jnp.int32), jax.ShapeDtypeStruct((p,), jnp.float32),
                 jax.ShapeDtypeStruct((p,), jnp.int32), jax.ShapeDtypeStruct((be,), jnp.int32)),
      grid=(p // bi,),
      compiler_params=pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="sort_by_expert",
  )(expert_ids.reshape(p), weights.reshape(p))
  return token_of, row_weights, slot.reshape(n, k), cum[:n_experts + 1]


def sort_by_expert(expert_ids: jax.Array, weights: jax.Array, n_experts: int, *,
                   backend: str | None = None):
  """The (token, choice) pairs sorted by expert (stably), as the grouped matmuls read them.

  Args:
    expert_ids: [N, k] int32 experts in [0, n_experts).
    weights: [N, k] f32 combine weights.
    n_experts: E.
    backend: "pallas" | "interpret" (this kernel, up to MAX_ROWS pairs and
      MAX_EXPERTS experts; the reference past them, such as a prefill's rows) | "xla"
      (the reference) | None.

  Returns:
    (token_of [N*k] int32, row_weights [N*k] f32, slot [N, k] int32, cum [E + 1]
    int32), as :func:`sort_by_expert_reference`.

  Raises:
    ValueError: bad shapes or dtypes.
  """
  if expert_ids.ndim != 2 or expert_ids.dtype != jnp.int32 or not expert_ids.size:
    raise ValueError(f"expert_ids must be int32 [N >= 1, k >= 1], got {expert_ids.dtype} "
                     f"{expert_ids.shape}")
  if weights.shape != expert_ids.shape or weights.dtype != jnp.float32:
    raise ValueError(f"weights must be float32 {expert_ids.shape}, got {weights.dtype} "
                     f"{weights.shape}")
  if n_experts < 1:
    raise ValueError(f"n_experts must be positive, got {n_experts}")
  backend = dispatch.resolve_backend(backend)
  if backend == "xla" or expert_ids.size > MAX_ROWS or n_experts > MAX_EXPERTS:
    return sort_by_expert_reference(expert_ids, weights, n_experts)
  return _sort_differentiable(expert_ids, weights, n_experts, backend == "interpret")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _sort_differentiable(expert_ids, weights, n_experts, interpret):
  """The kernel, differentiable in the weights: row slot[i] holds pair i's weight, so
  its gradient is the rows' gradient read at the slots."""
  return _sort_pallas(expert_ids, weights, n_experts=n_experts, interpret=interpret)


def _sort_fwd(expert_ids, weights, n_experts, interpret):
  out = _sort_differentiable(expert_ids, weights, n_experts, interpret)
  return out, (expert_ids, out[2])


def _sort_bwd(n_experts, interpret, res, grads):
  expert_ids, slot = res
  return (jnp.zeros(expert_ids.shape, jax.dtypes.float0),
          grads[1][slot.reshape(-1)].reshape(slot.shape))


_sort_differentiable.defvjp(_sort_fwd, _sort_bwd)
