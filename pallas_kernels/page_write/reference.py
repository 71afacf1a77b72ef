"""The page write in jnp: per-token e4m3 quantisation and one scatter per pool array.

``quantize_rows`` is the one definition of the KV cache's fp8 rounding; the
kernel (``ops.py``) and ``mlkit.kvcache.fp8`` both use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.residual_norm.reference import rms_norm

# Largest finite e4m3fn value.
FP8_MAX = 448.0


def quantize_rows(xf: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
  """e4m3 values and f32 scales of rows ``xf`` [..., D] (f32) whose largest |value| is
  ``absmax`` [...]: scale = absmax / 448, and 1 for an all-zero row (zeros stored, no
  division by zero)."""
  scale = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
  # Division (not multiplication by 448/absmax) keeps power-of-two scales exact.
  q = jnp.clip(xf / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return q, scale


def quantize_many(xs) -> list[tuple[jax.Array, jax.Array]]:
  """:func:`quantize_rows` of each array over its last axis, their row maxima read by one
  reduction.

  A step writes several entries per layer (MLA's latent and rope key, GQA's K and V).
  Quantised one by one, each runs a reduction kernel of its own on a GPU; here the
  arrays' absolute values, zero-padded to one last-axis length, go through one variadic
  reduction (a maximum per array), so a layer's write runs one reduction kernel
  (docs/step_time.md, "Launches per MoE layer"; stacked instead, the stack was built
  in a kernel of its own). Zeros never raise a maximum of absolute values, so every
  scale and value equals the array's own. Arrays whose leading shapes differ are
  quantised one by one.

  Args:
    xs: arrays [..., D_i] of any float dtype.

  Returns:
    [(values [..., D_i] float8_e4m3fn, scale [...] f32)], one per array.
  """
  xfs = [x.astype(jnp.float32) for x in xs]
  if len(xfs) < 2 or len({x.shape[:-1] for x in xfs}) > 1:
    return [quantize_rows(x, jnp.max(jnp.abs(x), axis=-1)) for x in xfs]
  width = max(x.shape[-1] for x in xfs)
  padded = [jnp.pad(jnp.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
            for x in xfs]
  # One variadic reduction: a maximum per array, over arrays of one shape.
  absmax = jax.lax.reduce(padded, [jnp.float32(0)] * len(padded),
                          lambda a, b: [jnp.maximum(u, v) for u, v in zip(a, b)],
                          (padded[0].ndim - 1,))
  return [quantize_rows(x, m) for x, m in zip(xfs, absmax)]


def write_pages_reference(entries, pages, scales, page: jax.Array, slot: jax.Array):
  """Writes row r of every entry at (page[r], slot[r]) of its pool array.

  Args:
    entries: arrays [R, *E_i] of any float dtype.
    pages: pool arrays [N, P, *E_i] (e4m3 with ``scales``, else any float dtype).
    scales: None, or scale arrays [N, P, *E_i[:-1]] f32, one per pool array (fp8 pools:
      one scale per token, and per KV head for GQA).
    page: [R] int32 page of each row; a row whose page is outside [0, N) is not written.
    slot: [R] int32 slot of each row in its page.

  Returns:
    (pages, scales) updated (scales None when given None).
  """
  # Negative pages would count from the end in a scatter: out of the pool, as the kernel.
  page = jnp.where(page >= 0, page, pages[0].shape[0])
  if scales is None:
    return tuple(p.at[page, slot].set(e.astype(p.dtype), mode="drop")
                 for p, e in zip(pages, entries)), None
  new_pages, new_scales = [], []
  for p, s, (q, sc) in zip(pages, scales, quantize_many(entries)):
    new_pages.append(p.at[page, slot].set(q, mode="drop"))
    new_scales.append(s.at[page, slot].set(sc, mode="drop"))
  return tuple(new_pages), tuple(new_scales)


def mla_entries_reference(kv: jax.Array, norm_scale: jax.Array, cos: jax.Array, sin: jax.Array,
                          *, eps: float, interleave: bool) -> tuple[jax.Array, jax.Array]:
  """MLA's cache entries from the ``wkv_a`` projection: the RMS-normed latent and the
  rotated rope key, each rounded to kv's dtype (the same ops, in the same order, as
  the model's ``rms_norm`` (``pallas_kernels.residual_norm.reference``) and
  ``mlkit.model.rope.apply_rope``, which
  tests/test_page_write_kernel.py checks bit for bit).

  Args:
    kv: [..., C + R] the projection (any float dtype).
    norm_scale: [C] the latent's RMSNorm weight.
    cos, sin: [..., R/2] f32 rope tables.
    eps: the RMSNorm's epsilon.
    interleave: rotate pairs (2i, 2i+1) (DeepSeek-style checkpoints), else (i, i + R/2).

  Returns:
    (latent [..., C], k_rope [..., R]) in kv's dtype.
  """
  c = norm_scale.shape[-1]
  latent = rms_norm(kv[..., :c], norm_scale, eps)
  k_rope = rotate(kv[..., c:].astype(jnp.float32), cos, sin, interleave=interleave)
  return latent, k_rope.astype(kv.dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, *, interleave: bool) -> jax.Array:
  """The rope rotation of x [..., R] (f32) by cos/sin [..., R/2], which broadcast against
  x's leading axes: pairs (2i, 2i+1) when ``interleave``, else (i, i + R/2). The one
  definition: ``mlkit.model.rope.apply_rope`` rotates with it too."""
  if interleave:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    y1, y2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    return jnp.stack([y1, y2], axis=-1).reshape(x.shape)
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
