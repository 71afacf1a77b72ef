"""Small shared layers: RMSNorm and the SwiGLU FFN."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.quant import matmul
from pallas_kernels import dispatch as kernel_dispatch
from pallas_kernels.residual_norm.reference import rms_norm  # noqa: F401  (the one definition)
from pallas_kernels.swiglu import swiglu_parts

# The widest FFN (F, the gate's and the up's columns) whose gate and up matmuls run as
# split-K parts (_gate_up_splits). Kimi K2.6's and GLM 5.2's shared expert (F = 2,048,
# 256 columns a device under 8-way tensor parallelism) is split over K by XLA itself;
# Kimi's dense FFN (F = 18,432: 2,304 a device) is not, and as parts it would write 16 x
# 64 x 2 x 2,304 f32 per device (19 MB) where its GEMM writes 0.6 MB of bf16.
SWIGLU_SPLIT_MAX_F = 4096


def _gate_up_splits(p: dict, x: jax.Array, backend: str | None) -> int:
  """How many split-K parts the gate and up matmuls run as (0: as plain matmuls).

  On the kernel backends, for a decode step's few rows of a wide model, plain
  (unquantised) weights and F up to SWIGLU_SPLIT_MAX_F, as many as the router's matmul
  runs as, within its bounds (``mlkit.model.moe.ROUTER_SPLITS``, whose comment explains
  the count): XLA's GPU compiler splits such a matmul over K itself and adds the parts
  in launches of its own, two for the gate and up halves of its merged GEMM, where
  ``swiglu_parts`` adds them and applies the SwiGLU in one (docs/swiglu.md).
  """
  from mlkit.model import moe  # moe imports this module
  n, d = math.prod(x.shape[:-1]), x.shape[-1]
  plain = all(isinstance(p[k], (jax.Array, np.ndarray)) for k in ("w_gate", "w_up"))
  if (plain and kernel_dispatch.resolve_backend(backend) != "xla"
      and p["w_gate"].shape[-1] <= SWIGLU_SPLIT_MAX_F
      and 1 <= n <= moe.ROUTER_SPLIT_MAX_N and d >= moe.ROUTER_SPLIT_MIN_D
      and d % moe.ROUTER_SPLITS == 0):
    return moe.ROUTER_SPLITS
  return 0


def swiglu(p: dict, x: jax.Array, *, backend: str | None = None, out_dtype=None) -> jax.Array:
  """Dense SwiGLU FFN: w_down(silu(w_gate x) * w_up x). x [..., D] -> [..., D] in
  ``out_dtype`` (default x's).

  On the kernel backends, with a decode step's rows (:func:`_gate_up_splits`), the gate
  and up matmuls run as S partial sums over slices of D, f32 [S, N, F] each, which XLA
  computes in one GEMM, and ``pallas_kernels.swiglu.swiglu_parts`` adds them and applies
  the SwiGLU in one launch, with the roundings of the plain expression.
  """
  splits = _gate_up_splits(p, x, backend)
  if splits:
    lead, d = x.shape[:-1], x.shape[-1]
    xs = x.reshape(-1, splits, d // splits)  # [N, S, D/S]

    def parts(w):  # [S, N, F] f32
      return jnp.einsum("nsd,sdf->snf", xs, w.astype(x.dtype).reshape(splits, d // splits, -1),
                        preferred_element_type=jnp.float32)

    h = swiglu_parts(parts(p["w_gate"]), parts(p["w_up"]), dtype=x.dtype, backend=backend)
    h = h.reshape(*lead, h.shape[-1])
  else:
    h = (jax.nn.silu(matmul(x, p["w_gate"], backend=backend))
         * matmul(x, p["w_up"], backend=backend))
  return matmul(h, p["w_down"], backend=backend, out_dtype=out_dtype)
