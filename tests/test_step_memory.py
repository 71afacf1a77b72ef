"""The serving step's memory-saving forms give the same numbers as the plain ones.

* Expert-parallel MoE dispatch (a shard_map over the experts' mesh axes) equals the
  unsharded dispatch, and gathers no expert weights.
* Attention over query blocks equals attention over the whole chunk.
* ``expert_sharding`` reads the experts' placement from placed params.
* The block-sparse grouped matmul, batched (CPU) or one block at a time (GPU
  targets, where XLA's ragged_dot expands into a dense [G, M, K] product), equals
  ragged_dot.
See docs/serving_step_memory.md.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.model import apply, attention, init_cache, init_params, masks, moe
from mlkit.model import sparse_attention as dsa
from mlkit.parallel import MeshConfig, ShardingRules, expert_sharding, make_mesh, shard_params
from mlkit.quant import INT4_EXPERTS, quantize_params
from mlkit.quant.dispatch import ragged_dot_f32
from numpy_params import init_params_np
from host_data import put

CFG = dataclasses.replace(TINY_MLA, n_routed_experts=8)
# Jitted: each runs as one compiled program per shape instead of op by op.
route = jax.jit(moe.route, static_argnums=2)
dispatch = jax.jit(moe.dispatch_experts, static_argnums=4, static_argnames="backend")


def _normal(seed, shape):
  # numpy draws placed with device_put: jax.random would compile a threefry program per
  # shape, jnp.asarray a conversion.
  return put(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


# The reference grouped matmul, one program (eagerly, its operations compile one by one).
_ragged_dot = jax.jit(functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.float32))


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class ExpertParallelTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # numpy params (init_params would compile a threefry program for the config),
    # quantised in one compiled program rather than op by op.
    cls.params = jax.jit(lambda p: quantize_params(p, INT4_EXPERTS))(init_params_np(CFG))

  @parameterized.named_parameters(
      ("expert_axis", MeshConfig(tensor=2, expert=4), ShardingRules()),
      ("tensor_axis", MeshConfig(tensor=8), ShardingRules(experts="tensor")))
  def test_sharded_dispatch_equals_unsharded(self, mesh_cfg, rules):
    mesh = make_mesh(mesh_cfg)
    placed = shard_params(self.params, mesh, rules, CFG)
    es = expert_sharding(placed)
    self.assertIsNotNone(es)
    self.assertEqual(es.mesh.shape[es.spec[0]],
                     mesh_cfg.tensor if rules.experts == "tensor" else mesh_cfg.expert)
    p, ps = self.params["layers"][1]["ffn"], placed["layers"][1]["ffn"]
    x = _normal(1, (37, CFG.d_model))
    ids, w, _ = route(p, x, CFG)
    ref = dispatch(p, x, ids, w, CFG.n_routed_experts, backend="xla")
    fn = jax.jit(lambda p, x, ids, w: moe.dispatch_experts(
        p, x, ids, w, CFG.n_routed_experts, backend="xla", expert_sharding=es))
    compiled = fn.lower(ps, x, ids, w).compile()  # run and read: one compile, not two
    out = compiled(ps, x, ids, w)
    self.assertTrue(np.all(np.isfinite(np.asarray(out))))
    self.assertLess(_rel(out, ref), 1e-6)
    # Each device runs its own experts: no expert weight is gathered.
    self.assertEqual(compiled.as_text().count("all-gather"), 0)

  def test_passes_over_the_rows_equal_one_pass(self):
    # 400 tokens x 2 choices = 800 rows over 8 devices: passes of 128 rows (1.25 x 800 / 8,
    # in whole 64-row tiles). Balanced: about 100 rows a device, one pass. Skewed: every
    # token picks experts 0 and 1, so devices 0 and 1 run 400 rows each in 4 passes and
    # the other six have none (their one pass computes nothing). Routing is data, so one
    # compiled step serves both.
    mesh = make_mesh(MeshConfig(tensor=8))
    placed = shard_params(self.params, mesh, ShardingRules(experts="tensor"), CFG)
    es = expert_sharding(placed)
    p, ps = self.params["layers"][1]["ffn"], placed["layers"][1]["ffn"]
    x = _normal(4, (400, CFG.d_model))
    ids, w, _ = route(p, x, CFG)
    skewed = put(np.broadcast_to(np.arange(CFG.top_k, dtype=np.int32), ids.shape).copy())
    self.assertEqual(moe.ep_pass_rows(800, 8), 800)  # decode-sized: one pass of every row
    ref = jax.jit(lambda p, x, ids, w: moe.dispatch_experts(
        p, x, ids, w, CFG.n_routed_experts, backend="xla"))
    saved = moe.EP_PASS_MIN_ROWS
    moe.EP_PASS_MIN_ROWS = 0  # read when the function is traced
    try:
      self.assertEqual(moe.ep_pass_rows(800, 8), 128)
      fn = jax.jit(lambda p, x, ids, w: moe.dispatch_experts(
          p, x, ids, w, CFG.n_routed_experts, backend="xla", expert_sharding=es))
      hlo = fn.lower(ps, x, ids, w).as_text()
      for routing in (ids, skewed):
        self.assertLess(_rel(fn(ps, x, routing, w), ref(p, x, routing, w)), 1e-6)
    finally:
      moe.EP_PASS_MIN_ROWS = saved
    self.assertIn("while", hlo)  # the passes past the first are a loop

  def test_pass_rows(self):
    self.assertEqual(moe.ep_pass_rows(512, 8), 512)  # Kimi decode, 64 requests x 8
    self.assertEqual(moe.ep_pass_rows(65536, 8), 10240)  # an 8192-token prefill chunk
    self.assertEqual(moe.ep_pass_rows(65536, 1), 65536)
    self.assertEqual(moe.ep_pass_rows(4096, 2), 2560)

  def test_no_expert_sharding_for_unsplit_or_unplaced_params(self):
    self.assertIsNone(expert_sharding(self.params))  # single-device arrays
    mesh = make_mesh(MeshConfig(tensor=8))
    self.assertIsNone(expert_sharding(shard_params(self.params, mesh, ShardingRules(), CFG)))
    dense = dataclasses.replace(CFG, first_k_dense=CFG.n_layers)
    self.assertIsNone(expert_sharding(jax.eval_shape(lambda: init_params(dense, jax.random.key(0)))))

  def test_indivisible_experts_raise(self):
    mesh = make_mesh(MeshConfig(tensor=8))
    es = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tensor"))
    p = self.params["layers"][1]["ffn"]
    # Any routing: the split is refused before anything is computed.
    x, ids, w = put(np.ones((4, CFG.d_model), np.float32),
                    (np.arange(4 * CFG.top_k).reshape(4, CFG.top_k) % 8).astype(np.int32),
                    np.full((4, CFG.top_k), 0.5, np.float32))
    with self.assertRaisesRegex(ValueError, "do not split into whole experts"):
      moe.dispatch_experts(p, x, ids, w, 12, expert_sharding=es)


class QueryBlockTest(absltest.TestCase):

  def test_blocked_mla_and_gqa_equal_whole_chunk(self):
    block = 8  # 37 queries: four whole blocks and a padded one
    B, T, S, H = 2, 37, 50, 4
    mask = np.random.default_rng(20).random((B, T, S)) < 0.7
    mask[:, 3] = False  # a masked row
    mask = put(mask)
    q_lat = _normal(21, (B, T, H, 16))
    q_rope = _normal(22, (B, T, H, 8))
    latent = _normal(23, (B, S, 16))
    k_rope = _normal(24, (B, S, 8))
    q = _normal(25, (B, T, H, 16))
    k = _normal(26, (B, S, 2, 16))
    v = _normal(27, (B, S, 2, 16))

    def both(*args):  # jitted, so each variant compiles once instead of op by op
      q_lat, q_rope, latent, k_rope, q, k, v, mask = args
      return (attention.mla_latent_attention(q_lat, q_rope, latent, k_rope, mask, 0.3),
              attention.gqa_attention(q, k, v, mask, 0.3))

    args = (q_lat, q_rope, latent, k_rope, q, k, v, mask)
    whole_mla, whole_gqa = jax.jit(both)(*args)
    saved = attention.QUERY_BLOCK
    attention.QUERY_BLOCK = block  # read when the function is traced
    try:
      blocked_mla, blocked_gqa = jax.jit(lambda *a: both(*a))(*args)
    finally:
      attention.QUERY_BLOCK = saved
    for blocked, whole in ((blocked_mla, whole_mla), (blocked_gqa, whole_gqa)):
      self.assertEqual(blocked.shape, whole.shape)
      self.assertLess(_rel(blocked, whole), 1e-6)
      np.testing.assert_array_equal(np.asarray(blocked)[:, 3], 0)


  def test_block_follows_the_score_budget(self):
    # An 8192-token prefill over 16K keys: with 8 heads (Kimi K2.6's 64 over 8 GPUs,
    # the step's head_shards) 512 queries a block keep a score buffer at 256 MiB, with
    # all 64 on one device 64 do; GLM 5.2's four 2048-token prompts over 8 heads fit 1024.
    self.assertEqual(attention.query_block(1, 8192, 8, 16384), 512)
    self.assertEqual(attention.query_block(1, 8192, 64, 16384), 64)
    self.assertEqual(min(attention.QUERY_BLOCK, attention.query_block(4, 2048, 8, 2048)), 1024)
    seen = []

    def attend(q, mask):
      seen.append(q.shape[1])
      return q

    q = _normal(5, (1, 100, 2, 4))
    mask = put(np.ones((1, 100, 64), bool))
    saved = attention.SCORE_BLOCK_BYTES
    attention.SCORE_BLOCK_BYTES = 2 * 64 * 4 * 16  # the scores of 16 queries
    try:  # jitted (traced here, while the budget is set): one compile, not one per op
      out = jax.jit(lambda q, m: attention.attend_in_query_blocks(attend, (q,), m))(q, mask)
    finally:
      attention.SCORE_BLOCK_BYTES = saved
    self.assertEqual(set(seen), {16})  # 7 blocks of 16 queries, the last one padded
    np.testing.assert_array_equal(np.asarray(out), np.asarray(q))
    attention.attend_in_query_blocks(attend, (q,), mask)
    self.assertEqual(seen[-1], 100)  # fits the default budget: one block

  def test_sharded_step_blocks_by_one_devices_heads(self):
    # The serving step's prefill, its query heads split 4 ways: the blocks are sized by
    # the 1 head each device holds (16 queries), not by all 4 (4 queries). Compiled, it
    # gathers no query across the devices: the block loop's output buffer once took its
    # tie value from a flattened query, and XLA all-gathered every head of it to read one
    # element (134 MB per layer in Kimi K2.6's prefill; docs/serving_step_memory.md).
    from mlkit import kvcache as kvc
    from mlkit import parallel
    from pallas_kernels.h200.step_placement import step_placement
    from mlkit.engine import EngineConfig
    from mlkit.engine.runner import abstract_batch, lower_step
    from jax.sharding import NamedSharding, PartitionSpec
    B, T, M, page = 1, 64, 4, 16
    S = M * page
    blocks = []
    real = attention.map_query_blocks

    def spy(fn, queries, mask, block):
      blocks.append(block)
      return real(fn, queries, mask, block)

    saved = attention.SCORE_BLOCK_BYTES, attention.map_query_blocks
    attention.SCORE_BLOCK_BYTES = B * 1 * S * 4 * 16  # one head's scores of 16 queries
    attention.map_query_blocks = spy
    try:
      for tensor, want in ((4, 16), (1, 4)):
        mesh = parallel.make_mesh(parallel.MeshConfig(tensor=tensor), jax.devices()[:tensor])
        kv_cfg = kvc.KVCacheConfig(num_pages=8, page_size=page)
        params = parallel.abstract_params(TINY_MLA, None, mesh)
        state = parallel.abstract_kv_state(TINY_MLA, kv_cfg, mesh)
        config = EngineConfig(model=TINY_MLA, kv=kv_cfg, max_running=B, batch_buckets=(B,),
                              prefill_buckets=(T,), prefill_token_budget=B * T,
                              max_pages_per_seq=M, backend="xla")
        del blocks[:]
        lowered = lower_step(params, state,
                             abstract_batch(B, T, M, NamedSharding(mesh, PartitionSpec())),
                             config, kind="prefill")
        self.assertLen(blocks, TINY_MLA.n_layers)
        self.assertEqual(set(blocks), {want}, f"tensor={tensor}")
        if tensor > 1:
          for g in step_placement(lowered.compile().as_text())["all_gathers"]:
            dims = [int(d) for d in re.findall(r"\d+", g["result"].split("[", 1)[1])]
            self.assertFalse(T in dims and TINY_MLA.n_heads in dims, g)  # [B, T, heads, ..]
    finally:
      attention.SCORE_BLOCK_BYTES, attention.map_query_blocks = saved


class KeyMaskTest(absltest.TestCase):
  """The factored mask equals the dense one, blocked or not, and no step builds it whole."""

  def _mask(self, seed, B=2, T=37, S=50):
    # Inputs drawn and the formula computed with numpy; the factored mask built in one
    # compiled program (op by op, each op would compile on its own).
    rng = np.random.default_rng(seed)
    query_pos = rng.integers(0, S, (B, T)).astype(np.int32)
    lengths = np.array([S - 7, 23], np.int32)[:B]
    segs = rng.integers(0, 3, (B, S)).astype(np.int32)
    also = rng.random((B, T, S)) < 0.8
    build = jax.jit(lambda qp, ln, sg, a: masks.causal_mask(
        qp, S, lengths=ln, query_seg=sg[:, :T], key_seg=sg) & a)
    mask = build(query_pos, lengths, segs, also)
    slot = np.arange(S)[None, None, :]
    want = ((slot <= query_pos[:, :, None]) & (slot < lengths[:, None, None])
            & (segs[:, None, :] == segs[:, :T, None]))
    return mask, want & also  # numpy

  def test_dense_is_the_formula(self):
    mask, want = self._mask(0)
    self.assertEqual(mask.shape, want.shape)
    np.testing.assert_array_equal(np.asarray(mask.dense()), np.asarray(want))
    self.assertGreater(int(want.sum()), 0)
    self.assertLess(int(want.sum()), want.size)
    with self.assertRaisesRegex(ValueError, "cannot narrow"):
      mask & put(want[:, :3])

  def test_blocked_attention_and_selection_equal_the_dense_mask(self):
    mask, want = self._mask(1)
    B, T, S = want.shape
    want = put(want)
    q_lat = _normal(30, (B, T, 4, 16))
    q_rope = _normal(31, (B, T, 4, 8))
    latent = _normal(32, (B, S, 16))
    k_rope = _normal(33, (B, S, 8))
    # Indexer query [B, T, 2, 16], weights [B, T, 2]: sliced on the host (an eager device
    # slice compiles a program per shape).
    iq, iw = put(np.asarray(q_lat)[..., :2, :], np.asarray(q_rope)[..., 0, :2])

    def run(mask, block):
      saved = attention.QUERY_BLOCK
      attention.QUERY_BLOCK = block  # read when traced
      try:
        return jax.jit(lambda m: (attention.mla_latent_attention(q_lat, q_rope, latent, k_rope, m, 0.3),
                                  dsa.select(iq, iw, latent, m, 5, block=block)))(mask)
      finally:
        attention.QUERY_BLOCK = saved

    whole_out, whole_sel = run(want, T)
    for block in (T, 8):  # one block, and four whole blocks and a padded one
      out, sel = run(mask, block)
      self.assertLess(_rel(out, whole_out), 1e-6)
      np.testing.assert_array_equal(np.asarray(sel), np.asarray(whole_sel))

  def test_a_blocked_prefill_builds_no_whole_mask(self):
    # A 128-token prefill over 192 cache slots, attended 16 queries at a time: no
    # bool or int32 array of the whole mask's size (the mask, or its compare's
    # broadcast int32 operands) may appear in the compiled step; each block's
    # [1, 16, 192] mask is built inside its loop.
    cfg = dataclasses.replace(TINY_MLA, max_seq_len=192)
    params = init_params_np(cfg, seed=3)
    T, S = 128, 192
    tokens, positions = put(np.random.default_rng(4).integers(0, cfg.vocab_size, (1, T)).astype(np.int32),
                            np.arange(T, dtype=np.int32)[None])
    saved = attention.QUERY_BLOCK
    attention.QUERY_BLOCK = 16
    try:
      step = jax.jit(lambda p, t, pos, c: apply(p, t, pos, c, cfg=cfg, mla_mode="naive"))
      hlo = step.lower(params, tokens, positions, init_cache(cfg, 1, S)).compile().as_text()
    finally:
      attention.QUERY_BLOCK = saved
    whole = [shape for dtype, shape in re.findall(r"\b(pred|s32)\[([\d,]+)\]", hlo)
             if shape.endswith(f",{S}") and math.prod(int(d) for d in shape.split(",")) >= T * S]
    self.assertEqual(whole, [])  # e.g. pred[1,128,192], or pred[8,1,16,192] blocked up front


def _built_from_constants(hlo: str, buffer: str) -> list[str]:
  """Where the compiled program computes an array of type ``buffer`` (e.g.
  "pred[4,2,16,48]") from constants only: a fusion of no operands (an H200 compile
  fuses every layer's into one, of no parameters) or of constant operands (a CPU
  compile). A layer's loop buffer made that way is shared by every layer, built at
  the start of the step and live through it."""
  return re.findall(r"\(\) -> \(?[^\n]*" + re.escape(buffer), hlo) + re.findall(
      re.escape(buffer) + r"\{[^}]*\} fusion\((?:%constant[\w.]*(?:, )?)*\)", hlo)


class QueryBlockBufferTest(parameterized.TestCase):
  """The query-block loop's output buffer depends on its layer's queries, so XLA cannot
  build every layer's at the start of the step and keep them all live (docs/
  serving_step_memory.md): a buffer computed from no inputs is what that looks like."""

  @parameterized.parameters(jnp.bfloat16, jnp.bool_)
  def test_no_layer_output_buffer_is_a_constant(self, dtype):
    B, T, S, block = 2, 64, 48, 16
    n = T // block

    def fn(q, mask):  # [B, block, 8], [B, block, S] -> [B, block, S] of dtype
      if dtype == jnp.bool_:  # a selection, as the sparse-attention indexer's
        return (q[..., :1] > 0) & mask
      return (mask * q[..., :1]).astype(dtype)

    def step(q):  # three layers, each blocked over the queries
      mask = jnp.broadcast_to(q[..., :1] > -1.0, (B, T, S))  # from the data, not a constant
      out = []
      for _ in range(3):
        o = masks.map_query_blocks(fn, (q,), mask, block)
        q = q + o[..., :8].astype(q.dtype)
        out.append(o)
      return out

    q = _normal(0, (B, T, 8))
    hlo = jax.jit(step).lower(q).compile().as_text()
    name = {"bool": "pred", "bfloat16": "bf16"}[jnp.dtype(dtype).name]
    buffer = f"{name}[{n},{B},{block},{S}]"  # the loop's [n, B, block, S] output buffer
    self.assertEqual(_built_from_constants(hlo, buffer), [])


class BlockedRaggedDotTest(parameterized.TestCase):

  @parameterized.parameters(False, True)
  def test_blocked_forms_equal_ragged_dot(self, per_block):
    x = _normal(40, (300, 64))
    w = _normal(41, (7, 64, 48))
    sizes = put(np.asarray([50, 0, 77, 3, 100, 0, 40], np.int32))  # 270 of 300 rows, two empty
    ref = _ragged_dot(x, w, sizes)
    out = jax.jit(lambda x, w, s: ragged_dot_f32(x, w, s, blocked=True, per_block=per_block))(
        x, w, sizes)
    self.assertLess(_rel(out, ref), 1e-6)
    np.testing.assert_array_equal(np.asarray(out)[270:], 0)

  def test_no_layer_output_buffer_is_a_constant(self):
    # Three chained block loops (three layers' expert matmuls): no [blocks, block, N] f32
    # output buffer may be computed from constants, shared by every layer and live
    # through the step (the zeros behind an optimization_barrier were).
    w = _normal(42, (7, 48, 48))
    sizes = put(np.asarray([50, 0, 77, 3, 100, 0, 40], np.int32))

    def layers(x):
      for _ in range(3):
        x = ragged_dot_f32(x, w, sizes, blocked=True, per_block=True)
      return x

    hlo = jax.jit(layers).lower(_normal(43, (300, 48))).compile().as_text()
    buffers = set(re.findall(r"f32\[(\d+),(\d+),48\]", hlo))
    self.assertTrue(buffers)  # the blocked buffer is in the program
    for n, block in buffers:
      self.assertEqual(_built_from_constants(hlo, f"f32[{n},{block},48]"), [])


if __name__ == "__main__":
  absltest.main()
