"""Random int4 test operands made on the host, for the int4 kernel tests.

Packing, the [N, K] relayout and the casts are done in numpy and the results placed
with ``host_data.put``, which compiles no XLA program; made with eager jnp operations,
each would compile one program per operation and shape. The layouts are those of
``pallas_kernels.int4_matmul`` (docs/int4_matmul.md), whose own functions the
reference tests check against these.
"""

import jax.numpy as jnp
import numpy as np


def pack(q):
  """``pack_int4`` in numpy: int [..., K, N] in [-8, 7] -> uint8 [..., K//2, N], byte
  row i holding rows 2i (low nibble) and 2i+1 (high nibble)."""
  q = np.asarray(q, np.int8).view(np.uint8) & 0x0F
  return q[..., 0::2, :] | (q[..., 1::2, :] << 4)


def to_nk(q):
  """``to_nk`` of ``pack(q)`` in numpy: int [..., K, N] -> int4 [..., N, K]."""
  return np.swapaxes(np.asarray(q, np.int8), -1, -2).astype(jnp.int4)


def draw(seed, m, k, n, group_size, *, experts=None, scale_dtype=jnp.bfloat16,
         x_dtype=jnp.bfloat16):
  """Fresh random numpy operands: x [M, K] (bf16 values, in ``x_dtype``), int4 codes
  q [(E,) K, N] int8, and scales [(E,) K//g, N] in ``scale_dtype`` that vary by group
  and column (so a misplaced scale row fails)."""
  rng = np.random.default_rng(seed)
  lead = () if experts is None else (experts,)
  x = np.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16).astype(x_dtype)
  q = rng.integers(-8, 8, lead + (k, n), dtype=np.int8)
  s = rng.uniform(0.25, 2.0, lead + (k // group_size, n)).astype(np.float32) / 16
  return x, q, s.astype(scale_dtype)

