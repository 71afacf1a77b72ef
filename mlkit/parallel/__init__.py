"""Sharding: named meshes, logical-axis rules, placement of params and KV state, multi-process start.

``make_mesh`` / ``split_mesh`` build meshes with axes ("data", "tensor",
"expert") (sub-meshes on disjoint devices for the prefill and decode pools);
``shard_params`` and ``shard_kv_state`` place pytrees by :class:`ShardingRules`;
``initialize_distributed`` makes the same program run over several processes.
The model and the engine run unchanged on whatever mesh their inputs live on.
"""

from mlkit.parallel.distributed import initialize_distributed, is_multiprocess
from mlkit.parallel.abstract import (abstract_kv_state, abstract_params, per_device_bytes,
                                     replicated, sharded_kv_state, with_shardings)
from mlkit.parallel.mesh import AXES, MeshConfig, axis_size, make_mesh, split_mesh
from mlkit.parallel.sharding import (DEFAULT_RULES, DecodeSharding, ShardingRules,
                                     decode_sharding, expert_sharding,
                                     kv_state_partition_specs, kv_state_shardings,
                                     leaf_partition_spec, logical_axes_for, model_counts,
                                     param_logical_axes, param_partition_specs, param_shardings, put,
                                     replicate, shard_kv_state, shard_params)

__all__ = [
    "AXES", "DEFAULT_RULES", "DecodeSharding", "MeshConfig", "ShardingRules", "abstract_kv_state",
    "abstract_params", "axis_size", "decode_sharding", "expert_sharding", "initialize_distributed",
    "is_multiprocess", "kv_state_partition_specs", "kv_state_shardings", "leaf_partition_spec",
    "logical_axes_for", "make_mesh", "model_counts", "param_logical_axes", "param_partition_specs",
    "param_shardings", "per_device_bytes", "put", "replicate", "replicated", "shard_kv_state",
    "shard_params", "sharded_kv_state", "split_mesh", "with_shardings",
]
