"""Sharding: meshes, rules, quantised-weight placement, and sharded == unsharded model outputs."""

import dataclasses
import functools
import os
import socket

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import TINY_GQA, TINY_MLA
from mlkit import kvcache as kvc
from mlkit import model
from mlkit import parallel
from mlkit.quant import (INT4_EXPERTS, Int4Weight, dequantize, fp8_all, quantize_fp8,
                         quantize_int4, quantize_params)
from host_data import put
from empty_kv import empty_pool_np
from two_processes import two_processes
from numpy_params import init_params_np  # noqa: F401  (also imported from here by other tests)

PAGE = 4
NUM_PAGES = 8
MAX_PAGES = 4
T = 6


def _np_int4(packed, scales, group):
  """Dense [..., K, N] from int4 packed [..., K//2, N] and scales [..., K//g, N], in numpy."""
  b = np.asarray(packed).astype(np.int16)
  lo, hi = b & 0xF, b >> 4
  lo, hi = np.where(lo > 7, lo - 16, lo), np.where(hi > 7, hi - 16, hi)
  q = np.stack([lo, hi], axis=-2).reshape(b.shape[:-2] + (2 * b.shape[-2], b.shape[-1]))
  return q * np.repeat(np.asarray(scales, np.float32), group, axis=-2)


def _np_fp8_blocks(values, scales, block):
  """Dense [K, N] from fp8 values and 128x128 block scales, in numpy."""
  v = np.asarray(values).astype(np.float32)
  s = np.repeat(np.repeat(np.asarray(scales, np.float32), block, 0), block, 1)
  return v * s[:v.shape[0], :v.shape[1]]


def _spec_of(x):
  return x.sharding.spec


# The quantisers and their inverse as one program each (per shape): run eagerly, each of
# their operations compiles on its own. The tests compare what they place and read back
# against these same results.
_quantize_int4 = jax.jit(quantize_int4, static_argnums=1)
_quantize_fp8 = jax.jit(quantize_fp8, static_argnums=1)
_dequantize = jax.jit(dequantize, static_argnums=1)
_quantize_params = jax.jit(quantize_params, static_argnums=1)


@functools.partial(jax.jit, static_argnames=("cfg", "decode_sharding"),
                   donate_argnames=("state",))
def _prefill_decode(params, state, tokens, positions, meta1, dec_tokens, dec_positions, meta2, *,
                    cfg, decode_sharding=None):
  """A prefill chunk and one decode step through the paged cache."""
  l1, state = model.apply(params, tokens, positions, state, cfg=cfg, batch_meta=meta1)
  l2, state = model.apply(params, dec_tokens, dec_positions, state, cfg=cfg, batch_meta=meta2,
                          decode_sharding=decode_sharding)
  return l1, l2, state


def _run_paged(params, cfg, kv_dtype, mesh=None, data_parallel=False):
  """Prefills two ragged requests and decodes one token each; returns (prefill, decode)
  logits, the state and the decode step's DecodeSharding (None off a mesh)."""
  alloc = kvc.PageAllocator(NUM_PAGES, PAGE)
  alloc.admit("a", T)
  alloc.admit("b", T - 2)
  meta1 = alloc.batch_meta(["a", "b"], max_pages=MAX_PAGES)
  alloc.extend("a", T + 1)
  alloc.extend("b", T - 1)
  meta2 = alloc.batch_meta(["a", "b"], max_pages=MAX_PAGES)
  # The pool and the inputs made on the host (eager zeros and casts each compile a program).
  state = empty_pool_np(cfg, kvc.KVCacheConfig(NUM_PAGES, PAGE, kv_dtype))
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, cfg.vocab_size, (2, T)).astype(np.int32)
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T)).copy()
  dec_tokens = rng.integers(0, cfg.vocab_size, (2, 1)).astype(np.int32)
  dec_positions = np.asarray([[T], [T - 2]], np.int32)
  if mesh is not None:
    # Placed from host copies: device_put slices numpy on the host, where a single-device
    # jax.Array would compile a slicing program per leaf shape.
    params = parallel.shard_params(jax.tree_util.tree_map(np.asarray, params), mesh)
    state = parallel.shard_kv_state(state, mesh, data_parallel=data_parallel)
    tokens, positions, dec_tokens, dec_positions, meta1, meta2 = parallel.replicate(
        (tokens, positions, dec_tokens, dec_positions, meta1, meta2), mesh)
  else:
    state, tokens, positions, dec_tokens, dec_positions = jax.tree_util.tree_map(
        put, (state, tokens, positions, dec_tokens, dec_positions))
  ds = parallel.decode_sharding(params, state)
  l1, l2, state = _prefill_decode(params, state, tokens, positions, meta1, dec_tokens,
                                  dec_positions, meta2, cfg=cfg, decode_sharding=ds)
  return np.asarray(l1), np.asarray(l2), state, ds


