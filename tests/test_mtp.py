"""Multi-token-prediction layers (mlkit.model.mtp) and their training loss.

The MTP layer is checked against a reference assembled step by step from the same
weights: its norms, concat and ``eh_proj`` in numpy (f64), then its decoder block and
shared head through the main model's own forward on a one-layer config whose
"embedding" is the projected rows. Params are drawn with numpy (tests/numpy_params.py).
"""

import dataclasses
import os

import jax
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.checkpoint import load_hf_checkpoint
from mlkit.model import apply, mtp_forward, mtp_forward_all
from mlkit.model.mtp import shift_tokens
from mlkit.train import TrainConfig, compute_config, loss_fn, train
from host_data import put
from numpy_params import init_params_np

KIMI = os.path.join(os.path.dirname(__file__), "fixtures", "kimi_k2_int4")
# One dense layer, one MoE layer, one MTP layer (MoE), f32.
CFG = dataclasses.replace(TINY_MLA, n_layers=2)
# The same with two MTP layers: the depth-chain test's config, which the step-by-step test
# also checks its first layer on, so that its depth-1 program compiles once for both.
CFG2 = dataclasses.replace(CFG, n_mtp_layers=2)
B, T = 2, 12

mtp_jit = jax.jit(mtp_forward, static_argnames=("cfg", "depth"))
apply_jit = jax.jit(apply, static_argnames=("cfg", "return_pre_norm"))
loss_jit = jax.jit(loss_fn, static_argnames=("cfg", "tcfg"))
# One program per shift and shape: eagerly, each shift compiled a fill, a slice and a concat.
shift_jit = jax.jit(shift_tokens, static_argnums=1)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _tokens(cfg, shape, seed=1):
  # On the host: jnp.asarray (a cast) and slices of a device array each compile a program.
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, shape).astype(np.int32)


def _log_softmax_np(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _positions(b, t):
  """[b, t] positions 0..t-1, on the host (eager jnp would compile a program for them)."""
  return np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))


def _rms_norm_np(x, scale, eps):
  x = np.asarray(x, np.float64)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


