"""The functional MLA/GQA MoE model: shapes, caching, absorbed MLA, routing, RoPE.

Compiles dominate this file's time, so the forward tests share compiled programs: the
MLA model is TINY_MLA cut to one dense and one MoE layer (the cache is still indexed
per layer, and both FFN kinds run), params are drawn with numpy (no threefry program to
compile), and tests that need a multi-token chunk through a cache use the prefill
test's [2, 3] chunk with a 16-token cache, so that program compiles once per config.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_GQA, TINY_MLA
from mlkit.model import apply, forward, init_cache, init_params, segment_positions
from mlkit.model import moe, rope
from mlkit.model.layers import swiglu
from host_data import put
from numpy_params import init_params_np

BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")
MLA = dataclasses.replace(TINY_MLA, n_layers=2)  # one dense layer, one MoE layer
CONFIGS = {"mla": MLA, "gqa": TINY_GQA,
           # Low-rank-free queries, plain RoPE and ungrouped routing: the other branches of
           # the MLA model in one config.
           "mla_plain": dataclasses.replace(MLA, q_lora_rank=0, rope_scaling=None, n_group=1,
                                            topk_group=1)}


# Jitted so each shape compiles once instead of running op by op.
apply_jit = jax.jit(apply, static_argnames=("cfg", "mla_mode"))
segment_positions_jit = jax.jit(segment_positions)
CASES = [("mla", False), ("mla", True), ("gqa", False), ("gqa", True), ("mla_plain", False)]
CHUNK, CACHE_LEN = 3, 16  # the multi-token chunk and cache length the forward tests share


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _tokens(cfg, B, T, seed=1):
  # numpy draws: jax.random would compile a threefry program per shape. Kept on the host,
  # so that slicing them compiles nothing (an eager slice of a jax array is a program).
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)


def _normal_np(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _normal(seed, shape):
  # Drawn and cast on the host, placed without compiling (an eager cast is a program).
  return put(_normal_np(seed, shape))


class ForwardTest(parameterized.TestCase):

  @parameterized.parameters(*CASES)
  def test_param_and_cache_dtypes(self, name, bf16):
    # Shapes and dtypes only: traced, not compiled (the forward pass's logits are checked in
    # test_prefill_then_decode_matches_full_forward).
    cfg = dataclasses.replace(CONFIGS[name], **(BF16 if bf16 else {}))
    params = jax.eval_shape(lambda key: init_params(cfg, key), jax.random.key(0))
    self.assertEqual(params["layers"][1]["ffn"]["w_gate"].dtype, jnp.dtype(cfg.param_dtype))
    self.assertEqual(params["layers"][1]["ffn"]["router"].dtype, jnp.float32)
    cache = jax.eval_shape(lambda: init_cache(cfg, 2, 16))
    shapes = {k: v.shape for k, v in cache.layers[0].items()}
    self.assertLen(cache.layers, cfg.n_layers)
    if cfg.attention == "mla":
      self.assertEqual(shapes, {"latent": (2, 16, cfg.kv_lora_rank), "k_rope": (2, 16, cfg.qk_rope_head_dim)})
    else:
      self.assertEqual(shapes["k"], (2, 16, cfg.n_kv_heads, cfg.head_dim))
    self.assertEqual(cache.layers[0][next(iter(shapes))].dtype, jnp.dtype(cfg.dtype))

  @parameterized.parameters(*CASES)
  def test_prefill_then_decode_matches_full_forward(self, name, bf16):
    cfg = dataclasses.replace(CONFIGS[name], **(BF16 if bf16 else {}))
    params = init_params_np(cfg)
    B, T, P = 2, 10, 2 * CHUNK
    toks = _tokens(cfg, B, T)
    full = forward(params, toks, cfg=cfg)
    self.assertEqual(full.shape, (B, T, cfg.vocab_size))
    self.assertEqual(full.dtype, jnp.float32)  # f32 logits whatever the compute dtype
    self.assertTrue(np.all(np.isfinite(np.asarray(full))))
    cache = init_cache(cfg, B, CACHE_LEN)
    # Two equal prefill chunks (the second reads the first from the cache), then decode.
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    l1, cache = apply_jit(params, toks[:, :CHUNK], pos[:, :CHUNK], cache, cfg=cfg)
    l2, cache = apply_jit(params, toks[:, CHUNK:P], pos[:, CHUNK:P], cache, cfg=cfg)
    outs = [l1, l2]
    for t in range(P, T):
      lt, cache = apply_jit(params, toks[:, t:t + 1], pos[:, t:t + 1], cache, cfg=cfg)
      outs.append(lt)
    inc = np.concatenate([np.asarray(o) for o in outs], axis=1)
    # bf16: the cache rounds K/V to bf16 while the full pass keeps them in registers.
    tol = 2e-2 if bf16 else 1e-5
    self.assertLess(rel_err(inc, full), tol)
    self.assertFalse(np.any(np.isnan(np.asarray(inc))))

  @parameterized.parameters("mla", "mla_plain")
  def test_absorbed_matches_naive(self, name):
    # A multi-token chunk, so the absorbed form also applies the causal mask; "auto" is the
    # naive form for chunks longer than one token (the prefill test's compiled program).
    cfg = CONFIGS[name]
    params = init_params_np(cfg, seed=3)
    B = 2
    toks = _tokens(cfg, B, CHUNK, seed=4)
    pos = np.broadcast_to(np.arange(CHUNK, dtype=np.int32), (B, CHUNK))
    naive, _ = apply_jit(params, toks, pos, init_cache(cfg, B, CACHE_LEN), cfg=cfg)
    absorbed, _ = apply_jit(params, toks, pos, init_cache(cfg, B, CACHE_LEN), cfg=cfg,
                            mla_mode="absorbed")
    self.assertLess(rel_err(absorbed, naive), 1e-5)
    self.assertGreater(float(np.std(np.asarray(naive))), 0.0)

  def test_logits_index_selects_one_position_per_row(self):
    cfg = MLA
    params = init_params_np(cfg)
    # The prefill test's [2, 10] tokens: the full logits come from its compiled forward,
    # and both indexed forms compile as one program (apply op by op compiled ~190).
    B, T = 2, 10
    toks = _tokens(cfg, B, T, seed=3)
    full = forward(params, toks, cfg=cfg)  # [2, 10, V]
    idx = np.array([9, 3], np.int32)

    @jax.jit
    def indexed(params, toks, idx):
      pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
      return (apply(params, toks, pos, None, cfg=cfg, logits_index=idx)[0],
              apply(params, toks, pos, None, cfg=cfg, logits_index=idx, return_hidden=True)[0])

    one, hid = indexed(params, toks, idx)
    self.assertEqual(one.shape, (B, 1, cfg.vocab_size))
    np.testing.assert_allclose(np.asarray(one)[:, 0], np.asarray(full)[np.arange(B), idx],
                               rtol=1e-5, atol=1e-5)
    self.assertEqual(hid.shape, (B, 1, cfg.d_model))

  def test_padded_batch_matches_single_rows(self):
    cfg = MLA
    params = init_params_np(cfg)
    a, b = [5, 6], [8, 9, 10]
    toks = np.array([a + [0], b], np.int32)
    pos = np.broadcast_to(np.arange(CHUNK, dtype=np.int32), (2, CHUNK))
    batched, _ = apply_jit(params, toks, pos, init_cache(cfg, 2, CACHE_LEN), cfg=cfg)
    # Row a without its padding and without b beside it: a's tokens, then other tokens
    # (causal: never seen by a's positions), beside a random row, through the [2, 10]
    # forward the prefill and logits-index tests compile for this config.
    single_toks = _tokens(cfg, 2, 10, seed=5)
    single_toks[0, :2] = a
    single = forward(params, single_toks, cfg=cfg)
    np.testing.assert_allclose(np.asarray(batched)[0, :2], np.asarray(single)[0, :2], rtol=1e-5,
                               atol=1e-5)

  @parameterized.parameters("mla", "gqa")
  def test_packed_segments_match_separate_sequences(self, name):
    # Three sequences packed into one row, then a PAD tail: with segment ids and positions
    # restarting per segment, each sequence's logits equal its own forward.
    cfg = CONFIGS[name]
    params = init_params_np(cfg)
    seqs = [list(_tokens(cfg, 1, n, seed=n)[0]) for n in (4, 6, 3)]
    row = sum(seqs, []) + [0, 0]
    # Host arrays (jnp.array of a list is an eager program per call).
    segs = np.array([sum(([i + 1] * len(q) for i, q in enumerate(seqs)), []) + [0, 0]], np.int32)
    pos = segment_positions_jit(segs)
    np.testing.assert_array_equal(np.asarray(pos)[0], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1])
    packed, _ = apply_jit(params, np.array([row], np.int32), pos, None, cfg=cfg, segment_ids=segs)
    packed = np.asarray(packed)  # sliced on the host: no program per slice
    start = 0
    arange = np.arange(len(row), dtype=np.int32)[None]
    for q in seqs:
      # Alone, right-padded to the row's length (causal, so the padding is never seen), through
      # the same compiled segment-free program as the unmasked row below.
      alone, _ = apply_jit(params, np.array([q + [0] * (len(row) - len(q))], np.int32), arange, None,
                           cfg=cfg)
      np.testing.assert_allclose(packed[0, start:start + len(q)], np.asarray(alone)[0, :len(q)],
                                 rtol=1e-5, atol=1e-5)
      start += len(q)
    # Without segment ids the later sequences see the earlier ones, so their logits differ.
    unmasked, _ = apply_jit(params, np.array([row], np.int32), pos, None, cfg=cfg)
    self.assertGreater(rel_err(np.asarray(unmasked)[0, 4:10], packed[0, 4:10]), 1e-3)

  def test_bad_inputs(self):
    cfg = MLA
    params = init_params_np(cfg)
    # Host inputs: every check raises before the model runs, so nothing compiles for them.
    with self.assertRaisesRegex(ValueError, r"tokens must be \[B, T\]"):
      apply(params, np.zeros((3,), np.int32), np.zeros((3,), np.int32), cfg=cfg)
    with self.assertRaisesRegex(ValueError, "positions"):
      apply(params, np.zeros((1, 3), np.int32), np.zeros((1, 4), np.int32), cfg=cfg)
    with self.assertRaisesRegex(ValueError, "integers"):
      apply(params, np.zeros((1, 3), np.float32), np.zeros((1, 3), np.int32), cfg=cfg)
    with self.assertRaisesRegex(ValueError, "layers"):
      apply(params, np.zeros((1, 3), np.int32), np.zeros((1, 3), np.int32),
            cfg=dataclasses.replace(cfg, n_layers=4))
    z = np.zeros((1, 3), np.int32)
    with self.assertRaisesRegex(ValueError, "segment_ids .* must match"):
      apply(params, z, z, cfg=cfg, segment_ids=np.zeros((1, 4), np.int32))
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
    params = init_params_np(cfg)
    p = dict(params["layers"][1]["ffn"])
    if "router_bias" in p:
      p["router_bias"] = put(_normal_np(7, p["router_bias"].shape) * np.float32(0.1))
    x = _normal(5, (17, cfg.d_model))
    ids, w, _ = jax.jit(moe.route, static_argnums=2)(p, x, cfg)
    ref_ids, ref_w = _route_naive(p, x, cfg)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), 1), np.sort(ref_ids, 1))
    order = np.argsort(np.asarray(ids), 1)
    ref_order = np.argsort(ref_ids, 1)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(ref_w, ref_order, 1), rtol=1e-5)

  @parameterized.named_parameters(("sigmoid_grouped", TINY_MLA), ("softmax", TINY_GQA))
  def test_moe_ffn_matches_per_token_loop(self, cfg):
    params = init_params_np(cfg, seed=1)
    p = params["layers"][1]["ffn"]
    x = _normal(2, (2, 9, cfg.d_model))
    out, aux = jax.jit(moe.moe_ffn, static_argnums=2)(p, x, cfg)
    flat = np.asarray(x, np.float64).reshape(-1, cfg.d_model)
    ids, w = _route_naive(p, flat, cfg)
    # Expert weights on the host: indexing the device arrays is a program per index.
    wg, wu, wd = (np.asarray(p[k], np.float64) for k in ("w_gate", "w_up", "w_down"))
    silu = lambda z: z / (1 + np.exp(-z))
    ref = np.zeros_like(flat)
    for n in range(flat.shape[0]):
      for e, we in zip(ids[n], w[n]):
        g = flat[n] @ wg[e]
        u = flat[n] @ wu[e]
        ref[n] += we * ((silu(g) * u) @ wd[e])
    shared = np.asarray(jax.jit(swiglu)(p["shared"], put(flat.astype(np.float32))), np.float64)
    ref += shared
    out = np.asarray(out).reshape(-1, cfg.d_model)
    self.assertLess(rel_err(out, ref), 1e-5)
    # Shared expert contributes: without it the result differs.
    self.assertGreater(rel_err(out, ref - shared), 1e-2)
    np.testing.assert_allclose(float(np.sum(np.asarray(aux["expert_load"], np.float64))), 1.0,
                               rtol=1e-6)

  def test_empty_and_full_experts(self):
    cfg = TINY_GQA
    p = init_params_np(cfg, seed=1)["layers"][1]["ffn"]
    x = _normal(3, (6, cfg.d_model))
    ids = put(np.tile(np.array([[0, 3]], np.int32), (6, 1)))  # experts 1, 2, 4.. get no tokens
    w = put(np.full((6, 2), 0.5, np.float32))
    out = jax.jit(moe.dispatch_experts, static_argnums=4)(p, x, ids, w, cfg.n_routed_experts)
    # Each expert's weights taken on the host: one swiglu program serves both experts.
    ref = sum(0.5 * np.asarray(jax.jit(swiglu)({k: np.asarray(p[k])[e]
                                                for k in ("w_gate", "w_up", "w_down")}, x))
              for e in (0, 3))
    self.assertLess(rel_err(out, ref), 1e-5)


class RopeTest(parameterized.TestCase):

  @parameterized.parameters(True, False)
  def test_relative_position_property(self, interleave):
    cfg = dataclasses.replace(TINY_MLA, rope_interleave=interleave)
    q = _normal(0, (1, 1, cfg.rope_dim))
    k = _normal(1, (1, 1, cfg.rope_dim))

    @jax.jit  # one compile instead of one per eager op
    def qk(m, n):
      cq, sq = rope.cos_sin(cfg, m)
      ck, sk = rope.cos_sin(cfg, n)
      return jnp.sum(rope.apply_rope(q, cq, sq, interleave=interleave)
                     * rope.apply_rope(k, ck, sk, interleave=interleave))

    def dot(m, n):
      return float(qk(np.array([[m]], np.int32), np.array([[n]], np.int32)))

    self.assertAlmostEqual(dot(7, 3), dot(24, 20), places=4)
    self.assertNotAlmostEqual(dot(7, 3), dot(7, 4), places=3)

  def test_yarn_interpolates_low_frequencies_only(self):
    inv_frequencies = jax.jit(rope.inv_frequencies, static_argnums=0)
    plain = np.asarray(inv_frequencies(dataclasses.replace(TINY_MLA, rope_scaling=None)))
    yarn = np.asarray(inv_frequencies(TINY_MLA))
    factor = TINY_MLA.rope_scaling.factor
    np.testing.assert_allclose(yarn[0], plain[0], rtol=1e-6)  # highest frequency kept
    np.testing.assert_allclose(yarn[-1], plain[-1] / factor, rtol=1e-6)  # lowest interpolated

  def test_equal_betas_are_finite(self):
    from configs import KIMI_K2_6
    freqs = jax.jit(rope.inv_frequencies, static_argnums=0)(KIMI_K2_6)
    self.assertTrue(np.all(np.isfinite(np.asarray(freqs))))
    self.assertEqual(freqs.shape, (KIMI_K2_6.qk_rope_head_dim // 2,))


if __name__ == "__main__":
  absltest.main()
