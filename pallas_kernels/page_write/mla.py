"""MLA's page write with its entries' prologue in the same launch: ``write_mla_pages``.

A decode step's MLA layer stores two entries per token: the RMS-normed latent and the
rotated rope key, both computed from the ``wkv_a`` projection. Computed by XLA, the
RMSNorm is a reduction kernel of its own and the interleaved rope's stack another,
before the write (the kernel of ``ops.py`` for fp8 pools, two scatters for float
pools): three or four launches. Here one program per token row reads the row's
projection, norms the latent and rotates the key (each rounded to the projection's
dtype, as the model's own ops round them: ``mla_entries_reference``), and stores
both, quantised to e4m3 with per-token scales for an fp8 pool (``quantize_rows``) or
cast for a float pool, at its (page, slot) in pool arrays aliased to the outputs: one
launch (docs/step_time.md, "Launches per MoE layer"). Rows whose page is outside the
pool write nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import resolve_backend
from pallas_kernels.page_write.reference import (mla_entries_reference, quantize_rows,
                                                 write_pages_reference)


@dataclasses.dataclass(frozen=True)
class MlaProjection:
  """A layer's MLA cache entries before their RMSNorm and rope: what a paged cache's
  write takes to compute them in the page write's own launch (:func:`write_mla_pages`).

  Attributes:
    kv: [..., C + Rr] the ``wkv_a`` projection.
    norm_scale: [C] the latent's RMSNorm weight.
    cos, sin: [..., Rr/2] f32 rope tables of the tokens' positions.
    eps: the RMSNorm's epsilon.
    interleave: the rope's pairing (see ``mla_entries_reference``).
  """
  kv: jax.Array
  norm_scale: jax.Array
  cos: jax.Array
  sin: jax.Array
  eps: float
  interleave: bool

  @property
  def widths(self) -> tuple[int, int]:
    """(C, Rr): the latent's and the rope key's widths."""
    c = self.norm_scale.shape[-1]
    return c, self.kv.shape[-1] - c

  def entries(self) -> dict:
    """{"latent": [..., C], "k_rope": [..., Rr]} in kv's dtype (``mla_entries_reference``)."""
    latent, k_rope = mla_entries_reference(self.kv, self.norm_scale, self.cos, self.sin,
                                           eps=self.eps, interleave=self.interleave)
    return {"latent": latent, "k_rope": k_rope}


def _pow2(n: int) -> bool:
  return n > 0 and not n & (n - 1)


def mla_kernel_takes(kv, norm_scale, pages, scales) -> bool:
  """Whether the kernel takes these arrays: kv [R, C + Rr] with C and Rr powers of two
  (Triton's blocks), pools [N, P, C] and [N, P, Rr] of one float dtype, or e4m3 with
  per-token scales [N, P] f32. Anything else runs the reference."""
  if kv.ndim != 2 or norm_scale.ndim != 1 or len(pages) != 2:
    return False
  c = norm_scale.shape[0]
  r = kv.shape[1] - c
  if not (_pow2(c) and _pow2(r) and r >= 2):
    return False
  latent, rope = pages
  n, p = latent.shape[:2]
  if latent.shape != (n, p, c) or rope.shape != (n, p, r) or latent.dtype != rope.dtype:
    return False
  if latent.dtype == jnp.float8_e4m3fn:
    return scales is not None and all(s.shape == (n, p) and s.dtype == jnp.float32
                                      for s in scales)
  return scales is None and jnp.issubdtype(latent.dtype, jnp.floating)


def _kernel(page_ref, slot_ref, kv_ref, norm_ref, cos_ref, sin_ref, *refs, c: int, r: int,
            eps: float, interleave: bool, fp8: bool, page_size: int, num_pages: int):
  # The pools (values, then scales for fp8) come in twice, as inputs and as the outputs
  # they are aliased to; only the outputs are written.
  n_out = 4 if fp8 else 2
  latent_out, rope_out = refs[-n_out:][:2]
  i = pl.program_id(0)
  page = page_ref[i]
  f32, dtype = jnp.float32, kv_ref.dtype
  h = r // 2

  @pl.when((page >= 0) & (page < num_pages))
  def _():
    row = page * page_size + slot_ref[i]  # in the pools flattened to [N * P, D]
    # The latent's RMSNorm, rounded to the projection's dtype as the model's entry is.
    x = kv_ref[i, pl.ds(0, c)].astype(f32)  # [C]
    y = x * jax.lax.rsqrt(jnp.mean(x * x) + eps)
    latent = (y * norm_ref[...].astype(f32)).astype(dtype).astype(f32)
    # The rope key: pairs (2j, 2j + 1) when interleaved, else (j, j + Rr/2).
    first, second = ((pl.ds(0, h, stride=2), pl.ds(1, h, stride=2)) if interleave
                     else (pl.ds(0, h), pl.ds(h, h)))
    key = (pl.ds(c, h, stride=2), pl.ds(c + 1, h, stride=2)) if interleave else (
        pl.ds(c, h), pl.ds(c + h, h))
    x1, x2 = kv_ref[i, key[0]].astype(f32), kv_ref[i, key[1]].astype(f32)  # [Rr/2] each
    cos, sin = cos_ref[i, :], sin_ref[i, :]
    y1 = (x1 * cos - x2 * sin).astype(dtype).astype(f32)
    y2 = (x1 * sin + x2 * cos).astype(dtype).astype(f32)
    if fp8:
      latent_scale_out, rope_scale_out = refs[-2:]
      q, scale = quantize_rows(latent, jnp.max(jnp.abs(latent)))
      latent_out[row, :] = q
      latent_scale_out[pl.ds(row, 1)] = jnp.full((1,), scale, f32)
      amax = jnp.maximum(jnp.max(jnp.abs(y1)), jnp.max(jnp.abs(y2)))
      q1, scale = quantize_rows(y1, amax)
      q2, _ = quantize_rows(y2, amax)
      rope_out[row, first] = q1
      rope_out[row, second] = q2
      rope_scale_out[pl.ds(row, 1)] = jnp.full((1,), scale, f32)
    else:
      latent_out[row, :] = latent.astype(latent_out.dtype)
      rope_out[row, first] = y1.astype(rope_out.dtype)
      rope_out[row, second] = y2.astype(rope_out.dtype)


