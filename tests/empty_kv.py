"""Empty KV caches built in one program per configuration: the paged pool
(``kvc.init_paged_state``) and the contiguous cache (``model.init_cache``).

Run eagerly, each compiles a program for every entry's zeros (and each fp8 scale's ones),
per shape and dtype; jitted whole, one program builds the cache. The values are the
library's own, not a copy of them here.
"""

import functools

import jax

from mlkit import kvcache as kvc
from mlkit import model


@functools.partial(jax.jit, static_argnums=(0, 1))
def empty_pool(cfg, kv_cfg) -> kvc.PagedKVState:
  """``kvc.init_paged_state(cfg, kv_cfg)`` in one program (cached per configuration)."""
  return kvc.init_paged_state(cfg, kv_cfg)


def empty_pool_np(cfg, kv_cfg) -> kvc.PagedKVState:
  """:func:`empty_pool` copied to the host, for placing on a mesh: device_put slices numpy
  on the host, where a single-device jax.Array would compile a slicing program per leaf
  shape."""
  return jax.device_get(empty_pool(cfg, kv_cfg))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def empty_cache(cfg, batch: int, max_len: int):
  """``model.init_cache(cfg, batch, max_len)`` in one program (cached per configuration)."""
  return model.init_cache(cfg, batch, max_len)
