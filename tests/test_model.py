"""The functional MLA/GQA MoE model: shapes, caching, absorbed MLA, routing, RoPE."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_GQA, TINY_MLA
from mlkit.model import apply, forward, init_cache, init_params, segment_positions
from mlkit.model import moe, rope
from mlkit.model.layers import swiglu

BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")
CONFIGS = {"mla": TINY_MLA, "gqa": TINY_GQA,
           "mla_no_qlora": dataclasses.replace(TINY_MLA, q_lora_rank=0),
           "mla_no_yarn": dataclasses.replace(TINY_MLA, rope_scaling=None, n_group=1, topk_group=1)}


# Jitted so each shape compiles once instead of running op by op.
apply_jit = jax.jit(apply, static_argnames=("cfg", "mla_mode"))
CASES = [("mla", False), ("mla", True), ("gqa", False), ("gqa", True), ("mla_no_qlora", False),
         ("mla_no_yarn", False)]


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _tokens(cfg, B, T, seed=1):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, cfg.vocab_size)


class ForwardTest(parameterized.TestCase):

  @parameterized.parameters(*CASES)
  def test_shapes_and_dtypes(self, name, bf16):
    cfg = dataclasses.replace(CONFIGS[name], **(BF16 if bf16 else {}))
    params = init_params(cfg, jax.random.key(0))
    self.assertEqual(params["layers"][1]["ffn"]["w_gate"].dtype, jnp.dtype(cfg.param_dtype))
    self.assertEqual(params["layers"][1]["ffn"]["router"].dtype, jnp.float32)
    logits = forward(params, _tokens(cfg, 2, 5), cfg=cfg)
    self.assertEqual(logits.shape, (2, 5, cfg.vocab_size))
    self.assertEqual(logits.dtype, jnp.float32)
    self.assertTrue(np.all(np.isfinite(np.asarray(logits))))
    cache = init_cache(cfg, 2, 16)
    shapes = {k: v.shape for k, v in cache.layers[0].items()}
    if cfg.attention == "mla":
      self.assertEqual(shapes, {"latent": (2, 16, cfg.kv_lora_rank), "k_rope": (2, 16, cfg.qk_rope_head_dim)})
    else:
      self.assertEqual(shapes["k"], (2, 16, cfg.n_kv_heads, cfg.head_dim))
    self.assertEqual(cache.layers[0][next(iter(shapes))].dtype, jnp.dtype(cfg.dtype))

  @parameterized.parameters(*CASES)
  def test_prefill_then_decode_matches_full_forward(self, name, bf16):
    cfg = dataclasses.replace(CONFIGS[name], **(BF16 if bf16 else {}))
    params = init_params(cfg, jax.random.key(0))
    B, T, P = 2, 10, 6
    toks = _tokens(cfg, B, T)
    full = forward(params, toks, cfg=cfg)
    cache = init_cache(cfg, B, 16)
    # Two equal prefill chunks (the second reads the first from the cache), then decode.
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    l1, cache = apply_jit(params, toks[:, :3], pos[:, :3], cache, cfg=cfg)
    l2, cache = apply_jit(params, toks[:, 3:P], pos[:, 3:P], cache, cfg=cfg)
    outs = [l1, l2]
    for t in range(P, T):
      lt, cache = apply_jit(params, toks[:, t:t + 1], pos[:, t:t + 1], cache, cfg=cfg)
      outs.append(lt)
    inc = jnp.concatenate(outs, axis=1)
    # bf16: the cache rounds K/V to bf16 while the full pass keeps them in registers.
    tol = 2e-2 if bf16 else 1e-5
    self.assertLess(rel_err(inc, full), tol)
    self.assertFalse(np.any(np.isnan(np.asarray(inc))))

  @parameterized.parameters("mla", "mla_no_qlora")
  def test_absorbed_matches_naive(self, name):
    cfg = CONFIGS[name]
    params = init_params(cfg, jax.random.key(3))
    B, T = 2, 6
    toks = _tokens(cfg, B, T, seed=4)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    naive, _ = apply_jit(params, toks, pos, init_cache(cfg, B, 8), cfg=cfg, mla_mode="naive")
    absorbed, _ = apply_jit(params, toks, pos, init_cache(cfg, B, 8), cfg=cfg, mla_mode="absorbed")
    self.assertLess(rel_err(absorbed, naive), 1e-5)
    self.assertGreater(float(jnp.std(naive)), 0.0)

  def test_padded_batch_matches_single_rows(self):
    cfg = TINY_MLA
    params = init_params(cfg, jax.random.key(0))
    a, b = [5, 6, 7], [8, 9, 10, 11, 12]
    toks = jnp.array([a + [0, 0], b])
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
    batched, _ = apply_jit(params, toks, pos, init_cache(cfg, 2, 8), cfg=cfg)
    single = forward(params, jnp.array([a]), cfg=cfg)
    np.testing.assert_allclose(batched[0, :3], single[0], rtol=1e-5, atol=1e-5)

  @parameterized.parameters("mla", "gqa")
  def test_packed_segments_match_separate_sequences(self, name):
    # Three sequences packed into one row, then a PAD tail: with segment ids and positions
    # restarting per segment, each sequence's logits equal its own forward.
    cfg = CONFIGS[name]
    params = init_params(cfg, jax.random.key(0))
    seqs = [list(np.asarray(_tokens(cfg, 1, n, seed=n)[0])) for n in (4, 6, 3)]
    row = sum(seqs, []) + [0, 0]
    segs = jnp.array([sum(([i + 1] * len(q) for i, q in enumerate(seqs)), []) + [0, 0]])
    pos = segment_positions(segs)
    np.testing.assert_array_equal(pos[0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1])
    packed, _ = apply_jit(params, jnp.array([row]), pos, None, cfg=cfg, segment_ids=segs)
    start = 0
    for q in seqs:
      # Right-padded to the row's length (causal, so the padding is never seen): one compile.
      alone = forward(params, jnp.array([q + [0] * (len(row) - len(q))]), cfg=cfg)[0, :len(q)]
      np.testing.assert_allclose(packed[0, start:start + len(q)], alone, rtol=1e-5, atol=1e-5)
      start += len(q)
    # Without segment ids the later sequences see the earlier ones, so their logits differ.
    unmasked, _ = apply_jit(params, jnp.array([row]), pos, None, cfg=cfg)
    self.assertGreater(rel_err(unmasked[0, 4:10], packed[0, 4:10]), 1e-3)

  def test_bad_inputs(self):
    cfg = TINY_MLA
    params = init_params(cfg, jax.random.key(0))
    with self.assertRaisesRegex(ValueError, r"tokens must be \[B, T\]"):
      apply(params, jnp.zeros((3,), jnp.int32), jnp.zeros((3,), jnp.int32), cfg=cfg)
    with self.assertRaisesRegex(ValueError, "positions"):
      apply(params, jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 4), jnp.int32), cfg=cfg)
    with self.assertRaisesRegex(ValueError, "integers"):
      apply(params, jnp.zeros((1, 3)), jnp.zeros((1, 3), jnp.int32), cfg=cfg)
    with self.assertRaisesRegex(ValueError, "layers"):
      apply(params, jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3), jnp.int32),
            cfg=dataclasses.replace(cfg, n_layers=4))
    z = jnp.zeros((1, 3), jnp.int32)
    with self.assertRaisesRegex(ValueError, "segment_ids .* must match"):
      apply(params, z, z, cfg=cfg, segment_ids=jnp.zeros((1, 4), jnp.int32))
    with self.assertRaisesRegex(ValueError, "cache-free"):
      apply(params, z, z, init_cache(cfg, 1, 8), cfg=cfg, segment_ids=z)


def _route_naive(p, x, cfg):
  """Per-token DeepSeek-V3 routing in numpy, written independently of moe.route."""
  x = np.asarray(x, np.float64)
  logits = x @ np.asarray(p["router"], np.float64)
  ids_all, w_all = [], []
  E = cfg.n_routed_experts
  for row in logits:
    if cfg.router == "sigmoid":
      scores = 1 / (1 + np.exp(-row))
      choice = scores + np.asarray(p["router_bias"], np.float64)
    else:
      scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
      choice = scores.copy()
    if cfg.n_group > 1:
      per = E // cfg.n_group
      gscore = [sorted(choice[g * per:(g + 1) * per])[-2:] for g in range(cfg.n_group)]
      gscore = np.array([sum(s) for s in gscore])
      keep = np.argsort(-gscore, kind="stable")[:cfg.topk_group]
      allowed = np.zeros(E, bool)
      for g in keep:
        allowed[g * per:(g + 1) * per] = True
      choice = np.where(allowed, choice, -np.inf)
    ids = np.argsort(-choice, kind="stable")[:cfg.top_k]
    w = scores[ids]
    if cfg.norm_topk_prob:
      w = w / w.sum()
    ids_all.append(ids)
    w_all.append(w * cfg.routed_scaling_factor)
  return np.array(ids_all), np.array(w_all)


class MoETest(parameterized.TestCase):

  @parameterized.named_parameters(("sigmoid_grouped", TINY_MLA), ("softmax", TINY_GQA))
  def test_router_matches_naive(self, cfg):
    params = init_params(cfg, jax.random.key(0))
    p = dict(params["layers"][1]["ffn"])
    if "router_bias" in p:
      p["router_bias"] = jax.random.normal(jax.random.key(7), p["router_bias"].shape) * 0.1
    x = jax.random.normal(jax.random.key(5), (17, cfg.d_model))
    ids, w, _ = moe.route(p, x, cfg)
    ref_ids, ref_w = _route_naive(p, x, cfg)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), 1), np.sort(ref_ids, 1))
    order = np.argsort(np.asarray(ids), 1)
    ref_order = np.argsort(ref_ids, 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(ref_w, ref_order, 1), rtol=1e-5)

  @parameterized.named_parameters(("sigmoid_grouped", TINY_MLA), ("softmax", TINY_GQA))
  def test_moe_ffn_matches_per_token_loop(self, cfg):
    params = init_params(cfg, jax.random.key(1))
    p = params["layers"][1]["ffn"]
    x = jax.random.normal(jax.random.key(2), (2, 9, cfg.d_model))
    out, aux = moe.moe_ffn(p, x, cfg)
    flat = np.asarray(x.reshape(-1, cfg.d_model), np.float64)
    ids, w = _route_naive(p, flat, cfg)
    silu = lambda z: z / (1 + np.exp(-z))
    ref = np.zeros_like(flat)
    for n in range(flat.shape[0]):
      for e, we in zip(ids[n], w[n]):
        g = flat[n] @ np.asarray(p["w_gate"][e], np.float64)
        u = flat[n] @ np.asarray(p["w_up"][e], np.float64)
        ref[n] += we * ((silu(g) * u) @ np.asarray(p["w_down"][e], np.float64))
    shared = np.asarray(swiglu(p["shared"], jnp.asarray(flat, jnp.float32)), np.float64)
    ref += shared
    self.assertLess(rel_err(out.reshape(-1, cfg.d_model), ref), 1e-5)
    # Shared expert contributes: without it the result differs.
    self.assertGreater(rel_err(out.reshape(-1, cfg.d_model), ref - shared), 1e-2)
    np.testing.assert_allclose(float(jnp.sum(aux["expert_load"])), 1.0, rtol=1e-6)

  def test_empty_and_full_experts(self):
    cfg = TINY_GQA
    p = init_params(cfg, jax.random.key(1))["layers"][1]["ffn"]
    x = jax.random.normal(jax.random.key(3), (6, cfg.d_model))
    ids = jnp.tile(jnp.array([[0, 3]], jnp.int32), (6, 1))  # experts 1, 2, 4.. get no tokens
    w = jnp.full((6, 2), 0.5)
    out = moe.dispatch_experts(p, x, ids, w, cfg.n_routed_experts)
    ref = sum(0.5 * swiglu({k: p[k][e] for k in ("w_gate", "w_up", "w_down")}, x) for e in (0, 3))
    self.assertLess(rel_err(out, ref), 1e-5)


class RopeTest(parameterized.TestCase):

  @parameterized.parameters(True, False)
  def test_relative_position_property(self, interleave):
    cfg = dataclasses.replace(TINY_MLA, rope_interleave=interleave)
    q = jax.random.normal(jax.random.key(0), (1, 1, cfg.rope_dim))
    k = jax.random.normal(jax.random.key(1), (1, 1, cfg.rope_dim))

    def dot(m, n):
      cq, sq = rope.cos_sin(cfg, jnp.array([[m]]))
      ck, sk = rope.cos_sin(cfg, jnp.array([[n]]))
      return float(jnp.sum(rope.apply_rope(q, cq, sq, interleave=interleave)
                           * rope.apply_rope(k, ck, sk, interleave=interleave)))

    self.assertAlmostEqual(dot(7, 3), dot(24, 20), places=4)
    self.assertNotAlmostEqual(dot(7, 3), dot(7, 4), places=3)

  def test_yarn_interpolates_low_frequencies_only(self):
    plain = rope.inv_frequencies(dataclasses.replace(TINY_MLA, rope_scaling=None))
    yarn = rope.inv_frequencies(TINY_MLA)
    factor = TINY_MLA.rope_scaling.factor
    np.testing.assert_allclose(yarn[0], plain[0], rtol=1e-6)  # highest frequency kept
    np.testing.assert_allclose(yarn[-1], plain[-1] / factor, rtol=1e-6)  # lowest interpolated

  def test_equal_betas_are_finite(self):
    from configs import KIMI_K2_6
    freqs = rope.inv_frequencies(KIMI_K2_6)
    self.assertTrue(np.all(np.isfinite(np.asarray(freqs))))
    self.assertEqual(freqs.shape, (KIMI_K2_6.qk_rope_head_dim // 2,))


if __name__ == "__main__":
  absltest.main()
