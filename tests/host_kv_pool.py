"""An empty paged KV pool (``kvc.init_paged_state``) built in one program per configuration.

Run eagerly, ``init_paged_state`` compiles a program for each entry's zeros and each fp8
scale's ones, per shape and dtype; jitted whole, one program builds the pool. The values
are the library's own (zero pages and tags, unit fp8 scales), not a copy of them here.
"""

import functools

import jax

from mlkit import kvcache as kvc


@functools.partial(jax.jit, static_argnums=(0, 1))
def empty_pool(cfg, kv_cfg) -> kvc.PagedKVState:
  """``kvc.init_paged_state(cfg, kv_cfg)`` in one program (cached per configuration)."""
  return kvc.init_paged_state(cfg, kv_cfg)


def empty_pool_np(cfg, kv_cfg) -> kvc.PagedKVState:
  """:func:`empty_pool` copied to the host, for placing on a mesh: device_put slices numpy
  on the host, where a single-device jax.Array would compile a slicing program per leaf
  shape."""
  return jax.device_get(empty_pool(cfg, kv_cfg))
