"""Tests for mlkit.train: schedule, balancing rules, capacity dispatch, loss decrease, resume."""

import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_MLA
from mlkit.evals.tasks import GENERATORS, TaskConfig, example_tokens, packed_batch
from mlkit.evals.tokenizer import PAD, CharTokenizer
from mlkit.model.moe import route
from mlkit.quant import grouped_matmul
from mlkit.train import (CapacityExperts, TrainConfig, compute_config, expert_capacity, loss_fn,
                         lr_schedule, plot_loss, train, update_router_bias)
from host_data import put
from numpy_params import init_params_np

# A 2-layer TINY_MLA (one dense, one MoE layer) keeps compilation short.
CFG = dataclasses.replace(TINY_MLA, n_layers=2)
TASKS = TaskConfig(arith_digits=(1, 2), retrieval_pairs=(2, 4))
TCFG = TrainConfig(steps=40, batch_size=4, seq_len=96, learning_rate=3e-3, warmup_steps=5,
                   log_every=1, checkpoint_every=0, bias_update_rate=1e-2, seed=0)


def init():
  """Fresh f32 initial params (train donates them), drawn with numpy: init_params would
  compile a threefry program per config."""
  return init_params_np(compute_config(CFG, TCFG))


def batch_fn(step):
  return packed_batch(np.random.default_rng([7, step]), TCFG.batch_size, TCFG.seq_len, tc=TASKS)


# One jitted loss for the tests that compare losses, so equal shapes compile once.
loss_jit = jax.jit(loss_fn, static_argnames=("cfg", "tcfg"))


