"""MLA's absorbed query in one launch (``pallas_kernels.mla_absorb.absorbed_query``).

Interpreted, the kernel returns its reference's values (q_latent in bf16; the fp8
cache's f16 and e4m3 scaled query with padding heads) at Kimi K2.6's per-device shape
and a small one, within the dtypes' roundings of a float64 product; shapes it does not
tile run the reference; bad input; ``paged_mla_decode`` takes an ``AbsorbQuery`` (its
kernel in place of the absorbed product and the scaled query; "interpret" matches
"xla" over an fp8 cache, and "xla" is the plain query's op for op); H200 compiles: one
launch, no spills.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import h200_compile_cases
from pallas_kernels.mla_absorb import AbsorbQuery
from pallas_kernels.mla_absorb import absorbed_query
from pallas_kernels.mla_absorb import absorbed_query_reference
from pallas_kernels.mla_absorb import query as absorb_query

BF16, F8 = jnp.bfloat16, jnp.float8_e4m3fn
# (B, H, C, nope, R, v): Kimi K2.6's decode step on one of 8 H200s; a small shape.
KIMI = (64, 8, 512, 128, 64, 128)
SMALL = (16, 2, 64, 32, 16, 16)


@functools.cache
def _operands(seed, b, h, c, nope, r, v, dtype=BF16):
  """q_all [B, H, nope + R] with rows of magnitudes 1e-2 to 3e3, wkv_b [C, H, nope + v];
  made on the host and put on the device (no compiled program per dtype and shape)."""
  rng = np.random.default_rng(seed)
  mags = rng.choice([1e-2, 1.0, 3e3], size=(b, h, 1))
  q_all = (rng.normal(size=(b, h, nope + r)) * mags).astype(dtype)
  w = (rng.normal(size=(c, h, nope + v)) / np.sqrt(nope)).astype(dtype)
  return jax.device_put((q_all, w))


def _f64(x):
  """x [...] as float64 numpy (through float32, exact for every dtype here), on the host."""
  return np.asarray(x).astype(np.float32).astype(np.float64)


def _remade(f, x):
  """``f`` of x's host copy, back on the device: a slice or cast of a test input without
  a compiled program for it."""
  return jax.device_put(f(np.asarray(x)))


# The reference jitted: one program per shape, where an eager call compiles one per op.
_reference = jax.jit(absorbed_query_reference, static_argnames=("nope", "kind", "heads"))


def _exact(q_all, w, nope):
  """q_latent in float64, and the sum of its terms' magnitudes (the f32 sums' scale)."""
  qn, wk = _f64(q_all)[..., :nope], _f64(w)[..., :nope]
  return (np.einsum("bhd,chd->bhc", qn, wk),
          np.einsum("bhd,chd->bhc", np.abs(qn), np.abs(wk)))


def _assert_near_reference(test, got, want, rel):
  """Equal but for the f32 sums' order: < 1% of the elements differ, by one rounding."""
  got, want = _f64(got), _f64(want)
  test.assertLess(np.mean(got != want), 0.01)
  np.testing.assert_allclose(got, want, rtol=rel, atol=0)


