"""Registers the quantised formats on ``matmul`` / ``grouped_matmul`` / ``grouped_matmuls``.

Each registration chooses by backend: "xla" runs the XLA reference in
``mlkit.quant.reference``; "pallas" and "interpret" run the Pallas W4A16 kernels
in ``pallas_kernels.int4_matmul`` (on a GPU, the default backend is "pallas", so
the model runs the kernels with no code change). Int4 weights in layout "kn" run
the packed-layout kernels, in layout "nk" the register-dequantising ones
(:func:`kernel_int4_layout` names the platform's, :func:`kernel_layout` converts
a tree; docs/int4_matmul.md). Both layouts run on every backend. Block-scaled FP8 experts run
the FP8 grouped kernel (``pallas_kernels.fp8_matmul``); dense FP8 matmuls, and experts
with per-channel scales, use the XLA reference.
"""

from __future__ import annotations

import jax

from mlkit.quant.dispatch import grouped_matmul, grouped_matmuls, matmul, schedule_spec
from mlkit.quant.formats import Fp8Weight, Int4Weight, relaid_int4
from mlkit.quant.reference import (fp8_grouped_matmul_reference, fp8_matmul_reference,
                                   int4_grouped_matmul_reference, int4_matmul_reference)
from pallas_kernels import dispatch as kernel_dispatch
from pallas_kernels import fp8_matmul as fp8_kernels
from pallas_kernels import int4_matmul as int4_kernels
from pallas_kernels.int4_matmul import partitioned as int4_partitioned


def kernel_int4_layout(backend: str | None = None) -> str:
  """The Int4Weight layout the matmuls of ``backend`` should be given: for the kernels
  ("pallas", "interpret", and None on a GPU), the one whose kernels are right on an
  H200 (``pallas_kernels.int4_matmul.HARDWARE_LAYOUT``; docs/int4_matmul.md, "On
  hardware"), interpret mode included, so that the CPU tests run what a GPU runs;
  "kn" for the XLA reference, which reads either (None on a CPU). The other layout
  stays selectable by name (``quantize_params(..., int4_layout=...)``).

  Raises:
    ValueError: an unknown backend.
  """
  if kernel_dispatch.resolve_backend(backend) == "xla":
    return "kn"
  return int4_kernels.HARDWARE_LAYOUT


def kernel_layout(tree, backend: str | None = None):
  """``tree`` with its Int4Weight leaves in the layout ``backend``'s kernels read
  (:func:`kernel_int4_layout`); unchanged for "xla", which reads either.

  Converting copies each relaid int4 weight while the caller still holds ``tree``;
  for a full-size model, quantise (``quantize_params(..., int4_layout=...)``) into
  the layout instead.
  """
  if kernel_dispatch.resolve_backend(backend) == "xla":
    return tree  # the XLA reference reads either layout: nothing to copy
  return relaid_int4(tree, kernel_int4_layout(backend))


@matmul.register(Int4Weight)
def _matmul_int4(x, w: Int4Weight, *, out_dtype=None, backend=None):
  backend = kernel_dispatch.resolve_backend(backend)
  if backend == "xla":
    return int4_matmul_reference(x, w, out_dtype=out_dtype)
  if w.packed.ndim != 2:
    raise ValueError(f"matmul: Int4Weight must be 2-D [K, N], got packed {w.packed.shape}")
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1])
  if backend == "pallas":
    # Partitioned like the weight: under tensor parallelism each device runs the kernel
    # on its own columns (or rows, summed), instead of XLA gathering the weight.
    y = int4_partitioned.int4_matmul_partitioned(x2, w.packed, w.scales,
                                                 group_size=w.group_size, layout=w.layout)
  else:
    op = int4_kernels.int4_matmul_nk if w.layout == "nk" else int4_kernels.int4_matmul
    y = op(x2, w.packed, w.scales, group_size=w.group_size, backend=backend)  # [M, N]
  return y.reshape(*lead, y.shape[-1]).astype(out_dtype or x.dtype)