class MeshTest(parameterized.TestCase):

  def test_make_mesh_axes_and_sizes(self):
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, tensor=2, expert=2))
    self.assertEqual(mesh.axis_names, ("data", "tensor", "expert"))
    self.assertEqual(dict(mesh.shape), {"data": 2, "tensor": 2, "expert": 2})
    self.assertEqual(mesh.devices.size, 8)
    default = parallel.make_mesh()
    self.assertEqual(dict(default.shape), {"data": 1, "tensor": 8, "expert": 1})

  def test_make_mesh_wrong_device_count_raises(self):
    with self.assertRaisesRegex(ValueError, "needs 4 devices, got 8"):
      parallel.make_mesh(parallel.MeshConfig(tensor=4))

  def test_split_mesh_is_disjoint(self):
    a, b = parallel.split_mesh([parallel.MeshConfig(tensor=2, expert=2),
                                parallel.MeshConfig(tensor=4)])
    da, db = set(a.devices.flat), set(b.devices.flat)
    self.assertLen(da, 4)
    self.assertLen(db, 4)
    self.assertEmpty(da & db)

  def test_split_mesh_too_many_devices_raises(self):
    with self.assertRaisesRegex(ValueError, "need 10 devices"):
      parallel.split_mesh([parallel.MeshConfig(tensor=8), parallel.MeshConfig(tensor=2)])

  @parameterized.parameters("data", "tensor", "expert")
  def test_mesh_config_validation_names_field(self, field):
    with self.assertRaisesRegex(ValueError, f"MeshConfig.{field}"):
      parallel.MeshConfig(**{field: 0})

  def test_for_devices(self):
    self.assertEqual(parallel.MeshConfig.for_devices(8, expert=2).shape, (1, 4, 2))
    with self.assertRaisesRegex(ValueError, "must divide"):
      parallel.MeshConfig.for_devices(6, expert=4)

  def test_rules_validation_names_field(self):
    with self.assertRaisesRegex(ValueError, "ShardingRules.heads"):
      parallel.ShardingRules(heads="model")
    self.assertIn(("experts", "expert"), parallel.DEFAULT_RULES.as_rules())


class ParamSpecTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = parallel.make_mesh(parallel.MeshConfig(data=1, tensor=4, expert=2))

  def test_dense_layout(self):
    params = jax.eval_shape(lambda: init_params_np(TINY_MLA))
    specs = parallel.param_partition_specs(params, self.mesh)
    attn, moe = specs["layers"][1]["attn"], specs["layers"][1]["ffn"]
    self.assertEqual(attn["wq_b"], P(None, "tensor"))
    self.assertEqual(attn["wkv_b"], P(None, "tensor"))
    self.assertEqual(attn["wo"], P("tensor", None))
    self.assertEqual(attn["wq_a"], P(None, None))  # low-rank down projections replicated
    self.assertEqual(attn["wkv_a"], P(None, None))
    self.assertEqual(moe["w_gate"], P("expert", None, None))
    self.assertEqual(moe["w_down"], P("expert", None, None))
    self.assertEqual(moe["router"], P(None, None))
    self.assertEqual(moe["shared"]["w_up"], P(None, "tensor"))
    self.assertEqual(moe["shared"]["w_down"], P("tensor", None))
    self.assertEqual(specs["layers"][0]["ffn"]["w_gate"], P(None, "tensor"))
    self.assertEqual(specs["embed"], P("tensor", None))
    gqa = parallel.param_partition_specs(jax.eval_shape(lambda: init_params_np(TINY_GQA)),
                                         self.mesh)
    self.assertEqual(gqa["layers"][0]["attn"]["wk"], P(None, "tensor"))

  def test_heads_and_experts_stay_whole_with_cfg(self):
    # TINY_MLA has 4 heads and 8 experts: on 8-way tensor x 1 expert the head columns
    # (4 * 24 = 96) split evenly but would cut heads; with the config they stay whole.
    mesh = parallel.make_mesh(parallel.MeshConfig(tensor=8))
    params = jax.eval_shape(lambda: init_params_np(TINY_MLA))
    blind = parallel.param_partition_specs(params, mesh)
    aware = parallel.param_partition_specs(params, mesh, cfg=TINY_MLA)
    self.assertEqual(blind["layers"][1]["attn"]["wq_b"], P(None, "tensor"))
    self.assertEqual(aware["layers"][1]["attn"]["wq_b"], P(None, None))
    self.assertEqual(aware["layers"][1]["ffn"]["shared"]["w_up"], P(None, "tensor"))  # not heads
    four = parallel.make_mesh(parallel.MeshConfig(tensor=4), jax.devices()[:4])
    aware4 = parallel.param_partition_specs(params, four, cfg=TINY_MLA)
    self.assertEqual(aware4["layers"][1]["attn"]["wq_b"], P(None, "tensor"))
    self.assertEqual(parallel.model_counts(TINY_GQA)["kv_heads"], 2)

  def test_indivisible_axis_is_replicated(self):
    mesh = parallel.make_mesh(parallel.MeshConfig(tensor=8))
    # 2 KV heads * 16 = 32 columns split 8 ways is fine; 7 columns are not.
    spec = parallel.leaf_partition_spec(jax.ShapeDtypeStruct((64, 7), jnp.float32),
                                        (None, "heads"), parallel.DEFAULT_RULES, mesh)
    self.assertEqual(spec, P(None, None))

  @parameterized.parameters((4, "tensor"), (8, None))
  def test_int4_k_split_only_on_group_boundaries(self, tensor, want):
    # Experts [E=2, K=128, N=16] with group 32: 4 groups split 4 ways, not 8 ways.
    mesh = parallel.make_mesh(parallel.MeshConfig(tensor=tensor), jax.devices()[:tensor])
    rules = parallel.ShardingRules(expert_mlp="tensor")
    w = put(np.random.default_rng(0).standard_normal((2, 128, 16)).astype(np.float32))
    q = _quantize_int4(w, 32)
    spec = parallel.leaf_partition_spec(q, ("experts", "expert_mlp", None), rules, mesh)
    self.assertIsInstance(spec, Int4Weight)
    self.assertEqual(spec.packed, spec.scales)
    self.assertEqual(spec.packed, P(None, want, None))
    placed = jax.device_put(q, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec,
                                                      is_leaf=lambda s: isinstance(s, P)))
    dense = np.asarray(_dequantize(q, jnp.float32))
    rows = 128 // (tensor if want else 1)
    for ps, ss in zip(placed.packed.addressable_shards, placed.scales.addressable_shards):
      # The scale shard starts at the group the packed shard starts in.
      self.assertEqual((ss.index[1].start or 0) * 32, (ps.index[1].start or 0) * 2)
      self.assertEqual(ps.data.shape, (2, rows // 2, 16))
      self.assertEqual(ss.data.shape, (2, rows // 32, 16))
      # Each shard's packed rows and scale rows describe the same input rows.
      local = _np_int4(ps.data, ss.data, 32)
      k0 = (ps.index[1].start or 0) * 2
      np.testing.assert_array_equal(local, dense[:, k0:k0 + rows])

  def test_fp8_block_scales_split_with_values(self):
    mesh = parallel.make_mesh(parallel.MeshConfig(tensor=4), jax.devices()[:4])
    w = put(np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32))
    q = _quantize_fp8(w, 128)
    spec = parallel.leaf_partition_spec(q, (None, "heads"), parallel.DEFAULT_RULES, mesh)
    self.assertEqual((spec.values, spec.scales), (P(None, "tensor"), P(None, "tensor")))
    shard = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec,
                                   is_leaf=lambda s: isinstance(s, P))
    placed = jax.device_put(q, shard)
    dense = np.asarray(_dequantize(q, jnp.float32))
    for vs, ss in zip(placed.values.addressable_shards, placed.scales.addressable_shards):
      self.assertEqual(vs.data.shape, (256, 128))
      self.assertEqual(ss.data.shape, (2, 1))
      n0 = vs.index[1].start or 0
      local = _np_fp8_blocks(vs.data, ss.data, 128)
      np.testing.assert_array_equal(local, dense[:, n0:n0 + 128])
    # 512 columns in 8 shards would cut 128-column scale blocks: replicated instead.
    spec8 = parallel.leaf_partition_spec(q, (None, "heads"), parallel.DEFAULT_RULES,
                                         parallel.make_mesh(parallel.MeshConfig(tensor=8)))
    self.assertEqual(spec8.values, P(None, None))

  def test_fp8_per_channel_scales_follow_columns(self):
    mesh = parallel.make_mesh(parallel.MeshConfig(tensor=8))
    q = _quantize_fp8(np.ones((16, 64), np.float32), None)
    spec = parallel.leaf_partition_spec(q, ("heads", None), parallel.DEFAULT_RULES, mesh)
    self.assertEqual((spec.values, spec.scales), (P("tensor", None), P(None)))
    spec = parallel.leaf_partition_spec(q, (None, "heads"), parallel.DEFAULT_RULES, mesh)
    self.assertEqual((spec.values, spec.scales), (P(None, "tensor"), P("tensor")))


class KVStateSpecTest(parameterized.TestCase):

  def test_mla_pages_replicated_across_tensor(self):
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2, tensor=4))
    state = empty_pool_np(TINY_MLA, kvc.KVCacheConfig(NUM_PAGES, PAGE, "float8_e4m3fn"))
    placed = parallel.shard_kv_state(state, mesh)
    for x in jax.tree_util.tree_leaves(placed):
      self.assertTrue(x.sharding.is_fully_replicated)
    dp = parallel.shard_kv_state(state, mesh, data_parallel=True)
    self.assertEqual(_spec_of(dp.layers[0]["latent"]), P("data", None, None))
    self.assertEqual(_spec_of(dp.layers[0]["latent_scale"]), P("data", None))
    self.assertEqual(dp.layers[0]["latent"].addressable_shards[0].data.shape[0], NUM_PAGES // 2)
    self.assertTrue(dp.page_tags.sharding.is_fully_replicated)

  def test_gqa_pages_split_over_kv_heads(self):
    mesh = parallel.make_mesh(parallel.MeshConfig(data=4, tensor=2))
    state = empty_pool_np(TINY_GQA, kvc.KVCacheConfig(NUM_PAGES, PAGE, "float8_e4m3fn"))
    placed = parallel.shard_kv_state(state, mesh)
    self.assertEqual(_spec_of(placed.layers[0]["k"]), P(None, None, "tensor", None))
    self.assertEqual(_spec_of(placed.layers[0]["v_scale"]), P(None, None, "tensor"))
    self.assertEqual(placed.layers[0]["k"].addressable_shards[0].data.shape[2], 1)
    dp = parallel.shard_kv_state(state, mesh, data_parallel=True)
    self.assertEqual(_spec_of(dp.layers[0]["k"]), P("data", None, "tensor", None))

  def test_data_parallel_indivisible_pages_raises(self):
    mesh = parallel.make_mesh(parallel.MeshConfig(data=8))
    state = empty_pool_np(TINY_MLA, kvc.KVCacheConfig(6, PAGE, "float32"))
    with self.assertRaisesRegex(ValueError, "6 pages do not split"):
      parallel.shard_kv_state(state, mesh, data_parallel=True)


def _bf16(cfg):
  return dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")


def _one_moe_layer(cfg):
  # One MoE layer has every sharded kind of weight (attention, shared expert = dense FFN
  # layout, routed experts); compiles dominate the time and scale with the layer count.
  return dataclasses.replace(cfg, n_layers=1, first_k_dense=0)


class ShardedEqualsUnshardedTest(parameterized.TestCase):
  """Model outputs on an 8-device mesh equal the 1-device outputs."""

  # The bf16 case also carries int4 experts and an fp8 cache, so one compile covers both.
  @parameterized.named_parameters(
      ("mla_f32_dp_attention", _one_moe_layer(TINY_MLA), None, "float32", (2, 2, 2), True),
      ("mla_bf16_int4_experts_fp8_kv", _bf16(_one_moe_layer(TINY_MLA)), INT4_EXPERTS,
       "float8_e4m3fn", (1, 4, 2), False),
      ("gqa_fp8_weights", _one_moe_layer(TINY_GQA), fp8_all(None), "float32", (1, 2, 4), False),
  )
  def test_prefill_and_decode_match(self, cfg, recipe, kv_dtype, shape, data_parallel):
    params = init_params_np(cfg)
    if recipe is not None:
      params = _quantize_params(params, recipe)
    mesh = parallel.make_mesh(parallel.MeshConfig(*shape))
    ref1, ref2, _, none = _run_paged(params, cfg, kv_dtype)
    got1, got2, state, ds = _run_paged(params, cfg, kv_dtype, mesh, data_parallel)
    self.assertIsNone(none)
    # The decode step's attention ran per device on its heads (shard_map over the
    # tensor axis), except under data-parallel attention, whose pages are split.
    if data_parallel:
      self.assertIsNone(ds)
    else:
      self.assertEqual(ds.heads, "tensor")
      self.assertEqual(dict(ds.pages)[state.names[0]],
                       P(None, None, "tensor", None) if cfg.attention == "gqa" else P(None, None, None))
    # The state stayed on the mesh with the layout asked for.
    self.assertEqual(set(state.layers[0][state.names[0]].sharding.device_set),
                     set(mesh.devices.flat))
    tol = 1e-2 if cfg.dtype == "bfloat16" else 1e-5
    # Request b's prefill chunk has T - 2 live positions; its padded ones are garbage in both runs.
    for ref, got, live_b in ((ref1, got1, T - 2), (ref2, got2, 1)):
      self.assertTrue(np.isfinite(got[0]).all() and np.isfinite(got[1, :live_b]).all())
      np.testing.assert_allclose(got[0], ref[0], atol=tol, rtol=tol)
      np.testing.assert_allclose(got[1, :live_b], ref[1, :live_b], atol=tol, rtol=tol)


class DecodeShardingTest(absltest.TestCase):
  """parallel.decode_sharding: when the step runs paged decode attention per device."""

  def _placed(self, cfg, tensor):
    mesh = parallel.make_mesh(parallel.MeshConfig(tensor=tensor), jax.devices()[:tensor])
    params = parallel.abstract_params(cfg, None, mesh)
    state = parallel.abstract_kv_state(cfg, kvc.KVCacheConfig(NUM_PAGES, PAGE), mesh)
    return params, state

  def test_per_device_heads_only_where_the_pages_allow(self):
    params, state = self._placed(TINY_MLA, 4)
    ds = parallel.decode_sharding(params, state)
    self.assertEqual((ds.heads, dict(ds.pages)["latent"]), ("tensor", P(None, None, None)))
    # GQA: 4 query heads over 4 devices, but 2 KV heads cannot split 4 ways, so a
    # device's query head would not find its KV head: one call on whole arrays.
    params, state = self._placed(TINY_GQA, 4)
    self.assertIsNone(parallel.decode_sharding(params, state))
    params, state = self._placed(TINY_GQA, 2)
    self.assertEqual(dict(parallel.decode_sharding(params, state).pages)["k"],
                     P(None, None, "tensor", None))
    # Unplaced (host) params, or no state: nothing to split.
    self.assertIsNone(parallel.decode_sharding(init_params_np(TINY_MLA), state))
    self.assertIsNone(parallel.decode_sharding(params, None))


class DataParallelAttentionWarningTest(absltest.TestCase):
  """An engine with data-parallel attention on a kernel backend says that the decode
  kernel gathers the pool; on the XLA path (which XLA partitions) it says nothing."""

  def test_warns_only_for_the_kernels(self):
    from absl import logging as absl_logging
    from mlkit.engine import Engine, EngineConfig
    mesh = parallel.make_mesh(parallel.MeshConfig(data=2), jax.devices()[:2])
    params = init_params_np(TINY_MLA)

    def build(backend):
      cfg = EngineConfig(model=TINY_MLA, kv=kvc.KVCacheConfig(8, PAGE), max_running=2,
                         batch_buckets=(2,), prefill_buckets=(8,), prefill_token_budget=16,
                         max_pages_per_seq=4, backend=backend)
      Engine(params, cfg, mesh=mesh, data_parallel_attention=True)

    with self.assertLogs(absl_logging.get_absl_logger(), "WARNING") as logs:
      build("interpret")
    self.assertTrue(any("gathers the whole page pool" in m for m in logs.output), logs.output)
    with self.assertNoLogs(absl_logging.get_absl_logger(), "WARNING"):
      build("xla")

  def test_xla_path_does_not_gather_the_pool(self):
    """The XLA reference's page gather is partitioned by XLA: a decode step with the pool
    split over 8 devices compiles with no all-gather."""
    cfg = _one_moe_layer(TINY_MLA)
    mesh = parallel.make_mesh(parallel.MeshConfig(data=8))
    pages, batch = 64, 8
    params = parallel.shard_params(init_params_np(cfg), mesh)
    state = parallel.shard_kv_state(empty_pool_np(cfg, kvc.KVCacheConfig(pages, PAGE, "float32")),
                                    mesh, data_parallel=True)
    alloc = kvc.PageAllocator(pages, PAGE)
    for i in range(batch):
      alloc.admit(i, 3 * PAGE)
    meta = alloc.batch_meta(list(range(batch)), max_pages=4)
    tokens = np.zeros((batch, 1), np.int32)  # the test reads the compiled HLO only
    positions = np.full((batch, 1), 3 * PAGE, np.int32)
    tokens, positions, meta = parallel.replicate((tokens, positions, meta), mesh)
    step = jax.jit(functools.partial(model.apply, cfg=cfg, backend="xla"))
    hlo = step.lower(params, tokens, positions, state, batch_meta=meta).compile().as_text()
    self.assertEqual(state.layers[0]["latent"].sharding.spec[0], "data")
    # (Membership checked as booleans: a failure would otherwise print the whole HLO.)
    self.assertFalse("all-gather" in hlo, "the step gathers")
    # No array of the whole pool's page count exists on a device: each holds 8 of 64.
    self.assertTrue(f"[{pages // 8},{PAGE}," in hlo, "no per-device pages in the step")
    self.assertFalse(f"[{pages},{PAGE}," in hlo, "a device holds the whole pool")


class MultiProcessTest(absltest.TestCase):
  """Two processes on this machine serve as one pool (gloo collectives): process 0 leads,
  process 1 repeats its device operations (mlkit.engine.lockstep)."""

  TIMEOUT_S = 240

  def test_two_process_pool_serves_like_one_process(self):
    import multihost_worker
    with socket.socket() as s:  # a free port for the pool's own channel
      s.bind(("127.0.0.1", 0))
      pool_port = s.getsockname()[1]
    with two_processes(self, multihost_worker.__file__, args=("--pool_port", str(pool_port)),
                       timeout_s=self.TIMEOUT_S) as out:
      got = dict(np.load(os.path.join(out, "leader.npz")))
      follower = dict(np.load(os.path.join(out, "follower_1.npz")))
    self.assertEqual(int(got["num_devices"]), 4)
    self.assertGreater(int(follower["ops"]), 10)  # it ran the steps, not nothing
    self.assertTrue(bool(follower["stopped"]))  # told to stop by its leader
    # The same engine on a 4-device mesh of this process.
    ref = multihost_worker.run_scenario(parallel.make_mesh(parallel.MeshConfig(tensor=2, expert=2),
                                                           jax.devices()[:4]))
    self.assertGreater(int(ref["prefill_tokens_saved"]), 0)  # the prefix cache shared pages
    self.assertEqual(int(got["prefill_tokens_saved"]), int(ref["prefill_tokens_saved"]))
    for i in range(3):
      np.testing.assert_array_equal(got[f"tok{i}"], ref[f"tok{i}"])
      np.testing.assert_allclose(got[f"logits{i}"], ref[f"logits{i}"], atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