class AbsorbedQueryTest(parameterized.TestCase):

  @parameterized.parameters(KIMI, SMALL)
  def test_q_latent(self, *shape):
    b, h, c, nope, r, v = shape
    q_all, w = _operands(0, *shape)
    self.assertTrue(absorb_query.kernel_takes(b, c, nope, r, BF16))
    got = absorbed_query(q_all, w, nope, interpret=True)
    self.assertEqual((got.shape, got.dtype), ((b, h, c), BF16))
    _assert_near_reference(self, got, _reference(q_all, w, nope=nope), 2.0**-7)
    exact, terms = _exact(q_all, w, nope)
    np.testing.assert_array_less(np.abs(_f64(got) - exact),
                                 2.0**-8 * np.abs(exact) + 2.0**-20 * terms + 1e-30)

  @parameterized.parameters(("f16", KIMI, 8), ("fp8", KIMI, 16), ("f16", SMALL, 8),
                            ("fp8", SMALL, 8))
  def test_scaled_query(self, kind, shape, heads):
    b, h, c, nope, r, v = shape
    q_all, w = _operands(1, *shape)
    got = absorbed_query(q_all, w, nope, kind=kind, heads=heads, interpret=True)
    want = _reference(q_all, w, nope=nope, kind=kind, heads=heads)
    dtype = jnp.float16 if kind == "f16" else F8
    for g, wt, shp in zip(got, want, ((b, heads, c), (b, heads, r), (b, heads))):
      self.assertEqual((g.shape, g.dtype), (shp, wt.dtype))
    self.assertEqual(got[0].dtype, dtype)
    scale = _f64(got[2])
    np.testing.assert_array_equal(scale, _f64(want[2]))
    for g, wt in zip(got[:2], want[:2]):
      _assert_near_reference(self, g, wt, 2.0**-10 if kind == "f16" else 2.0**-3)
    # Padding heads: zeros under factor 1.
    np.testing.assert_array_equal(_f64(got[0])[:, h:], 0.0)
    np.testing.assert_array_equal(_f64(got[1])[:, h:], 0.0)
    np.testing.assert_array_equal(scale[:, h:], 1.0)
    # Scaled back, the parts are q_latent and the rope part within the roundings: bf16's
    # of the product, then f16's (or e4m3's) of the scaled row.
    exact, terms = _exact(q_all, w, nope)
    parts = (exact, _f64(q_all)[..., nope:])
    rowmax = np.maximum(np.abs(parts[0]).max(-1), np.abs(parts[1]).max(-1))[..., None]
    bits = 2.0**-11 if kind == "f16" else 2.0**-4
    for g, part, extra in zip(got[:2], parts, (2.0**-8, 0.0)):
      back = _f64(g)[:, :h] * scale[:, :h, None]
      bound = (extra + bits) * np.abs(part) + 2.0**-20 * rowmax + 1e-30
      if part is exact:
        bound = bound + 2.0**-20 * terms
      # Half the smallest subnormal's spacing: f16's 2^-24, e4m3's 2^-9.
      bound = bound + (2.0**-25 if kind == "f16" else 2.0**-10) * scale[:, :h, None]
      np.testing.assert_array_less(np.abs(back - part), bound)

  def test_shapes_the_kernel_does_not_tile_run_the_reference(self):
    for shape, dtype in (((3, 2, 64, 32, 16, 16), BF16), ((16, 2, 64, 32, 16, 16), jnp.float32),
                         ((16, 2, 64, 32, 24, 16), BF16)):
      b, h, c, nope, r, v = shape
      q_all, w = _operands(2, *shape, dtype=dtype)
      self.assertFalse(absorb_query.kernel_takes(b, c, nope, r, dtype))
      fn = lambda q, w, nope=nope: absorbed_query(q, w, nope, kind="f16", heads=8,  # noqa: E731
                                                  interpret=True)
      self.assertNotIn("pallas_call", str(jax.make_jaxpr(fn)(q_all, w)))

  def test_bad_input(self):
    q_all, w = _operands(3, *SMALL)
    nope = SMALL[3]
    for args, kwargs, msg in (
        ((q_all, _remade(lambda a: a[:, :1], w), nope), {}, "wkv_b must be"),
        ((q_all, _remade(lambda a: a.astype(np.float32), w), nope), {}, "wkv_b must be"),
        ((_remade(lambda a: a[0], q_all), w, nope), {}, "q_all must be"),
        ((q_all, w, 0), {}, "nope must leave"),
        ((q_all, w, q_all.shape[-1]), {}, "nope must leave"),
        ((q_all, w, nope), {"kind": "bf16"}, "kind must be"),
        ((q_all, w, nope), {"kind": "f16"}, "heads >= H"),
        ((q_all, w, nope), {"kind": "fp8", "heads": 1}, "heads >= H")):
      with self.assertRaisesRegex(ValueError, msg):
        absorbed_query(*args, **kwargs)


def _fp8_pool(seed, n, ps, c, r):
  """An fp8 latent pool with per-token scales: (latent, k_rope, latent_scale, k_rope_scale)."""
  rng = np.random.default_rng(seed)
  out = []
  for width in (c, r):
    x = rng.normal(size=(n, ps, width)).astype(np.float32)
    s = np.abs(x).max(-1) / 448.0
    out.append(((x / s[..., None]).astype(F8), s.astype(np.float32)))
  (latent, ls), (k_rope, ks) = out
  return jax.device_put((latent, k_rope, ls, ks))