def write_mla_pages(kv: jax.Array, norm_scale: jax.Array, cos: jax.Array, sin: jax.Array,
                    pages, scales, page: jax.Array, slot: jax.Array, *, eps: float,
                    interleave: bool, backend: str | None = None):
  """Writes MLA's entries, computed from the ``wkv_a`` projection, into their pages.

  Equals ``write_pages_reference(mla_entries_reference(kv, ...), pages, scales, page,
  slot)`` (up to the last bit of the norm's rsqrt), in one launch on the kernel backends.

  Args:
    kv: [R, C + Rr] the projection of each token row (any float dtype).
    norm_scale: [C] the latent's RMSNorm weight.
    cos, sin: [R, Rr/2] f32 rope tables of each row's position.
    pages: (latent pool [N, P, C], rope pool [N, P, Rr]): e4m3 with ``scales``, else
      one float dtype.
    scales: None, or the pools' per-token scales ([N, P] f32 each).
    page: [R] int32; a row whose page is outside [0, N) is not written.
    slot: [R] int32.
    eps: the RMSNorm's epsilon.
    interleave: the rope's pairing (see ``mla_entries_reference``).
    backend: "pallas" | "interpret" run the kernel where :func:`mla_kernel_takes` the
      arrays, the reference otherwise; "xla" the reference; None the platform default.

  Returns:
    (pages, scales) updated, as ``write_pages_reference``.

  Raises:
    ValueError: on mismatched shapes or dtypes of kv, the norm weight, the rope
      tables, page or slot, or a backend that does not exist.
  """
  backend = resolve_backend(backend)
  if kv.ndim != 2 or norm_scale.ndim != 1 or kv.shape[1] <= norm_scale.shape[0]:
    raise ValueError(f"write_mla_pages: kv must be [R, C + Rr] with C = norm_scale's "
                     f"{norm_scale.shape}, got {kv.shape}")
  R, c = kv.shape[0], norm_scale.shape[0]
  r = kv.shape[1] - c
  if r % 2:
    raise ValueError(f"write_mla_pages: the rope width {r} is odd")
  for name, a in (("cos", cos), ("sin", sin)):
    if a.shape != (R, r // 2):
      raise ValueError(f"write_mla_pages: {name} must be [{R}, {r // 2}], got {a.shape}")
  for name, a in (("page", page), ("slot", slot)):
    if a.shape != (R,) or a.dtype != jnp.int32:
      raise ValueError(f"write_mla_pages: {name} must be int32 [{R}], got {a.dtype} {a.shape}")
  if backend == "xla" or not mla_kernel_takes(kv, norm_scale, pages, scales):
    entries = mla_entries_reference(kv, norm_scale, cos, sin, eps=eps, interleave=interleave)
    return write_pages_reference(entries, pages, scales, page, slot)
  fp8 = scales is not None
  n, p = pages[0].shape[:2]
  # Flattened to [N * P, D] and [N * P]: free (bitcasts).
  pools = [x.reshape(n * p, x.shape[-1]) for x in pages]
  pools += [s.reshape(n * p) for s in scales] if fp8 else []
  first = 6  # page, slot, kv, norm, cos, sin, then the pools
  out = pl.pallas_call(
      functools.partial(_kernel, c=c, r=r, eps=float(eps), interleave=bool(interleave),
                        fp8=fp8, page_size=p, num_pages=n),
      grid=(R,),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
      input_output_aliases={first + i: i for i in range(len(pools))},
      interpret=backend == "interpret",
      name="page_write_mla",
  )(page, slot, kv, norm_scale, cos.astype(jnp.float32), sin.astype(jnp.float32), *pools)
  new_pages = tuple(o.reshape(x.shape) for o, x in zip(out[:2], pages))
  new_scales = tuple(o.reshape(s.shape) for o, s in zip(out[2:], scales)) if fp8 else None
  return new_pages, new_scales
