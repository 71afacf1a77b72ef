"""Small device-side helpers for the kernels' work schedules (computed by XLA before a launch)."""

import jax
from jax import lax
import jax.numpy as jnp


def prefix_sum(x: jax.Array) -> jax.Array:
  """Inclusive prefix sum of a short [E] int vector as one masked [E, E] reduction.

  E is tens to a few hundred (experts on one device, requests in a batch), so
  this is one small fusion; XLA's GPU cumsum (a reduce-window) and searchsorted
  (a while loop) add several kernels per call and seconds of compile time.

  Returns:
    [E] int32.
  """
  i = lax.broadcasted_iota(jnp.int32, (x.shape[0], x.shape[0]), 0)
  j = lax.broadcasted_iota(jnp.int32, (x.shape[0], x.shape[0]), 1)
  return jnp.sum(jnp.where(j <= i, x[None, :], 0), axis=1, dtype=jnp.int32)