class PagedDecodeTest(absltest.TestCase):
  """``paged_mla_decode`` with an ``AbsorbQuery`` at Kimi's per-device heads and widths."""

  B, H, C, NOPE, R, V, N, PS = 16, 8, 512, 128, 64, 128, 6, 64

  def _args(self, seed):
    q_all, w = _operands(seed, self.B, self.H, self.C, self.NOPE, self.R, self.V)
    pool = _fp8_pool(seed, self.N, self.PS, self.C, self.R)
    rng = np.random.default_rng(seed)
    tables, lengths = jax.device_put((
        rng.integers(0, self.N, size=(self.B, 2)).astype(np.int32),
        rng.integers(0, 2 * self.PS + 1, size=(self.B,)).astype(np.int32)))
    return AbsorbQuery(q_all, w, self.NOPE), pool, tables, lengths

  def test_interpret_matches_xla_over_an_fp8_cache(self):
    from pallas_kernels.paged_attention import ops
    query, pool, tables, lengths = self._args(4)
    run = lambda q, backend: ops.paged_mla_decode(  # noqa: E731
        q, None, *pool, tables, lengths, scale=0.07, backend=backend)
    jaxpr = str(jax.make_jaxpr(lambda q: run(q, "interpret"))(query))
    self.assertIn("name=mla_absorbed_query", jaxpr)  # the product and the scaling
    self.assertNotIn("name=scaled_query", jaxpr)
    got, want = _f64(run(query, "interpret")), _f64(run(query, "xla"))
    self.assertGreater(np.abs(want).max(), 0.0)
    self.assertLess(np.linalg.norm(got - want) / np.linalg.norm(want), 1e-2)

  def test_xla_is_the_plain_querys_op_for_op(self):
    from pallas_kernels.paged_attention import ops
    query, pool, tables, lengths = self._args(5)
    q_latent = _reference(query.q_all, query.wkv_b, nope=self.NOPE)
    fn = functools.partial(ops.paged_mla_decode, scale=0.07, backend="xla")
    np.testing.assert_array_equal(
        _f64(fn(query, None, *pool, tables, lengths)),
        _f64(fn(q_latent, _remade(lambda a: a[..., self.NOPE:], query.q_all), *pool, tables,
                lengths)))
    with self.assertRaisesRegex(ValueError, "AbsorbQuery holds the rope part"):
      fn(query, query.q_all, *pool, tables, lengths)

  def test_over_a_bf16_cache_the_kernels_read_q_all_in_place(self):
    from pallas_kernels.paged_attention import ops
    query, pool, tables, lengths = self._args(6)
    spec = jax.ShapeDtypeStruct
    bf16_pool = (spec(pool[0].shape, BF16), spec(pool[1].shape, BF16), None, None)
    jaxpr = jax.make_jaxpr(lambda q, *a: ops.paged_mla_decode(
        q, None, *a, scale=0.07, backend="interpret"))(query, *bf16_pool, tables, lengths)
    text = str(jaxpr)
    self.assertIn("name=mla_absorbed_query", text)
    self.assertNotIn("name=scaled_query", text)
    # No slice of q_all's rope columns: the decode kernel reads them at rope_offset.
    self.assertNotIn(f"limit_indices=({self.B}, {self.H}, {self.NOPE + self.R})", text)


class AbsorbedQueryH200Test(h200_compile_cases.H200CompilerTest):

  @parameterized.parameters((None, 8, 8), ("f16", 8, 8), ("fp8", 16, 64))
  def test_one_launch_without_spills(self, kind, h, heads):
    from pallas_kernels.h200 import compile as hc
    b, _, c, nope, r, v = KIMI
    self.assert_one_launch_without_spills(
        jax.jit(lambda q, w: absorbed_query(q, w, nope, kind=kind, heads=heads)),
        hc.spec((b, h, nope + r), BF16), hc.spec((c, h, nope + v), BF16),
        kernel="mla_absorbed_query")


if __name__ == "__main__":
  absltest.main()
