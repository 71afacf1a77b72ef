"""An empty paged KV pool made on the host (tests/host_data.py says why).

``kvc.init_paged_state`` builds each entry with ``jnp.zeros`` / ``jnp.ones``, and run
eagerly each compiles a program per shape and dtype. The same pool is made here in numpy
(zero pages and tags, unit fp8 scales), its shapes and dtypes read from the library's own
``init_paged_state`` traced abstractly (``jax.eval_shape`` compiles nothing).
"""

import jax
import numpy as np

from mlkit import kvcache as kvc
from host_data import put


def empty_pool_np(cfg, kv_cfg) -> kvc.PagedKVState:
  """``kvc.init_paged_state(cfg, kv_cfg)``'s values as a PagedKVState of numpy arrays."""
  shapes = jax.eval_shape(lambda: kvc.init_paged_state(cfg, kv_cfg))

  def fill(name, s):
    return (np.ones if name.endswith("_scale") else np.zeros)(s.shape, s.dtype)

  return shapes.replace(layers=[{k: fill(k, s) for k, s in layer.items()} for layer in shapes.layers],
                        page_tags=fill("page_tags", shapes.page_tags))


def empty_pool(cfg, kv_cfg) -> kvc.PagedKVState:
  """``kvc.init_paged_state(cfg, kv_cfg)`` made on the host and placed with put: no program."""
  return jax.tree_util.tree_map(put, empty_pool_np(cfg, kv_cfg))
