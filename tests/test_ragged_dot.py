"""The CPU block-sparse ragged matmul against jax.lax.ragged_dot."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from mlkit.quant.dispatch import ragged_dot_f32


def _normal(seed, shape):
  # numpy draws: jax.random would compile a threefry program per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


class RaggedDotTest(parameterized.TestCase):

  def test_auto_choice_matches(self):
    # Large enough that the CPU picks the blocked form on its own.
    x = _normal(4, (512, 16))
    w = _normal(5, (16, 16, 8))
    gs = jnp.full((16,), 30, jnp.int32)
    ref = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(jax.jit(ragged_dot_f32)(x, w, gs), ref, rtol=1e-5, atol=1e-5)

  @parameterized.named_parameters(
      ("balanced", 96, [12] * 8),
      ("empty_groups_and_tail", 50, [0, 7, 0, 20, 1, 0, 13, 0]),  # sums to 41 < 50
      ("one_group_holds_all", 64, [0, 0, 64, 0]),
      ("single_row", 1, [0, 1, 0]),
      ("large_groups", 300, [150, 3, 147]),
  )
  def test_matches_ragged_dot(self, M, sizes):
    G = len(sizes)
    x = _normal(0, (M, 24))
    w = _normal(1, (G, 24, 40))
    gs = jnp.asarray(sizes, jnp.int32)
    ref = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    # The block loop (on a CPU: unused blocks skipped) and the batched form.
    for per_block in (True, False):
      out = jax.jit(lambda x, w, g, p=per_block: ragged_dot_f32(x, w, g, blocked=True,
                                                                per_block=p))(x, w, gs)
      self.assertEqual(out.shape, (M, 40))
      self.assertTrue(np.all(np.isfinite(np.asarray(out))))
      np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
      # Rows past the groups are exactly zero.
      np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0)

  @parameterized.named_parameters(
      ("spread", None),
      ("all_to_one_expert", 5),
  )
  def test_decode_step_shapes_take_the_cpu_block_forms(self, only):
    # A decode step of 8 tokens x top-4 over 16 experts of 512 x 256: ragged_dot would do
    # 16x the work, so the CPU picks its block forms on its own (docs/cpu_speed.md): expert
    # slots, or the block loop when every row goes to one expert (more rows than slots).
    M, G, K, N = 32, 16, 512, 256
    rng = np.random.default_rng(7)
    ids = np.full(M, only) if only is not None else np.sort(rng.integers(0, G, M))
    gs = jnp.asarray(np.bincount(ids, minlength=G), jnp.int32)
    x, w = _normal(8, (M, K)), _normal(9, (G, K, N))
    self.assertIn("custom_vjp_call", str(jax.make_jaxpr(ragged_dot_f32)(x, w, gs)))
    ref = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(jax.jit(ragged_dot_f32)(x, w, gs), ref, rtol=1e-5, atol=1e-4)

  def test_moe_dispatch_matches_the_ragged_dot_path(self):
    # The MoE layer through the CPU block forms against the same layer through plain
    # ragged_dot (the path these shapes took before), with empty experts and one expert
    # that every token picks.
    from mlkit.model import moe
    from mlkit.quant import dispatch
    N, k, E, D, F = 8, 4, 16, 256, 128
    rng = np.random.default_rng(11)
    p = {"w_gate": _normal(12, (E, D, F)) / D**0.5, "w_up": _normal(13, (E, D, F)) / D**0.5,
         "w_down": _normal(14, (E, F, D)) / F**0.5}
    x = _normal(15, (N, D))
    # Every token picks expert 0 and three of experts 1-5; experts 6-15 get no rows.
    others = np.stack([rng.choice(np.arange(1, 6), k - 1, replace=False) for _ in range(N)])
    ids = jnp.asarray(np.concatenate([np.zeros((N, 1), int), others], 1), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (N, k)), jnp.float32)
    run = lambda: jax.jit(lambda p, x, i, wt: moe.dispatch_experts(p, x, i, wt, E))(  # noqa: E731
        p, x, ids, weights)
    new = run()
    saved = dispatch._CPU_RAGGED_MAX_MACS
    dispatch._CPU_RAGGED_MAX_MACS = 1 << 62  # read when traced: this trace takes ragged_dot
    try:
      old = run()
    finally:
      dispatch._CPU_RAGGED_MAX_MACS = saved
    scale = float(jnp.max(jnp.abs(old)))
    self.assertGreater(scale, 0.1)
    self.assertLess(float(jnp.max(jnp.abs(new - old))) / scale, 1e-5)

  def test_gradients_match(self):
    x = _normal(2, (20, 8))
    w = _normal(3, (4, 8, 6))
    gs = jnp.asarray([5, 0, 9, 6], jnp.int32)
    # Jitted: one compile per function instead of one per eager op of the backward pass.
    f = lambda fn: jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w, gs))),  # noqa: E731
                                    argnums=(0, 1)))(x, w)
    ref = f(lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32))
    out = f(lambda x, w, g: ragged_dot_f32(x, w, g, blocked=True))
    for a, b in zip(out, ref):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
