"""The MLA decode kernels' scaled query in one launch (``paged_attention.query``).

Interpret mode returns the reference's bytes (f16 and e4m3, padded heads, rows from 1e-7
to 3e3 and all-zero rows) at Kimi K2.6's per-GPU shapes and small ones; the f16 factors
are frexp's powers of two for every normal row maximum, and the scaled rows round-trip
within f16's and e4m3's precision; shapes the kernel does not take run the reference;
bad input; the rope part read at a column offset of a wider array (bit for bit the plain
form's, and bad offsets refused); ``paged_mla_decode`` over an fp8 cache takes its query
from this kernel; and H200 compiles: one launch, no spills.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import h200_compile_cases
from pallas_kernels.paged_attention import query

F8 = jnp.float8_e4m3fn


def _parts(seed, b, h, c, r, dtype=jnp.bfloat16):
  """(q_latent [b, h, c], q_rope [b, h, r]): rows of magnitudes 0 and 1e-7 to 3e3, made on
  the host and put on the device (no compiled program per dtype and shape)."""
  rng = np.random.default_rng(seed)
  mags = rng.choice([1e-7, 1e-2, 1.0, 3e3, 0.0], size=(b, h, 1))
  mags[0, 0] = 0.0  # at least one all-zero row
  return jax.device_put(((rng.normal(size=(b, h, c)) * mags).astype(dtype),
                         (rng.normal(size=(b, h, r)) * mags).astype(dtype)))


def _host(x):
  """x [...] as float32 numpy, converted on the host."""
  return np.asarray(x).astype(np.float32)


def _equal(test, got, want):
  for g, w in zip(got, want):
    test.assertEqual(g.dtype, w.dtype)
    np.testing.assert_array_equal(_host(g), _host(w))


# The reference jitted: one program per shape, where an eager call compiles one per op.
_reference = jax.jit(query.scaled_query_reference, static_argnames=("heads", "kind",
                                                                    "rope_cols"))


class ScaledQueryTest(parameterized.TestCase):

  @parameterized.product(shape=[(4, 8, 512, 64, 8), (2, 16, 128, 32, 64), (1, 8, 64, 16, 16)],
                         kind=["f16", "fp8"])
  def test_interpret_returns_the_references_bytes(self, shape, kind):
    b, h, c, r, heads = shape
    ql, qr = _parts(0, b, h, c, r)
    self.assertTrue(query.kernel_takes(ql, qr))
    got = query.scaled_query(ql, qr, heads=heads, kind=kind, interpret=True)
    _equal(self, got, _reference(ql, qr, heads=heads, kind=kind))
    self.assertEqual(got[0].shape, (b, heads, c))
    # Padding heads: zeros under factor 1.
    np.testing.assert_array_equal(_host(got[0])[:, h:], 0.0)
    np.testing.assert_array_equal(np.asarray(got[2])[:, h:], 1.0)

  def test_f16_factors_are_frexps_powers_of_two(self):
    amax = np.array([1.0, 3.0, 0.75, 2.0**-120, 2.0**-113, 2.0**-112, 1e30, 3.4e38, 7e4],
                    np.float32)
    _, e = np.frexp(amax)
    row_scale = jax.jit(query.f16_row_scale)  # one program per shape, not one per op
    np.testing.assert_array_equal(np.asarray(row_scale(jax.device_put(amax))),
                                  np.ldexp(np.float32(1), e - query.F16_ROW_MAX_LOG2))
    self.assertEqual(float(row_scale(jax.device_put(np.float32(0.0)))), 1.0)

  @parameterized.parameters(("f16", 2.0**-11), ("fp8", 2.0**-4))
  def test_scaled_rows_round_trip(self, kind, bits):
    ql, qr = _parts(1, 3, 8, 512, 64, jnp.float32)
    l8, r8, scale = query.scaled_query(ql, qr, heads=8, kind=kind, interpret=True)
    q = np.concatenate([np.asarray(ql), np.asarray(qr)], -1)
    back = np.concatenate([np.asarray(l8, np.float32), np.asarray(r8, np.float32)], -1)
    scale = np.asarray(scale)
    self.assertTrue(np.isfinite(back).all())
    amax = np.abs(q).max(-1)
    if kind == "f16":  # largest |value| of a nonzero row in [2^13, 2^14)
      got = np.abs(back).max(-1)[amax > 0]
      self.assertTrue(((got >= 2.0**13) & (got < 2.0**14)).all())
    else:
      self.assertLessEqual(np.abs(back).max(), 448.0)
    err = np.abs(back * scale[..., None] - q).max(-1)
    np.testing.assert_array_less(err, amax * bits + 1e-30)

  def test_shapes_the_kernel_does_not_take_run_the_reference(self):
    for b, h, c, r in ((2, 6, 64, 16), (2, 8, 96, 16), (2, 8, 64, 24)):
      ql, qr = _parts(2, b, h, c, r)
      self.assertFalse(query.kernel_takes(ql, qr))
      fn = lambda a, q: query.scaled_query(a, q, heads=8, kind="f16",  # noqa: E731
                                           interpret=True)
      self.assertNotIn("pallas_call", str(jax.make_jaxpr(fn)(ql, qr)))
      _equal(self, fn(ql, qr), _reference(ql, qr, heads=8, kind="f16"))

  def test_bad_input(self):
    ql, qr = _parts(3, 2, 8, 64, 16)
    with self.assertRaisesRegex(ValueError, "does not match"):
      query.scaled_query(ql, jax.device_put(np.asarray(qr)[:1]), heads=8, kind="f16")
    with self.assertRaisesRegex(ValueError, "multiple of 8"):
      query.scaled_query(ql, qr, heads=12, kind="f16")
    with self.assertRaisesRegex(ValueError, "multiple of 8"):
      query.scaled_query(ql, qr, heads=0, kind="f16")
    with self.assertRaisesRegex(ValueError, "kind must be"):
      query.scaled_query(ql, qr, heads=8, kind="bf16")

  def test_rope_columns_of_a_wider_array(self):
    """The decode step's query array [B, H, nope + v + R]: the kernel reads its rope part at
    block (nope + v) / R and returns the plain form's bytes; columns it must not read are
    NaN. An offset that is not a multiple of R runs the reference on those columns."""
    b, h, c, r, off = 2, 8, 512, 64, 256
    ql, qr = _parts(5, b, h, c, r)
    wide = np.full((b, h, off + r), np.nan, qr.dtype)
    wide[..., off:] = np.asarray(qr)
    # The rope part at column 257: the wide array behind one more column.
    wide, odd = jax.device_put((wide, np.concatenate([wide[..., :1], wide], -1)))
    for kind in ("f16", "fp8"):
      got = query.scaled_query(ql, wide, heads=16, kind=kind, rope_cols=(off, r),
                               interpret=True)
      _equal(self, got, query.scaled_query(ql, qr, heads=16, kind=kind, interpret=True))
    # The kernel's operand is the wide array itself, not a copy of its rope columns.
    (call,) = [e for e in jax.make_jaxpr(lambda a, q: query.scaled_query(
        a, q, heads=8, kind="f16", rope_cols=(off, r)))(ql, wide).eqns[0].params["jaxpr"].eqns
               if e.primitive.name == "pallas_call"]
    self.assertEqual(call.invars[1].aval.shape, (b, h, off + r))
    self.assertFalse(query.kernel_takes(ql, odd, (off + 1, r)))
    _equal(self, query.scaled_query(ql, odd, heads=8, kind="fp8", rope_cols=(off + 1, r)),
           _reference(ql, qr, heads=8, kind="fp8"))

  def test_bad_rope_columns(self):
    ql, qr = _parts(6, 2, 8, 64, 16)
    for cols in ((-16, 16), (8, 16), (0, 0)):
      with self.assertRaisesRegex(ValueError, "do not lie within"):
        query.scaled_query(ql, qr, heads=8, kind="f16", rope_cols=cols)

  def test_paged_mla_decode_over_fp8_takes_the_kernels_query(self):
    from pallas_kernels.paged_attention import ops
    # Kimi's per-GPU heads and widths over an fp8 cache, as the decode step runs it.
    b, h, c, r, n, ps = 2, 8, 512, 64, 4, 64
    ql, qr = _parts(4, b, h, c, r)
    spec = jax.ShapeDtypeStruct
    jaxpr = str(jax.make_jaxpr(lambda *a: ops.paged_mla_decode(
        *a, scale=0.1, backend="interpret"))(
            ql, qr, spec((n, ps, c), F8), spec((n, ps, r), F8), spec((n, ps), jnp.float32),
            spec((n, ps), jnp.float32), spec((b, 2), jnp.int32), spec((b,), jnp.int32)))
    self.assertIn("name=scaled_query", jaxpr)


class ScaledQueryH200Test(h200_compile_cases.H200CompilerTest):

  @parameterized.parameters("f16", "fp8")
  def test_one_launch_without_spills(self, kind):
    from pallas_kernels.h200 import compile as hc
    # Kimi K2.6's decode step on one of 8 H200s: 64 requests, 8 heads, latent 512, rope 64;
    # and 64 heads padded to a 64-head block.
    for h, heads in ((8, 8), (16, 64)):
      self.assert_one_launch_without_spills(
          jax.jit(lambda ql, qr, heads=heads: query.scaled_query(ql, qr, heads=heads,
                                                                kind=kind)),
          hc.spec((64, h, 512), jnp.bfloat16), hc.spec((64, h, 64), jnp.bfloat16),
          kernel="scaled_query")

  def test_rope_read_at_an_offset_one_launch_without_spills(self):
    from pallas_kernels.h200 import compile as hc
    # The decode step's query array [64, 8, 320]: the rope part from column 256 on.
    self.assert_one_launch_without_spills(
        jax.jit(lambda ql, qq: query.scaled_query(ql, qq, heads=8, kind="f16",
                                                  rope_cols=(256, 64))),
        hc.spec((64, 8, 512), jnp.bfloat16), hc.spec((64, 8, 320), jnp.bfloat16),
        kernel="scaled_query")


if __name__ == "__main__":
  absltest.main()
