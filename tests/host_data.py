"""Test data made on the host and placed without compiling.

In this jax version an eager jnp operation on test data (a cast, fill, scatter,
``jax.nn.softmax``, even ``jnp.asarray`` of a numpy array) compiles a small XLA
program per operation and shape; tests make their inputs in numpy instead, cast
them there (ml_dtypes rounds to nearest even, as XLA does) and place them with
``put`` (``jax.device_put``), which compiles nothing (docs/testing.md).
"""

import jax
import numpy as np


def put(*arrays):
  """``jax.device_put`` of numpy arrays (already in their dtypes): no XLA program.
  One array in, one out; several in, a tuple out."""
  out = tuple(jax.device_put(a) for a in arrays)
  return out[0] if len(out) == 1 else out


def softmax(x):
  """Softmax over the last axis of a numpy array, in x's dtype: [..., V] -> [..., V]."""
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)