class MtpForwardTest(parameterized.TestCase):

  @parameterized.named_parameters(("shared_embed_and_head", ()),
                                  ("own_embed_and_head", ("embed", "lm_head")))
  def test_matches_step_by_step_reference(self, parts):
    params = init_params_np(CFG2, mtp=parts)
    lp = params["mtp"][0]
    toks = _tokens(CFG, (B, T))
    # Fresh random hidden states of O(1) size, as the main model's pre-norm output.
    hidden = put(np.random.default_rng(2).standard_normal((B, T, CFG.d_model)).astype(np.float32))
    ahead = shift_jit(toks, 1)  # t_{i+1}
    logits, h = mtp_jit(params, hidden, ahead, cfg=CFG2, depth=1)
    self.assertEqual((logits.shape, h.shape), ((B, T, CFG.vocab_size), (B, T, CFG.d_model)))

    # Reference: embed (own or shared), enorm / hnorm, concat [embedding, hidden], eh_proj.
    embed = np.asarray(lp["embed"] if "embed" in parts else params["embed"], np.float64)
    e = embed[np.asarray(ahead)]
    eh = np.concatenate([_rms_norm_np(e, lp["enorm"], CFG.rms_norm_eps),
                         _rms_norm_np(hidden, lp["hnorm"], CFG.rms_norm_eps)], axis=-1)
    x = eh @ np.asarray(lp["eh_proj"], np.float64)  # [B, T, D]
    # Then one MoE decoder block and the shared head: the main model's forward on a one-layer
    # MoE config whose embedding rows are x (token b*T+t looks up row b*T+t), whose final
    # norm is the head's norm and whose head is the MTP layer's own or the main one.
    one = dataclasses.replace(CFG, n_layers=1, first_k_dense=0)
    ref_params = {"embed": put(x.reshape(B * T, -1).astype(np.float32)),
                  "final_norm": lp["head_norm"],
                  "lm_head": lp["lm_head"] if "lm_head" in parts else params["lm_head"],
                  "layers": [{k: lp[k] for k in ("attn_norm", "ffn_norm", "attn", "ffn")}]}
    rows = np.arange(B * T, dtype=np.int32).reshape(B, T)
    pos = _positions(B, T)
    ref_logits, _, ref_h = apply_jit(ref_params, rows, pos, None, cfg=one, return_pre_norm=True)
    self.assertTrue(np.all(np.isfinite(np.asarray(logits))))
    self.assertLess(rel_err(logits, ref_logits), 1e-6)
    self.assertLess(rel_err(h, ref_h), 1e-6)
    # The layer must read the embedding it holds (or else the main one): swapping them moves
    # the logits, so the reference above can tell the two apart.
    if "embed" in parts:
      wrong_mtp = [{k: v for k, v in lp.items() if k != "embed"}, *params["mtp"][1:]]
      wrong, _ = mtp_jit(dict(params, mtp=wrong_mtp), hidden, ahead, cfg=CFG2, depth=1)
      self.assertGreater(rel_err(wrong, ref_logits), 1e-2)

  def test_depths_chain_and_padding_stays_causal(self):
    cfg = CFG2
    params = init_params_np(cfg, mtp=())
    toks = _tokens(cfg, (B, T))
    pos = _positions(B, T)
    main, _, pre = apply_jit(params, toks, pos, None, cfg=cfg, return_pre_norm=True)
    plain, _ = apply_jit(params, toks, pos, None, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(main), np.asarray(plain))  # callers see no change
    run_all = jax.jit(mtp_forward_all, static_argnames=("cfg",))
    logits = run_all(params, pre, toks, cfg=cfg)  # [2, B, T, V]
    self.assertEqual(logits.shape, (2, B, T, cfg.vocab_size))
    l1, h1 = mtp_jit(params, pre, shift_jit(toks, 1), cfg=cfg, depth=1)
    l2, _ = mtp_jit(params, h1, shift_jit(toks, 2), cfg=cfg, depth=2)
    # (Results indexed on the host here and below: a device slice compiles a program.)
    np.testing.assert_allclose(np.asarray(logits)[0], np.asarray(l1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits)[1], np.asarray(l2), rtol=1e-6, atol=1e-6)
    # Positions whose shifted token exists do not see the padding: changing the tokens past
    # the row's end (what shift_tokens pads with) leaves them unchanged.
    longer = np.concatenate([toks, _tokens(cfg, (B, 2), seed=9)], axis=1)  # two real tokens more
    la, _ = mtp_jit(params, pre, longer[:, 1:T + 1], cfg=cfg, depth=1)
    np.testing.assert_allclose(np.asarray(la)[:, :T - 1], np.asarray(l1)[:, :T - 1],
                               rtol=1e-6, atol=1e-6)

  def test_bad_calls(self):
    params = init_params_np(CFG)
    # Host inputs: each call raises before the layer runs, so nothing compiles for them.
    hidden = np.zeros((B, T, CFG.d_model), np.float32)
    toks = _tokens(CFG, (B, T))
    with self.assertRaisesRegex(ValueError, r"no multi-token-prediction layers"):
      mtp_forward(params, hidden, toks, cfg=CFG, depth=1)
    params = init_params_np(CFG, mtp=())
    with self.assertRaisesRegex(ValueError, r"depth must be in 1\.\.1, got 2"):
      mtp_forward(params, hidden, toks, cfg=CFG, depth=2)
    with self.assertRaisesRegex(ValueError, r"hidden \(2, 12, 32\) must be \[B, T, D\]"):
      mtp_forward(params, hidden[..., :32], toks, cfg=CFG, depth=1)


class KimiCheckpointMtpTest(absltest.TestCase):
  """The Kimi K2 INT4 fixture ships one MTP layer with its own embedding and head."""

  def test_loaded_mtp_layer_runs(self):
    params, cfg = load_hf_checkpoint(KIMI)
    self.assertIn("embed", params["mtp"][0])
    ref = np.load(os.path.join(KIMI, "reference.npz"))
    toks = np.asarray(ref["tokens"], np.int32)
    pos = _positions(*toks.shape)
    logits, _, pre = apply_jit(params, toks, pos, None, cfg=cfg, return_pre_norm=True)
    # The reference holds no MTP logits: the main logits must still match transformers'
    # (the pre-norm output changes nothing), and the MTP layer must give finite logits.
    self.assertLess(rel_err(logits, ref["logits"]), 1e-4)
    mtp_logits, h = mtp_jit(params, pre, shift_jit(toks, 1), cfg=cfg, depth=1)
    self.assertEqual(mtp_logits.shape, (*toks.shape, cfg.vocab_size))
    self.assertEqual(h.shape, (*toks.shape, cfg.d_model))
    self.assertTrue(np.all(np.isfinite(np.asarray(mtp_logits))))


