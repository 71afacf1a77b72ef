"""tests/host_callbacks.py: io_callback hands numpy copies, values and failures unchanged."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax.experimental import io_callback
from jax._src import callback
from jax._src.pallas.mosaic_gpu.interpret import shared_memory

import host_callbacks


class HostCallbacksTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if os.environ.get("JAX_IO_CALLBACKS") == "jax":
      self.skipTest("JAX_IO_CALLBACKS=jax: jax's own io_callback runs")
    # conftest installs it while collecting; installing again changes nothing.
    installed = (callback.io_callback_impl, shared_memory._to_int)
    self.assertTrue(host_callbacks.install())
    self.assertEqual((callback.io_callback_impl, shared_memory._to_int), installed)

  def test_callback_gets_numpy_copies_and_returns_the_same_values(self):
    seen = []

    def host(x, i):
      seen.append((type(x), type(i), x.copy()))
      return (x * 2 + int(i)).astype(np.float32)

    @jax.jit
    def f(x, i):
      return io_callback(host, jax.ShapeDtypeStruct(x.shape, jnp.float32), x, i)

    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    out = np.asarray(f(x, np.int32(7)))
    np.testing.assert_array_equal(out, x * 2 + 7)
    self.assertEqual(seen[0][:2], (np.ndarray, np.ndarray))
    np.testing.assert_array_equal(seen[0][2], x)

  def test_a_failing_callback_fails_the_call(self):
    def host(x):
      raise ValueError("refused")

    @jax.jit
    def f(x):
      return io_callback(host, jax.ShapeDtypeStruct((), jnp.int32), x)

    with self.assertRaisesRegex(Exception, "refused"):
      jax.block_until_ready(f(np.int32(1)))

  def test_interpreter_reads_numpy_scalars_as_ints(self):
    for value in (np.int32(3), np.array(3, np.int32), jnp.int32(3), 3):
      self.assertEqual(shared_memory._to_int(value), 3)
    with self.assertRaises(ValueError):
      shared_memory._to_int("3")


if __name__ == "__main__":
  absltest.main()
