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

# Matmuls of a decode step's few rows (at most ROUTER_SPLIT_MAX_N) of a wide model (D
# from ROUTER_SPLIT_MIN_D) run on the kernel backends as ROUTER_SPLITS partial sums over
# slices of D, which the kernel after them adds (:func:`decode_splits`): the router's
# logits (the expert-choice kernel) and the shared expert's gate and up (swiglu_parts).
# At N = 64 and D = 7,168 XLA's GPU compiler (with its default configs, no autotuning)
# splits such a matmul's K itself and adds the parts in a launch of their own; it still
# does at 8 slices (896 each), not at 16. A prefill's matmul has rows enough not to be
# split, and its partials would be 16 [N, E] f32 arrays.
ROUTER_SPLITS = 16
ROUTER_SPLIT_MIN_D = 2048
ROUTER_SPLIT_MAX_N = 1024

# The widest FFN (F, the gate's and the up's columns) whose gate and up matmuls run as
# split-K parts. Kimi K2.6's and GLM 5.2's shared expert (F = 2,048, 256 columns a device
# under 8-way tensor parallelism) is split over K by XLA itself; Kimi's dense FFN
# (F = 18,432: 2,304 a device) is not, and as parts it would write 16 x 64 x 2 x 2,304
# f32 per device (19 MB) where its GEMM writes 0.6 MB of bf16.
SWIGLU_SPLIT_MAX_F = 4096


def decode_splits(n: int, d: int, backend: str | None) -> int:
  """How many partial sums over slices of D a matmul of n rows of width d runs as on
  ``backend`` (0: as one matmul): ROUTER_SPLITS on the kernel backends for a decode
  step's rows of a wide model."""
  if (kernel_dispatch.resolve_backend(backend) != "xla" and 1 <= n <= ROUTER_SPLIT_MAX_N
      and d >= ROUTER_SPLIT_MIN_D and d % ROUTER_SPLITS == 0):
    return ROUTER_SPLITS
  return 0


def _gate_up_splits(p: dict, x: jax.Array, backend: str | None) -> int:
  """How many split-K parts the gate and up matmuls run as (0: as plain matmuls):
  :func:`decode_splits`, for plain (unquantised) weights and F up to SWIGLU_SPLIT_MAX_F.
  XLA's merged gate/up GEMM, split over K by XLA itself, adds its parts in two launches
  (one per half), where ``swiglu_parts`` adds them and applies the SwiGLU in one
  (docs/swiglu.md).
  """
  plain = all(isinstance(p[k], (jax.Array, np.ndarray)) for k in ("w_gate", "w_up"))
  if not plain or p["w_gate"].shape[-1] > SWIGLU_SPLIT_MAX_F:
    return 0
  return decode_splits(math.prod(x.shape[:-1]), x.shape[-1], backend)


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