# One MoE layer and its MTP layer: the smallest model whose training step runs both.
TCFG_CFG = dataclasses.replace(TINY_MLA, n_layers=1, first_k_dense=0)
TCFG = TrainConfig(steps=12, batch_size=2, seq_len=24, learning_rate=1e-2, warmup_steps=1,
                   log_every=1, checkpoint_every=0, seed=0, mtp_loss_weight=0.3)


class MtpLossTest(absltest.TestCase):

  def _batch(self, seed=3):
    rng = np.random.default_rng(seed)
    # Host arrays: the tests slice them, which on the device compiles a program per slice.
    toks = rng.integers(1, TCFG_CFG.vocab_size, (2, 24)).astype(np.int32)
    w = rng.uniform(0.5, 1.0, (2, 24)).astype(np.float32)
    return toks, w

  def test_weight_zero_is_the_old_loss_and_depths_align(self):
    ccfg = compute_config(TCFG_CFG, TCFG)
    params = init_params_np(ccfg, mtp=())
    toks, w = self._batch()
    off = dataclasses.replace(TCFG, mtp_loss_weight=0.0)
    total0, m0 = loss_jit(params, toks, w, cfg=ccfg, tcfg=off)
    self.assertNotIn("mtp_loss", m0)
    # The loss before MTP existed: next-token cross entropy of the main model (balance "bias"
    # adds nothing to it).
    pos = _positions(2, 23)
    logits, _, pre = apply_jit(params, toks[:, :-1], pos, None, cfg=ccfg, return_pre_norm=True)
    logp = _log_softmax_np(logits)
    nll = -np.take_along_axis(logp, np.asarray(toks[:, 1:])[..., None], -1)[..., 0]
    old = np.sum(nll * np.asarray(w[:, 1:])) / np.sum(np.asarray(w[:, 1:]))
    self.assertAlmostEqual(float(total0), old, delta=1e-5 * old)
    # With lambda > 0 the main loss is the same and the total adds lambda * the MTP loss.
    total, m = loss_jit(params, toks, w, cfg=ccfg, tcfg=TCFG)
    self.assertAlmostEqual(float(m["loss"]), float(m0["loss"]), delta=1e-6)
    self.assertAlmostEqual(float(total), float(m["loss"]) + 0.3 * float(m["mtp_loss"]), delta=1e-5)
    # Depth 1 at input position i predicts t_{i+2}: the last input position has no target.
    (ml,) = jax.jit(mtp_forward_all, static_argnames=("cfg",))(params, pre, toks[:, :-1], cfg=ccfg)
    logp1 = _log_softmax_np(np.asarray(ml)[:, :-1])  # positions 0..21
    nll1 = -np.take_along_axis(logp1, np.asarray(toks[:, 2:])[..., None], -1)[..., 0]
    want = np.sum(nll1 * np.asarray(w[:, 2:])) / np.sum(np.asarray(w[:, 2:]))
    self.assertAlmostEqual(float(m["mtp_loss"]), want, delta=1e-5 * want)

  def test_training_lowers_the_mtp_loss(self):
    toks, w = self._batch()
    # One fixed batch, learned by heart: the MTP loss must fall (its layer is trained) while
    # the main loss falls as before.
    res = train(TCFG_CFG, TCFG, lambda step: (np.asarray(toks), np.asarray(w)), progress=None,
                init=init_params_np(compute_config(TCFG_CFG, TCFG)))
    self.assertIn("mtp", res.params)
    first, last = res.history[0], res.history[-1]
    self.assertLess(last["mtp_loss"], 0.8 * first["mtp_loss"])
    self.assertLess(last["loss"], first["loss"])
    self.assertTrue(np.any(np.asarray(res.params["mtp"][0]["ffn"]["router_bias"]) != 0))


if __name__ == "__main__":
  absltest.main()
