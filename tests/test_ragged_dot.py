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
    out = jax.jit(lambda x, w, g: ragged_dot_f32(x, w, g, blocked=True))(x, w, gs)
    self.assertEqual(out.shape, (M, 40))
    self.assertTrue(np.all(np.isfinite(np.asarray(out))))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # Rows past the groups are exactly zero.
    np.testing.assert_array_equal(np.asarray(out)[sum(sizes):], 0.0)

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
