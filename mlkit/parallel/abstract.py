"""Shape-only, sharded stand-ins for params and KV state: compile a serving step, allocate nothing.

A 1T-parameter model cannot be instantiated on a development machine, but its
serving step can still be compiled for a real topology (e.g. 8x H200 from a
CPU host, see ``pallas_kernels.h200.compile``) when every argument is a
``jax.ShapeDtypeStruct`` that carries its sharding. These helpers build them:
params from the model's initialiser and the weight recipe's quantiser run
under ``jax.eval_shape`` (so packed int4 values, fp8 values and their scales
have exactly the shapes the real quantiser produces), the paged KV pool from
``init_paged_state``, each placed by the same logical-axis rules
``shard_params`` / ``shard_kv_state`` use for real arrays.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, NamedSharding

from mlkit.config import ModelConfig
from mlkit.kvcache import KVCacheConfig, PagedKVState, init_paged_state
from mlkit.parallel.sharding import (DEFAULT_RULES, ShardingRules, kv_state_shardings,
                                     param_shardings)
from mlkit.quant import Recipe, quantize_params
from mlkit.quant.formats import stored_nbytes


def _is_sharding(x) -> bool:
  return isinstance(x, jax.sharding.Sharding)


def with_shardings(tree, shardings):
  """``tree``'s leaves as ShapeDtypeStructs carrying the matching leaf of ``shardings``.

  Args:
    tree: arrays or ShapeDtypeStructs (quantised weights are pytrees of them).
    shardings: a tree of the same structure with a ``jax.sharding.Sharding`` per leaf.

  Returns:
    The same structure with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves.

  Raises:
    ValueError: if the two trees have different numbers of leaves.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  shard_leaves = jax.tree_util.tree_leaves(shardings, is_leaf=_is_sharding)
  if len(leaves) != len(shard_leaves):
    raise ValueError(f"sharding tree has {len(shard_leaves)} leaves, the value tree {len(leaves)}")
  return jax.tree_util.tree_unflatten(treedef, [
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) for x, s in zip(leaves, shard_leaves)])


def abstract_params(cfg: ModelConfig, recipe: Recipe | None, mesh: Mesh,
                    rules: ShardingRules = DEFAULT_RULES, *, int4_layout: str = "kn",
                    mtp=None):
  """The serving params of ``cfg`` in ``recipe``'s formats, as sharded ShapeDtypeStructs.

  Nothing is allocated: ``init_params`` and ``quantize_params`` run under
  ``jax.eval_shape``.

  Args:
    cfg: the model config (full-size presets work).
    recipe: weight formats, or None for the dense params in ``cfg.param_dtype``.
    mesh: the mesh the params would live on (a concrete or compile-only topology mesh).
    rules: logical-axis rules (heads and experts are kept whole, as ``shard_params`` with
      the config does).
    int4_layout: the int4 weights' layout ("kn" or "nk", see ``quantize_params``).
    mtp: as ``init_params``'s: None leaves the multi-token-prediction layers out; ``()``
      adds ``cfg.n_mtp_layers`` of them sharing the main model's embedding and head.

  Returns:
    The params pytree with ShapeDtypeStruct leaves carrying NamedShardings.
  """
  from mlkit.model import init_params  # model sits beside parallel; import on use

  def build():
    params = init_params(cfg, jax.random.key(0), mtp=mtp)
    return params if recipe is None else quantize_params(params, recipe,
                                                         int4_layout=int4_layout)

  shapes = jax.eval_shape(build)
  return with_shardings(shapes, param_shardings(shapes, mesh, rules, cfg))


def abstract_kv_state(cfg: ModelConfig, kv_cfg: KVCacheConfig, mesh: Mesh,
                      rules: ShardingRules = DEFAULT_RULES, *,
                      data_parallel: bool = False, draft_layers: int = 0) -> PagedKVState:
  """A paged KV pool of ``kv_cfg`` as sharded ShapeDtypeStructs (see ``kv_state_shardings``).

  ``draft_layers``: as ``init_paged_state``'s (the speculative drafter's layer).

  Raises:
    ValueError: with data_parallel, if the page count does not split over the data axis.
  """
  shapes = jax.eval_shape(lambda: init_paged_state(cfg, kv_cfg, draft_layers))
  return with_shardings(shapes, kv_state_shardings(shapes, mesh, rules,
                                                   data_parallel=data_parallel))


def sharded_kv_state(cfg: ModelConfig, kv_cfg: KVCacheConfig, mesh: Mesh,
                     rules: ShardingRules = DEFAULT_RULES, *,
                     data_parallel: bool = False, draft_layers: int = 0) -> PagedKVState:
  """An empty paged KV pool created in place on ``mesh``, sharded as ``kv_state_shardings`` says.

  The pool is built by one jitted call with those output shardings, so each
  device only ever holds its own shard: no whole pool on the default device
  first (at H200 pool sizes that transient copy alone can exceed a device).

  Raises:
    ValueError: with data_parallel, if the page count does not split over the data axis.
  """
  return _pool_builder(cfg, kv_cfg, mesh, rules, data_parallel, draft_layers)()


@functools.lru_cache(maxsize=32)
def _pool_builder(cfg: ModelConfig, kv_cfg: KVCacheConfig, mesh: Mesh, rules: ShardingRules,
                  data_parallel: bool, draft_layers: int):
  """The jitted pool constructor of one configuration and mesh, kept: every engine built
  alike (a server's restarts, pools of one shape) runs the program compiled for the first
  instead of compiling its own."""
  shardings = abstract_kv_state(cfg, kv_cfg, mesh, rules, data_parallel=data_parallel,
                                draft_layers=draft_layers)
  out = jax.tree_util.tree_map(lambda s: s.sharding, shardings)
  return jax.jit(lambda: init_paged_state(cfg, kv_cfg, draft_layers), out_shardings=out)


def replicated(shape, dtype, mesh: Mesh) -> jax.ShapeDtypeStruct:
  """A ShapeDtypeStruct replicated on every device of ``mesh`` (batch inputs of a step)."""
  return jax.ShapeDtypeStruct(tuple(shape), dtype,
                              sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))


def per_device_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs (the largest shard).

  Raises:
    ValueError: if a leaf carries no sharding.
  """
  total = 0
  for x in jax.tree_util.tree_leaves(tree):
    sharding = getattr(x, "sharding", None)
    if sharding is None:
      raise ValueError(f"per_device_bytes: a leaf of shape {x.shape} has no sharding")
    total += stored_nbytes(sharding.shard_shape(tuple(x.shape)), x.dtype)
  return total