def _int4_grouped_kernel(layout: str):
  """The grouped int4 kernel op that reads ``layout``'s weights."""
  return int4_kernels.int4_grouped_matmul_nk if layout == "nk" else int4_kernels.int4_grouped_matmul


@grouped_matmul.register(Int4Weight)
def _grouped_matmul_int4(x, w: Int4Weight, group_sizes, *, out_dtype=None, backend=None,
                         schedule=None):
  if kernel_dispatch.resolve_backend(backend) == "xla":
    return int4_grouped_matmul_reference(x, w, group_sizes, out_dtype=out_dtype)
  y = _int4_grouped_kernel(w.layout)(x, w.packed, w.scales, group_sizes.astype(jax.numpy.int32),
                                     group_size=w.group_size, backend=backend,
                                     schedule=schedule)  # [M, N]
  return y.astype(out_dtype or x.dtype)


@schedule_spec.register(Int4Weight)
def _schedule_spec_int4(m, ws, *, backend=None):
  """The kernels' schedule (``int4_matmul.grouped_schedule_spec``: its tile_m and tile
  count follow M, E and the tuned tiles of each weight's layout) when every weight's
  grouped call reads the same one, on the kernel backends; None on "xla" (the reference
  reads none) or when the calls' tile_m differ."""
  if kernel_dispatch.resolve_backend(backend) == "xla" or any(w.ndim != 3 for w in ws):
    return None
  specs = {int4_kernels.grouped_schedule_spec(m, w.shape[0], w.shape[2], w.shape[1],
                                              layout=w.layout) for w in ws}  # [E, K, N]
  return specs.pop() if len(specs) == 1 else None


@grouped_matmuls.register(Int4Weight)
def _grouped_matmuls_int4(x, ws, group_sizes, *, out_dtype=None, backend=None, schedule=None):
  """Int4 weights of one layout, group size, shape and scale dtype (an expert FFN's gate
  and up) on the kernel backends: one launch over all of them, its [M, W * N] result
  sliced per weight (docs/int4_matmul.md, "Gate and up in one launch"); anything else
  (the "xla" reference included) one call per weight, as the default does."""
  first = ws[0]

  def sig(w):
    return (w.layout, w.group_size, w.packed.shape, w.packed.dtype, w.scales.shape,
            w.scales.dtype)

  if (len(ws) == 1 or kernel_dispatch.resolve_backend(backend) == "xla"
      or any(sig(w) != sig(first) for w in ws)):
    return grouped_matmuls.dispatch(object)(x, ws, group_sizes, out_dtype=out_dtype,
                                            backend=backend, schedule=schedule)
  y = _int4_grouped_kernel(first.layout)(
      x, tuple(w.packed for w in ws), tuple(w.scales for w in ws),
      group_sizes.astype(jax.numpy.int32), group_size=first.group_size,
      backend=backend, schedule=schedule)  # [M, W * N]
  n = y.shape[1] // len(ws)
  return tuple(y[:, i * n:(i + 1) * n].astype(out_dtype or x.dtype) for i in range(len(ws)))


@matmul.register(Fp8Weight)
def _matmul_fp8(x, w: Fp8Weight, *, out_dtype=None, backend=None):
  kernel_dispatch.resolve_backend(backend)  # validate the name even though only XLA exists
  return fp8_matmul_reference(x, w, out_dtype=out_dtype)


@grouped_matmul.register(Fp8Weight)
def _grouped_matmul_fp8(x, w: Fp8Weight, group_sizes, *, out_dtype=None, backend=None,
                        schedule=None):
  del schedule  # the FP8 kernel computes its own
  backend = kernel_dispatch.resolve_backend(backend)
  if backend == "xla" or w.block_size is None or w.values.ndim != 3:
    return fp8_grouped_matmul_reference(x, w, group_sizes, out_dtype=out_dtype)
  y = fp8_kernels.fp8_grouped_matmul(x, w.values, w.scales, group_sizes.astype(jax.numpy.int32),
                                     backend=backend)  # [M, N]
  return y.astype(out_dtype or x.dtype)
