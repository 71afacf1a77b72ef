"""GPTQ int4 quantisation and hook-free calibration.

GPTQ (Frantar et al., 2022) quantises a weight's input rows one at a time and
pushes each row's rounding error onto the not-yet-quantised rows, weighted by the
inverse Hessian ``H = X^T X`` of the layer's calibration inputs. It minimises
``||X W - X W_q||`` rather than ``||W - W_q||``, which matters most when a few
input channels carry outlier activations. The result is an ordinary symmetric
:class:`~mlkit.quant.formats.Int4Weight`, so nothing downstream changes.

Calibration is collected without hooks: :func:`collect_calibration` wraps the
chosen weights in a recording format that :func:`mlkit.quant.matmul` /
:func:`grouped_matmul` dispatch to, runs any (jitted or eager) forward function,
and accumulates ``X^T X`` per weight (per expert for grouped weights) on the
host through ``jax.debug.callback``. Only the Gram matrix leaves the device,
never the activations.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mlkit.quant.dispatch import dequantize, grouped_matmul, matmul
from mlkit.quant.formats import (INT4_QMAX, Int4Weight, check_finite, check_int4_shape,
                                 check_rank, int4_group_scales, pack_int4)
from mlkit.quant.tree import flatten_params


@struct.dataclass
class CalibrationStats:
  """Second moments of one weight's inputs.

  Attributes:
    xtx: f32 [K, K] (grouped/expert weights: [E, K, K]): sum over calibration rows of x x^T.
    count: f32 [] (experts: [E]): rows seen.
  """

  xtx: jax.Array
  count: jax.Array


def calibration_stats(x: jax.Array) -> CalibrationStats:
  """Stats from activations x [..., K] (all leading axes are rows)."""
  x2 = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
  return CalibrationStats(xtx=x2.T @ x2, count=jnp.float32(x2.shape[0]))


def _upper_inverse_cholesky(h: jax.Array, damp: float) -> jax.Array:
  """U with H^-1 = U^T U (upper triangular) for a damped, regularised Hessian [K, K]."""
  k = h.shape[-1]
  eye = jnp.eye(k, dtype=jnp.float32)
  diag = jnp.diagonal(h)
  # Channels never seen in calibration carry no information: give them a unit
  # diagonal so their rounding error is not propagated (plain RTN there).
  dead = diag <= 0
  h = jnp.where(dead[:, None] | dead[None, :], 0.0, h) + jnp.diag(jnp.where(dead, 1.0, 0.0))
  h = h + damp * jnp.mean(jnp.diagonal(h)) * eye
  lower = jnp.linalg.cholesky(h)
  hinv = jax.scipy.linalg.cho_solve((lower, True), eye)
  return jnp.linalg.cholesky(hinv).T


def _gptq_2d(w: jax.Array, h: jax.Array, group_size: int, scale_dtype, damp: float):
  """GPTQ over one [K, N] weight; returns (codes int8 [K, N], scales [K//g, N])."""
  k, n = w.shape
  u = _upper_inverse_cholesky(h, damp)  # [K, K]
  n_groups = k // group_size

  def group_body(g, carry):
    w, codes, scales = carry
    block = jax.lax.dynamic_slice(w, (g * group_size, 0), (group_size, n))
    # Scales come from the group's error-updated weights, as in the reference GPTQ.
    s = int4_group_scales(block, group_size, scale_dtype)[0]  # [N]
    sf = s.astype(jnp.float32)
    safe = jnp.where(sf == 0, 1.0, sf)

    def row_body(j, carry):
      w, codes = carry
      r = g * group_size + j
      wr = w[r]  # [N]
      q = jnp.clip(jnp.round(wr / safe), -INT4_QMAX, INT4_QMAX)
      err = (wr - q * sf) / u[r, r]
      # U is upper triangular, so rows < r are untouched and row r becomes q * s.
      w = w - u[r][:, None] * err[None, :]
      return w, codes.at[r].set(q.astype(jnp.int8))

    w, codes = jax.lax.fori_loop(0, group_size, row_body, (w, codes))
    return w, codes, scales.at[g].set(s)

  init = (w.astype(jnp.float32), jnp.zeros((k, n), jnp.int8),
          jnp.zeros((n_groups, n), scale_dtype))
  _, codes, scales = jax.lax.fori_loop(0, n_groups, group_body, init)
  return codes, scales


_gptq_2d_jit = jax.jit(_gptq_2d, static_argnums=(2, 3, 4))
_gptq_experts_jit = jax.jit(jax.vmap(_gptq_2d, in_axes=(0, 0, None, None, None)),
                            static_argnums=(2, 3, 4))


def gptq_quantize_int4(w: jax.Array, stats: CalibrationStats | jax.Array, group_size: int = 128, *,
                       scale_dtype=jnp.bfloat16, damp: float = 0.01,
                       name: str = "weight") -> Int4Weight:
  """Symmetric group-wise int4 via GPTQ.

  Args:
    w: weight [K, N] or experts [E, K, N].
    stats: :class:`CalibrationStats` with xtx [K, K] (shared by all experts) or
      [E, K, K] (per expert), or raw activations [..., K]. Experts that saw no
      calibration rows (count 0) fall back to round-to-nearest.
    group_size: input rows per scale: 32, 64 or 128.
    scale_dtype: bf16 or f32 scales.
    damp: Hessian damping as a fraction of its mean diagonal.
    name: the parameter's name, used in error messages.

  Returns:
    An :class:`Int4Weight` in exactly the RTN layout.

  Raises:
    ValueError: naming ``name`` for the same shape/finiteness errors as
      :func:`~mlkit.quant.formats.quantize_int4`, or stats whose shape does not match.
  """
  check_rank(w, name)
  check_int4_shape(w.shape, group_size, name)
  check_finite(w, name)
  if not isinstance(stats, CalibrationStats):
    stats = calibration_stats(stats)
  k = w.shape[-2]
  xtx = jnp.asarray(stats.xtx, jnp.float32)
  count = jnp.asarray(stats.count, jnp.float32)
  if xtx.shape[-2:] != (k, k) or xtx.ndim > w.ndim or (xtx.ndim == 3 and xtx.shape[0] != w.shape[0]):
    raise ValueError(f"{name}: calibration xtx has shape {tuple(xtx.shape)}, expected [{k}, {k}]"
                     + (f" or [{w.shape[0]}, {k}, {k}]" if w.ndim == 3 else ""))
  # No rows at all: identity Hessian, under which GPTQ is exactly RTN.
  xtx = jnp.where((count > 0)[..., None, None], xtx, jnp.eye(k, dtype=jnp.float32))
  scale_dtype = jnp.dtype(scale_dtype)
  if w.ndim == 3:
    if xtx.ndim == 2:
      xtx = jnp.broadcast_to(xtx, (w.shape[0], k, k))
    codes, scales = _gptq_experts_jit(w, xtx, group_size, scale_dtype, float(damp))
  else:
    codes, scales = _gptq_2d_jit(w, xtx, group_size, scale_dtype, float(damp))
  return Int4Weight(packed=pack_int4(codes), scales=scales, group_size=group_size)


# ----------------------------------------------------------------------------- calibration

# Stores of the collect_calibration calls in progress (innermost last). Kept out
# of the taps' pytree aux data so a jitted forward is traced once, not per call.
_STORES: list[dict] = []


def _accumulate(path: str, xtx, count) -> None:
  store = _STORES[-1]
  xtx, count = np.asarray(xtx, np.float64), np.asarray(count, np.float64)
  if path in store:
    old_xtx, old_count = store[path]
    xtx, count = old_xtx + xtx, old_count + count
  store[path] = (xtx, count)


class _Tap:
  """A weight wrapper whose matmuls send X^T X of their inputs to the host.

  A pytree (the weight is its only child), so it works inside a jitted forward:
  the statistics are computed on device and leave through ``jax.debug.callback``.
  """

  def __init__(self, w, path: str):
    self.w, self.path = w, path

  @property
  def shape(self):
    return self.w.shape

  @property
  def ndim(self):
    return len(self.w.shape)

  def record(self, x):
    x2 = x.astype(jnp.float32).reshape(-1, x.shape[-1])  # [M, K]
    jax.debug.callback(functools.partial(_accumulate, self.path), x2.T @ x2,
                       jnp.float32(x2.shape[0]))

  def record_grouped(self, x, group_sizes):
    x = x.astype(jnp.float32)  # [M, K], rows sorted by expert
    n_experts = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    expert_of_row = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")  # E = unused row
    onehot = (expert_of_row[:, None] == jnp.arange(n_experts)[None, :]).astype(jnp.float32)
    xtx = jnp.einsum("me,mk,ml->ekl", onehot, x, x)  # [E, K, K]
    jax.debug.callback(functools.partial(_accumulate, self.path), xtx,
                       group_sizes.astype(jnp.float32))


jax.tree_util.register_pytree_node(
    _Tap, lambda t: ((t.w,), t.path), lambda path, ch: _Tap(ch[0], path))


@matmul.register(_Tap)
def _matmul_tap(x, w: _Tap, *, out_dtype=None, backend=None):
  w.record(x)
  return matmul(x, w.w, out_dtype=out_dtype, backend=backend)


@grouped_matmul.register(_Tap)
def _grouped_matmul_tap(x, w: _Tap, group_sizes, *, out_dtype=None, backend=None):
  w.record_grouped(x, group_sizes)
  return grouped_matmul(x, w.w, group_sizes, out_dtype=out_dtype, backend=backend)


@dequantize.register(_Tap)
def _dequantize_tap(w: _Tap, dtype=None):
  # A dequantised weight (MLA's absorbed wkv_b) has no matmul input to record.
  return dequantize(w.w, dtype)


def collect_calibration(forward_fn: Callable[[Any], Any], params, paths: Iterable[str]
                        ) -> dict[str, CalibrationStats]:
  """Runs ``forward_fn(params)`` and records X^T X for the weights in ``paths``.

  Works with any model that calls :func:`mlkit.quant.matmul` / ``grouped_matmul``
  on its weights, jitted or not, e.g.
  ``lambda p: mlkit.model.forward(p, tokens, cfg=cfg)``. Call it once per
  calibration batch and merge with :func:`merge_calibration`, or pass a batch of
  several sequences at once.

  Args:
    forward_fn: params -> anything.
    params: the params tree (plain arrays).
    paths: parameter paths (``"layers/1/ffn/w_gate"``) to record.

  Returns:
    {path: CalibrationStats}: xtx [K, K] for 2-D weights, [E, K, K] for experts
    fed through ``grouped_matmul`` (count [E]: rows routed to each). Weights the
    forward never multiplied (e.g. MLA's ``wkv_b``, which the model only
    dequantises) are absent.

  Raises:
    ValueError: if a path is not a parameter.
  """
  paths = set(paths)
  flat, treedef = flatten_params(params)
  known = {p for p, _ in flat}
  missing = sorted(paths - known)
  if missing:
    raise ValueError(f"collect_calibration: no parameter named {missing[0]!r}")
  leaves = [_Tap(leaf, p) if p in paths else leaf for p, leaf in flat]
  _STORES.append({})
  try:
    jax.block_until_ready(forward_fn(jax.tree_util.tree_unflatten(treedef, leaves)))
    jax.effects_barrier()  # all callbacks have run
    store = _STORES[-1]
  finally:
    _STORES.pop()
  return {p: CalibrationStats(xtx=jnp.asarray(x, jnp.float32), count=jnp.asarray(c, jnp.float32))
          for p, (x, c) in store.items()}


def merge_calibration(*stats: dict[str, CalibrationStats]) -> dict[str, CalibrationStats]:
  """Sums calibration dicts from several batches (path-wise)."""
  out: dict[str, CalibrationStats] = {}
  for d in stats:
    for p, s in d.items():
      out[p] = s if p not in out else CalibrationStats(out[p].xtx + s.xtx, out[p].count + s.count)
  return out
