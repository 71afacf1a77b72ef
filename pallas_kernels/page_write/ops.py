"""The page write as one Pallas Triton kernel (docs/step_time.md, "Launches per MoE layer").

XLA writes a layer's MLA entries (latent and rope key) to an fp8 pool with a
reduction for the per-token scales and one scatter per array, values and
scales: five launches per layer. Here one program per token row reads its rows,
quantises each (``quantize_rows``, the same rounding as the reference), and
stores values and scales at its (page, slot) in pool arrays aliased to the
outputs, so under a donated state nothing is copied. Rows whose page is outside
the pool (padding, tokens past their request's length) write nothing.

Float pools keep XLA's scatters here: computed entries fuse into the scatters
themselves. A decode step's MLA write goes through ``mla.py`` instead, which also
computes the entries (the latent's RMSNorm and the key's rope), for fp8 and float
pools.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import resolve_backend
from pallas_kernels.page_write.reference import quantize_rows, write_pages_reference


def kernel_takes(entries, pages, scales) -> bool:
  """Whether the kernel takes these arrays: entries [R, D_i] with power-of-two widths
  (Triton's blocks), e4m3 pool arrays [N, P, D_i] of one page count and size, and their
  per-token scales [N, P] f32. Anything else (float pools, GQA's per-head pools) runs
  the reference."""
  if not entries or len(entries) != len(pages) or scales is None or len(scales) != len(pages):
    return False
  n, p = pages[0].shape[:2]
  for i, (e, pool) in enumerate(zip(entries, pages)):
    d = e.shape[-1]
    if (e.ndim != 2 or pool.ndim != 3 or pool.shape != (n, p, d) or d & (d - 1)
        or e.shape[0] != entries[0].shape[0] or pool.dtype != jnp.float8_e4m3fn):
      return False
    if scales[i].shape != (n, p) or scales[i].dtype != jnp.float32:
      return False
  return True


def _kernel(page_ref, slot_ref, *refs, n_arrays: int, page_size: int, num_pages: int):
  entries = refs[:n_arrays]
  # The pools (values, then scales) come in twice, as inputs and as the outputs they are
  # aliased to; only the outputs are written.
  outs = refs[-2 * n_arrays:]
  r = pl.program_id(0)
  page = page_ref[r]

  @pl.when((page >= 0) & (page < num_pages))
  def _():
    row = page * page_size + slot_ref[r]  # in the pool flattened to [N * P, D]
    for i, x_ref in enumerate(entries):
      x = x_ref[r, :].astype(jnp.float32)  # [D_i]
      q, scale = quantize_rows(x, jnp.max(jnp.abs(x)))
      outs[i][row, :] = q
      outs[n_arrays + i][pl.ds(row, 1)] = jnp.full((1,), scale, jnp.float32)


def write_pages(entries, pages, scales, page: jax.Array, slot: jax.Array, *,
                backend: str | None = None):
  """:func:`write_pages_reference` in one Pallas Triton launch.

  Args:
    entries: arrays [R, D_i] of any float dtype.
    pages: pool arrays [N, P, D_i] (e4m3 with ``scales``, else any float dtype).
    scales: None, or per-token scale arrays [N, P] f32, one per pool array.
    page: [R] int32; a row whose page is outside [0, N) is not written.
    slot: [R] int32.
    backend: "pallas" | "interpret" run the kernel where :func:`kernel_takes` the
      arrays (fp8 pools), the reference otherwise; "xla" the reference; None the
      platform default.

  Returns:
    (pages, scales) updated, as the reference.

  Raises:
    ValueError: page or slot is not [R] int32, or a backend that does not exist.
  """
  backend = resolve_backend(backend)
  R = entries[0].shape[0] if entries else 0
  for name, a in (("page", page), ("slot", slot)):
    if a.shape != (R,) or a.dtype != jnp.int32:
      raise ValueError(f"write_pages: {name} must be int32 [{R}], got {a.dtype} {a.shape}")
  if backend == "xla" or not kernel_takes(entries, pages, scales):
    return write_pages_reference(entries, pages, scales, page, slot)
  n, p = pages[0].shape[:2]
  # Flattened to [N * P, D] and [N * P]: free (bitcasts).
  pools = [x.reshape(n * p, x.shape[-1]) for x in pages] + [s.reshape(n * p) for s in scales]
  k = len(entries)
  first = 2 + k  # page, slot, entries, then the pools
  out = pl.pallas_call(
      functools.partial(_kernel, n_arrays=k, page_size=p, num_pages=n),
      grid=(R,),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pools],
      input_output_aliases={first + i: i for i in range(len(pools))},
      interpret=backend == "interpret",
      name="page_write",
  )(page, slot, *entries, *pools)
  return (tuple(o.reshape(x.shape) for o, x in zip(out[:k], pages)),
          tuple(o.reshape(s.shape) for o, s in zip(out[k:], scales)))