def _normal(seed, shape):
  # Drawn and cast on the host, placed without compiling (an eager cast is a program).
  return put(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


class TrainConfigTest(parameterized.TestCase):

  @parameterized.parameters(("steps", 0), ("learning_rate", 0.0), ("balance", "magic"),
                            ("capacity_factor", 0.5), ("compute_dtype", "float16"),
                            ("min_lr_ratio", 1.5), ("seq_len", 1))
  def test_invalid_field_named(self, field, value):
    with self.assertRaisesRegex(ValueError, f"TrainConfig.{field}"):
      TrainConfig(**{field: value})

  def test_schedule_warmup_peak_and_floor(self):
    tc = TrainConfig(steps=100, warmup_steps=10, learning_rate=1e-3, min_lr_ratio=0.1)
    s = jax.jit(lr_schedule(tc))  # one program for every step, not one per op and call
    self.assertEqual(float(s(0)), 0.0)
    self.assertAlmostEqual(float(s(5)), 5e-4, places=8)
    self.assertAlmostEqual(float(s(10)), 1e-3, places=8)
    self.assertAlmostEqual(float(s(100)), 1e-4, places=8)
    self.assertGreater(float(s(40)), float(s(70)))


class BalancingTest(absltest.TestCase):

  def test_bias_moves_against_load(self):
    cfg = compute_config(CFG, TCFG)
    params = init()
    E = cfg.n_routed_experts
    load = np.full((cfg.n_moe_layers, E), 1.0 / E, np.float32)
    load[0, 0] += 0.2  # overloaded
    load[0, 1] -= 0.1  # underloaded
    load[0, 2] -= 0.1
    # Jitted: op by op, the update compiles a program per op and leaf shape.
    new = jax.jit(update_router_bias, static_argnums=(2, 3))(params, put(load), cfg, 0.05)
    b = np.asarray(new["layers"][1]["ffn"]["router_bias"])
    self.assertAlmostEqual(b[0], -0.05, places=6)
    self.assertAlmostEqual(b[1], 0.05, places=6)
    self.assertAlmostEqual(b[3], 0.0, places=6)  # exactly at the mean: no move
    # A large enough bias steers selection away from expert 0 without changing the combine weights.
    x = _normal(1, (64, cfg.d_model))
    bias = np.zeros(E, np.float32)
    bias[0] = -10.0
    ffn = dict(new["layers"][1]["ffn"], router_bias=put(bias))
    route_jit = jax.jit(route, static_argnums=2)
    ids, w, _ = route_jit(ffn, x, cfg)
    self.assertFalse(np.any(np.asarray(ids) == 0))
    ids0, w0, _ = route_jit(dict(ffn, router_bias=put(np.zeros(E, np.float32))), x, cfg)
    self.assertTrue(np.any(np.asarray(ids0) == 0))


class AuxLossTest(absltest.TestCase):

  def test_aux_loss_reaches_the_router(self):
    tc = dataclasses.replace(TCFG, balance="aux", aux_loss_weight=1.0, compute_dtype="float32")
    cfg = compute_config(CFG, tc)
    params = init()  # f32 params either way
    tokens, weights = packed_batch(np.random.default_rng(0), 2, 40, tc=TASKS, tasks=("arithmetic",))
    tokens, weights = put(tokens, weights)

    def losses(p):
      total, m = loss_fn(p, tokens, weights, cfg=cfg, tcfg=tc)
      return jnp.stack([total, m["loss"]]), m

    @jax.jit
    def both(p):
      # One forward pass, then the gradients of the total and of the cross entropy alone.
      (total, ce), pullback, m = jax.vjp(losses, p, has_aux=True)
      g_total, = pullback(jnp.array([1.0, 0.0]))
      g_ce, = pullback(jnp.array([0.0, 1.0]))
      return total, ce, m, g_total, g_ce

    total, ce, m, g_total, g_ce = both(params)
    self.assertAlmostEqual(float(total) - float(ce), float(m["balance_loss"]), places=4)
    self.assertGreaterEqual(float(m["balance_loss"]), 0.5)  # E * sum f_i P_i ~ 1 when balanced
    gr_total = np.asarray(g_total["layers"][1]["ffn"]["router"])
    gr_ce = np.asarray(g_ce["layers"][1]["ffn"]["router"])
    self.assertGreater(np.abs(gr_total - gr_ce).max(), 1e-6)  # the aux term reaches the router
    # Selection through top-k gives the bias no gradient: it is trained by the bias rule only.
    np.testing.assert_array_equal(np.asarray(g_total["layers"][1]["ffn"]["router_bias"]), 0.0)


# The capacity matmul and its ragged_dot reference, jitted: one compile per shape and
# capacity factor instead of one per op.
_capacity_matmul = jax.jit(lambda x, w, gs, factor: grouped_matmul(
    x, CapacityExperts(w, capacity_factor=factor), gs, out_dtype=jnp.float32),
    static_argnums=3)
_ragged_dot = jax.jit(jax.lax.ragged_dot)


class CapacityExpertsTest(parameterized.TestCase):

  def _inputs(self, sizes, K=8, N=4):
    E = len(sizes)
    M = sum(sizes) + 3  # trailing rows past sum(group_sizes) must come out zero
    x = _normal(0, (M, K))
    w = _normal(1, (E, K, N))
    return x, w, put(np.asarray(sizes, np.int32))

  def test_matches_ragged_dot_with_enough_capacity(self):
    x, w, gs = self._inputs([3, 0, 7, 2])
    ref = _ragged_dot(x, w, gs)
    got = _capacity_matmul(x, w, gs, 4.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    self.assertTrue(np.all(np.asarray(got)[12:] == 0))

  def test_overflow_rows_dropped(self):
    x, w, gs = self._inputs([12, 1, 1, 1])
    C = expert_capacity(x.shape[0], 4, 1.0)  # ceil(18 / 4) = 5
    self.assertEqual(C, 5)
    ref = np.asarray(_ragged_dot(x, w, gs))
    got = np.asarray(_capacity_matmul(x, w, gs, 1.0))
    np.testing.assert_allclose(got[:C], ref[:C], rtol=1e-5, atol=1e-5)
    self.assertTrue(np.all(got[C:12] == 0))  # expert 0's rows past its capacity
    np.testing.assert_allclose(got[12:15], ref[12:15], rtol=1e-5, atol=1e-5)

  def test_gradient_flows_to_weight(self):
    x, w, gs = self._inputs([3, 2, 2, 2])
    g = jax.jit(jax.grad(lambda w: jnp.sum(grouped_matmul(x, CapacityExperts(w, 4.0), gs))))(w)
    g_ref = jax.jit(jax.grad(lambda w: jnp.sum(jax.lax.ragged_dot(x, w, gs))))(w)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-5)

  def test_dropless_loss_equals_roomy_capacity_loss(self):
    # Dropless training (the default) and slabs with room for every row compute the same loss.
    from mlkit.train import init_train_state
    tcfg32 = dataclasses.replace(TCFG, compute_dtype="float32")
    params = init_train_state(CFG, tcfg32, init())["params"]
    tokens, weights = put(*batch_fn(0))
    ccfg = compute_config(CFG, tcfg32)
    dropless, _ = loss_jit(params, tokens, weights, cfg=ccfg, tcfg=tcfg32)
    roomy = dataclasses.replace(tcfg32, capacity_factor=float(CFG.n_routed_experts))
    slabs, m = loss_jit(params, tokens, weights, cfg=ccfg, tcfg=roomy)
    self.assertIsNone(TCFG.capacity_factor)
    np.testing.assert_allclose(float(dropless), float(slabs), rtol=1e-5)
    tight = dataclasses.replace(tcfg32, capacity_factor=1.0)
    self.assertNotAlmostEqual(float(loss_jit(params, tokens, weights, cfg=ccfg, tcfg=tight)[0]),
                              float(dropless), places=6)

  def test_packed_segments_loss_equals_separate_rows(self):
    # Two examples packed into one row with segment ids train on exactly the loss of the same
    # examples in rows of their own (dropless MoE routing is per token).
    from mlkit.train import init_train_state
    tcfg32 = dataclasses.replace(TCFG, compute_dtype="float32")
    ccfg = compute_config(CFG, tcfg32)
    params = init_train_state(CFG, tcfg32, init())["params"]
    rng = np.random.default_rng(3)
    exs = [example_tokens(CharTokenizer(), GENERATORS[t](rng, TASKS))
           for t in ("arithmetic", "retrieval")]
    # Batches of the train config's shape, PAD rows (weight 0) after the examples: the
    # segment-free loss compiles once for this test and the dropless one.
    B, T = TCFG.batch_size, TCFG.seq_len
    sep_tok, sep_w = np.full((B, T), PAD, np.int32), np.zeros((B, T), np.float32)
    packed_tok, packed_w = np.full((B, T), PAD, np.int32), np.zeros((B, T), np.float32)
    segs, t = np.zeros((B, T), np.int32), 0
    for i, (ids, ans) in enumerate(exs):
      w = np.where(np.asarray(ans) == 1, 1.0, 0.3)
      w[0] = 0.0
      sep_tok[i, :len(ids)], sep_w[i, :len(ids)] = ids, w
      packed_tok[0, t:t + len(ids)], packed_w[0, t:t + len(ids)] = ids, w
      segs[0, t:t + len(ids)] = i + 1
      t += len(ids)
    alone, _ = loss_jit(params, sep_tok, sep_w, cfg=ccfg, tcfg=tcfg32)
    packed, _ = loss_jit(params, packed_tok, packed_w, segs, cfg=ccfg, tcfg=tcfg32)
    np.testing.assert_allclose(float(packed), float(alone), rtol=1e-5)
    leaky, _ = loss_jit(params, packed_tok, packed_w, cfg=ccfg, tcfg=tcfg32)
    self.assertNotAlmostEqual(float(leaky), float(alone), places=4)

  def test_batch_fn_arity_checked(self):
    with self.assertRaisesRegex(ValueError, "gave 1 arrays"):
      train(CFG, TCFG, lambda step: (batch_fn(step)[0],), progress=None, init=init())
    bad = lambda step: (*batch_fn(step), np.zeros((TCFG.batch_size, 5), np.int32))  # noqa: E731
    with self.assertRaisesRegex(ValueError, "expected"):
      train(CFG, TCFG, bad, progress=None, init=init())


class TrainLoopTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.full = train(CFG, TCFG, batch_fn, progress=None, init=init())

  def test_loss_decreases(self):
    h = self.full.history
    first = np.mean([m["loss"] for m in h[:3]])
    last = np.mean([m["loss"] for m in h[-5:]])
    # Random init starts near ln(256) = 5.5; the packed task data is highly predictable.
    self.assertGreater(first, 4.5)
    self.assertLess(last, 0.6 * first, msg=f"loss {first:.3f} -> {last:.3f}")
    self.assertTrue(all(np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) for m in h))

  def test_master_weights_f32_and_router_bias_moved_by_rule(self):
    p = self.full.params
    self.assertTrue(all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(p)))
    b = np.asarray(p["layers"][1]["ffn"]["router_bias"])
    # Each step moves every bias by exactly +-rate or 0, so it stays on the rate's grid.
    steps = b / TCFG.bias_update_rate
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    self.assertGreater(np.abs(b).max(), 0)

  def test_resume_gives_same_next_step(self):
    with tempfile.TemporaryDirectory() as d:
      first = train(CFG, TCFG, batch_fn, checkpoint_dir=d, progress=None, stop_at=6, init=init())
      self.assertIsNone(first.resumed_from)
      resumed = train(CFG, TCFG, batch_fn, checkpoint_dir=d, progress=None, stop_at=7, init=init())
      self.assertEqual(resumed.resumed_from, 6)
      self.assertEqual(int(resumed.state["step"]), 7)
    seen = []  # the on_step hook sees every step's params before the next step donates them
    straight = train(CFG, TCFG, batch_fn, progress=None, stop_at=7, init=init(),
                     on_step=lambda step, p: seen.append((step, np.asarray(p["lm_head"]))))
    self.assertEqual([s for s, _ in seen], list(range(1, 8)))
    np.testing.assert_array_equal(seen[-1][1], np.asarray(straight.params["lm_head"]))
    self.assertFalse(np.array_equal(seen[0][1], seen[-1][1]))
    for a, b in zip(jax.tree_util.tree_leaves(resumed.state), jax.tree_util.tree_leaves(straight.state)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    self.assertAlmostEqual(resumed.history[-1]["loss"], straight.history[-1]["loss"], places=5)
    # The resumed run is not trivially equal to its starting point.
    self.assertFalse(np.allclose(np.asarray(first.params["lm_head"]),
                                 np.asarray(resumed.params["lm_head"])))

  def test_plot_written(self):
    with tempfile.TemporaryDirectory() as d:
      path = plot_loss(self.full.history, os.path.join(d, "loss.png"))
      with open(path, "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


if __name__ == "__main__":
  absltest.main()
