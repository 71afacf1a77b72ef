"""The page write in one Pallas Triton launch (``pallas_kernels.page_write``).

Interpret mode stores the same bytes as the jnp reference (e4m3 quantisation per token,
one scatter per pool array) at MLA's shapes, with rows that are padding or past their
request (no write); the written rows dequantise to the entries within the fp8 bound and
no other row changes; float pools and shapes the kernel does not take run the reference;
bad input; ``PagedKVState.write`` on the kernel backends equals "xla"; and compiles for
an H200 at Kimi K2.6's decode shapes: one launch, no spills.

MLA's write with its entries' RMSNorm and rope in the same launch (``write_mla_pages``):
interpret mode stores the reference's bytes for fp8 and float pools, both rope pairings;
the reference's entries are the model's own ops bit for bit; the stored rows hold the
norm and rope computed in float64 within the fp8 bound; the reference where the kernel
does not fit; bad input; ``PagedKVState.write`` of an ``MlaProjection`` equals the write
of its entries; and one launch without spills on an H200, for fp8 and bf16 pools.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import h200_compile_cases
from configs import TINY_MLA
from mlkit.kvcache import BatchMeta, KVCacheConfig
from mlkit.kvcache.state import init_paged_state
from mlkit.model import rope
from mlkit.model.layers import rms_norm
from pallas_kernels.page_write import (MlaProjection, kernel_takes, mla_entries_reference,
                                       mla_kernel_takes, write_mla_pages, write_pages,
                                       write_pages_reference)

F8 = jnp.float8_e4m3fn


def _case(seed, *, n=12, p=8, widths=(128, 32), rows=10, pool=F8, entry=jnp.bfloat16,
          dropped=(3,)):
  """Random pools (not zeros), entries, and distinct (page, slot) targets; rows in
  ``dropped`` get page n (outside the pool: not written), and one a negative page. Made
  on the host and put on the device (no compiled program per dtype and shape)."""
  rng = np.random.default_rng(seed)
  pages = tuple(rng.normal(size=(n, p, d)).astype(np.float32).astype(pool) for d in widths)
  scales = (tuple(rng.uniform(0.5, 2, (n, p)).astype(np.float32) for _ in widths)
            if pool == F8 else None)
  # Entries over several magnitudes, one row all zeros (scale 1).
  entries = [rng.normal(size=(rows, d)) * rng.choice([1e-3, 1.0, 300.0], (rows, 1))
             for d in widths]
  for e in entries:
    e[min(1, rows - 1)] = 0.0
  entries = tuple(e.astype(np.float32).astype(entry) for e in entries)
  flat = rng.permutation(n * p)[:rows]
  page, slot = (flat // p).astype(np.int32), (flat % p).astype(np.int32)
  for r in dropped:
    page[r] = n
  if rows > 5:
    page[5] = -1
  return jax.device_put((entries, pages, scales, page, slot))


def _host(x):
  """x [...] as float32 numpy, converted on the host."""
  return np.asarray(x).astype(np.float32)


def _remade(f, xs):
  """The arrays of ``xs`` with ``f`` applied to their host copies, back on the device: a
  slice or a cast of a test input without a compiled program for it."""
  return jax.device_put(jax.tree.map(lambda x: f(np.asarray(x)), xs))


def _equal(test, got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    test.assertEqual(g.dtype, w.dtype)
    np.testing.assert_array_equal(_host(g), _host(w))


# The kernel and the references jitted: one program per shape, where an eager call compiles
# one per op.
_write_interpret = jax.jit(functools.partial(write_pages, backend="interpret"))
_write_reference = jax.jit(write_pages_reference)


@functools.cache
def _mla_write(interleave):
  """``write_mla_pages`` on "interpret", eps 1e-6, jitted."""
  return jax.jit(functools.partial(write_mla_pages, eps=1e-6, interleave=interleave,
                                   backend="interpret"))


@functools.cache
def _mla_reference(interleave):
  """``write_pages_reference`` of ``mla_entries_reference``'s entries (eps 1e-6), jitted."""
  def ref(kv, norm, cos, sin, pages, scales, page, slot):
    entries = mla_entries_reference(kv, norm, cos, sin, eps=1e-6, interleave=interleave)
    return write_pages_reference(entries, pages, scales, page, slot)
  return jax.jit(ref)


@functools.cache
def _empty_state(kv_dtype):
  """TINY_MLA's empty pool, 16 pages of 4 tokens, made in one jitted program."""
  return jax.jit(lambda: init_paged_state(
      TINY_MLA, KVCacheConfig(num_pages=16, page_size=4, dtype=kv_dtype)))()


@functools.cache
def _state_write(backend, projection=None):
  """``state.write(1, new, positions, meta, backend=backend)`` jitted; with ``projection``
  = (eps, interleave), ``new`` is an ``MlaProjection``'s (kv, norm_scale, cos, sin)."""
  def write(state, new, positions, meta):
    if projection is not None:
      new = MlaProjection(*new, *projection)
    return state.write(1, new, positions, meta, backend=backend)
  return jax.jit(write)


def _meta():
  """Three requests' block tables (4 tokens a page), lengths and positions [3, 1]; the
  third row is padding past its request's length: not written."""
  tables = np.asarray([[3, 7, -1, -1], [1, -1, -1, -1], [9, 2, 4, -1]], np.int32)
  lengths = np.asarray([6, 2, 9], np.int32)
  positions = np.asarray([[5], [1], [11]], np.int32)
  tables, lengths, tags, positions = jax.device_put(
      (tables, lengths, np.zeros_like(tables), positions))
  return BatchMeta(block_tables=tables, lengths=lengths, expected_tags=tags,
                   page_size=4), positions


class PageWriteTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("fp8_kimi", dict(widths=(512, 64))),
      ("fp8_small", dict(widths=(128, 32))),
      ("fp8_f32_entries", dict(entry=jnp.float32)),
      ("one_row", dict(rows=1, dropped=())),
      ("three_arrays", dict(widths=(64, 16, 8))))
  def test_interpret_stores_the_reference_bytes(self, kw):
    entries, pages, scales, page, slot = _case(0, **kw)
    self.assertTrue(kernel_takes(entries, pages, scales))
    got = _write_interpret(entries, pages, scales, page, slot)
    _equal(self, got, _write_reference(entries, pages, scales, page, slot))

  def test_written_rows_hold_the_entries_and_nothing_else_changes(self):
    entries, pages, scales, page, slot = _case(1, widths=(512, 64), rows=16)
    new_pages, new_scales = _write_interpret(entries, pages, scales, page, slot)
    page_np, slot_np = np.asarray(page), np.asarray(slot)
    written = np.zeros(pages[0].shape[:2], bool)
    for r in range(len(page_np)):
      if 0 <= page_np[r] < pages[0].shape[0]:
        written[page_np[r], slot_np[r]] = True
    self.assertEqual(written.sum(), 16 - 2)  # row 3 past the pool, row 5 a negative page
    for e, old, new, old_s, new_s in zip(entries, pages, new_pages, scales, new_scales):
      e, old, new = _host(e), _host(old), _host(new)
      old_s, new_s = np.asarray(old_s), np.asarray(new_s)
      deq = new * new_s[..., None]
      for r in range(len(page_np)):
        if not 0 <= page_np[r] < old.shape[0]:
          continue
        want = e[r]
        got = deq[page_np[r], slot_np[r]]
        if not want.any():  # an all-zero row: zeros under scale 1
          np.testing.assert_array_equal(got, 0.0)
          self.assertEqual(float(new_s[page_np[r], slot_np[r]]), 1.0)
          continue
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        self.assertLessEqual(err, 5e-2)
        self.assertLessEqual(np.abs(new[page_np[r], slot_np[r]]).max(), 448.0)
      np.testing.assert_array_equal(new[~written], old[~written])
      np.testing.assert_array_equal(new_s[~written], old_s[~written])

  def test_shapes_the_kernel_does_not_take_run_the_reference(self):
    for kw in (dict(widths=(96, 32)),  # a width that is no power of two
               dict(pool=jnp.bfloat16, entry=jnp.float32), dict(pool=jnp.float32)):
      entries, pages, scales, page, slot = _case(2, **kw)
      self.assertFalse(kernel_takes(entries, pages, scales))
      fn = lambda *a: write_pages(*a, backend="interpret")  # noqa: E731
      self.assertNotIn("pallas_call", str(jax.make_jaxpr(fn)(entries, pages, scales, page,
                                                              slot)))
      _equal(self, _write_interpret(entries, pages, scales, page, slot),
             _write_reference(entries, pages, scales, page, slot))
    # Per-head pools (GQA: [N, P, KV, hd]) and mismatched scales are not the kernel's.
    entries, pages, scales, page, slot = _case(3)
    gqa = _remade(lambda x: x.reshape(x.shape[0], x.shape[1], 2, -1), pages)
    self.assertFalse(kernel_takes(_remade(lambda e: e.reshape(e.shape[0], 2, -1),
                                          list(entries)), gqa, scales))
    self.assertFalse(kernel_takes(entries, pages, scales[:1]))
    self.assertFalse(kernel_takes(entries, pages, _remade(lambda s: s.astype(jnp.bfloat16),
                                                          scales)))
    self.assertFalse(kernel_takes((), (), None))

  def test_bad_input(self):
    entries, pages, scales, page, slot = _case(4)
    with self.assertRaisesRegex(ValueError, "page must be int32"):
      write_pages(entries, pages, scales, _remade(lambda a: a.astype(np.float32), page), slot,
                  backend="interpret")
    with self.assertRaisesRegex(ValueError, "slot must be int32"):
      write_pages(entries, pages, scales, page, _remade(lambda a: a[:3], slot),
                  backend="interpret")
    with self.assertRaisesRegex(ValueError, "backend must be one of"):
      write_pages(entries, pages, scales, page, slot, backend="cuda")

  @parameterized.parameters("float8_e4m3fn", "bfloat16")
  def test_state_write_on_the_kernel_backend_equals_xla(self, kv_dtype):
    cfg = TINY_MLA
    state = _empty_state(kv_dtype)
    rng = np.random.default_rng(5)
    B, T = 3, 1
    new = jax.device_put(
        {"latent": rng.normal(size=(B, T, cfg.kv_lora_rank)).astype(jnp.bfloat16),
         "k_rope": rng.normal(size=(B, T, cfg.qk_rope_head_dim)).astype(jnp.bfloat16)})
    meta, positions = _meta()
    want = _state_write("xla")(state, new, positions, meta)
    got = _state_write("interpret")(state, new, positions, meta)
    _equal(self, got.layers, want.layers)
    self.assertFalse(all(np.array_equal(_host(a), _host(b))
                         for a, b in zip(jax.tree.leaves(got.layers[1]),
                                         jax.tree.leaves(state.layers[1]))))


def _mla_case(seed, *, n=12, p=8, c=128, r=32, rows=10, pool=F8, kv_dtype=jnp.bfloat16):
  """Random pools, a projection kv [rows, c + r] over several magnitudes (one row all
  zeros), norm weight, rope tables, and (page, slot) targets as ``_case``'s."""
  rng = np.random.default_rng(seed)
  (_, _), pages, scales, page, slot = _case(seed, n=n, p=p, widths=(c, r), rows=rows,
                                            pool=pool, dropped=(3,) if rows > 3 else ())
  kv = rng.normal(size=(rows, c + r)) * rng.choice([1e-3, 1.0, 300.0], (rows, 1))
  kv[min(1, rows - 1)] = 0.0
  kv = kv.astype(np.float32).astype(kv_dtype)
  norm = rng.uniform(0.5, 1.5, c).astype(np.float32).astype(kv_dtype)
  angles = rng.uniform(-20, 20, (rows, r // 2))
  cos, sin = (f(angles).astype(np.float32) for f in (np.cos, np.sin))
  kv, norm, cos, sin = jax.device_put((kv, norm, cos, sin))
  return kv, norm, cos, sin, pages, scales, page, slot


class MlaPageWriteTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("fp8_kimi", dict(c=512, r=64), True),
      ("fp8_small_half_split", dict(), False),
      ("fp8_f32_kv", dict(kv_dtype=jnp.float32), True),
      ("bf16_pool", dict(pool=jnp.bfloat16), True),
      ("f32_pool_half_split", dict(pool=jnp.float32, kv_dtype=jnp.float32), False),
      ("one_row", dict(rows=1), True))
  def test_interpret_stores_the_reference_bytes(self, kw, interleave):
    args = _mla_case(0, **kw)  # kv, norm, cos, sin, pages, scales, page, slot
    self.assertTrue(mla_kernel_takes(args[0], args[1], args[4], args[5]))
    _equal(self, _mla_write(interleave)(*args), _mla_reference(interleave)(*args))

  @parameterized.parameters(True, False)
  def test_reference_entries_are_the_models_ops(self, interleave):
    # MlaProjection.entries is what mla_project stores; the model's rms_norm and
    # apply_rope are what the rest of the model uses: the same bits. Each side in a
    # program of its own.
    kv, norm, cos, sin, *_ = _mla_case(1, c=512, r=64)
    latent, k_rope = jax.jit(lambda *a: mla_entries_reference(
        *a, eps=1e-6, interleave=interleave))(kv, norm, cos, sin)
    _equal(self, (latent, k_rope), jax.jit(lambda kv, norm, cos, sin: (
        rms_norm(kv[:, :512], norm, 1e-6),
        rope.apply_rope(kv[:, 512:], cos, sin, interleave=interleave)))(kv, norm, cos, sin))

  @parameterized.parameters(True, False)
  def test_stored_rows_hold_the_normed_and_rotated_projection(self, interleave):
    kv, norm, cos, sin, pages, scales, page, slot = _mla_case(2, c=512, r=64, rows=16)
    new_pages, new_scales = _mla_write(interleave)(kv, norm, cos, sin, pages, scales, page,
                                                   slot)
    # The entries in float64, from the bf16 projection.
    x = np.asarray(_host(kv), np.float64)
    lat = x[:, :512]
    lat = lat / np.sqrt((lat ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(
        _host(norm), np.float64)
    k = x[:, 512:]
    c64, s64 = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    if interleave:
      x1, x2 = k[:, 0::2], k[:, 1::2]
      k_rope = np.stack([x1 * c64 - x2 * s64, x1 * s64 + x2 * c64], -1).reshape(k.shape)
    else:
      x1, x2 = k[:, :32], k[:, 32:]
      k_rope = np.concatenate([x1 * c64 - x2 * s64, x1 * s64 + x2 * c64], -1)
    page_np, slot_np = np.asarray(page), np.asarray(slot)
    written = np.zeros(pages[0].shape[:2], bool)
    for want_all, old, new, old_s, new_s in zip((lat, k_rope), pages, new_pages, scales,
                                                new_scales):
      old, new = _host(old), _host(new)
      old_s, new_s = np.asarray(old_s), np.asarray(new_s)
      deq = new * new_s[..., None]
      for i in range(len(page_np)):
        if not 0 <= page_np[i] < old.shape[0]:
          continue
        written[page_np[i], slot_np[i]] = True
        want, got = want_all[i], deq[page_np[i], slot_np[i]]
        if not want.any():  # the all-zero row: zeros under scale 1
          np.testing.assert_array_equal(got, 0.0)
          continue
        self.assertLessEqual(np.linalg.norm(got - want) / np.linalg.norm(want), 5e-2)
      np.testing.assert_array_equal(new[~written], old[~written])
      np.testing.assert_array_equal(new_s[~written], old_s[~written])
    self.assertEqual(written.sum(), 16 - 2)  # row 3 past the pool, row 5 a negative page

  def test_shapes_the_kernel_does_not_take_run_the_reference(self):
    for kw in (dict(c=96), dict(r=24)):  # widths that are no powers of two
      kv, norm, cos, sin, pages, scales, page, slot = _mla_case(3, **kw)
      self.assertFalse(mla_kernel_takes(kv, norm, pages, scales))
      fn = lambda *a: write_mla_pages(*a, eps=1e-6, interleave=True,  # noqa: E731
                                      backend="interpret")
      args = (kv, norm, cos, sin, pages, scales, page, slot)
      self.assertNotIn("pallas_call", str(jax.make_jaxpr(fn)(*args)))
      _equal(self, _mla_write(True)(*args), _mla_reference(True)(*args))
    kv, norm, cos, sin, pages, scales, page, slot = _mla_case(3)
    self.assertFalse(mla_kernel_takes(kv, norm, pages, None))  # fp8 pools without scales
    self.assertFalse(mla_kernel_takes(kv, norm, pages[:1], scales))
    self.assertFalse(mla_kernel_takes(
        kv, norm, (pages[0], _remade(lambda x: x.astype(jnp.bfloat16), pages[1])), scales))

  def test_bad_input(self):
    kv, norm, cos, sin, pages, scales, page, slot = _mla_case(4)
    args = dict(eps=1e-6, interleave=True, backend="interpret")
    with self.assertRaisesRegex(ValueError, "kv must be"):
      write_mla_pages(_remade(lambda a: a[:, :100], kv), norm, cos, sin, pages, scales, page,
                      slot, **args)
    with self.assertRaisesRegex(ValueError, "rope width 31 is odd"):
      write_mla_pages(_remade(lambda a: a[:, :-1], kv), norm, cos, sin, pages, scales, page,
                      slot, **args)
    with self.assertRaisesRegex(ValueError, "cos must be"):
      write_mla_pages(kv, norm, _remade(lambda a: a[:, :4], cos), sin, pages, scales, page,
                      slot, **args)
    with self.assertRaisesRegex(ValueError, "page must be int32"):
      write_mla_pages(kv, norm, cos, sin, pages, scales, _remade(lambda a: a[:2], page), slot,
                      **args)
    with self.assertRaisesRegex(ValueError, "backend must be one of"):
      write_mla_pages(kv, norm, cos, sin, pages, scales, page, slot, eps=1e-6,
                      interleave=True, backend="cuda")

  @parameterized.parameters("float8_e4m3fn", "bfloat16")
  def test_state_write_of_a_projection_equals_its_entries(self, kv_dtype):
    cfg = TINY_MLA
    state = _empty_state(kv_dtype)
    rng = np.random.default_rng(6)
    B, T, c, r = 3, 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    angles = rng.uniform(-5, 5, (B, T, r // 2))
    kv, norm_scale, cos, sin = jax.device_put((
        rng.normal(size=(B, T, c + r)).astype(jnp.bfloat16),
        rng.uniform(0.5, 1.5, c).astype(jnp.bfloat16),
        np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)))
    proj = MlaProjection(kv=kv, norm_scale=norm_scale, cos=cos, sin=sin,
                         eps=cfg.latent_eps, interleave=cfg.rope_interleave)
    meta, positions = _meta()  # the third row: padding
    arrays, static = (proj.kv, proj.norm_scale, proj.cos, proj.sin), (proj.eps,
                                                                      proj.interleave)
    entries = jax.jit(lambda *a: MlaProjection(*a, *static).entries())(*arrays)
    want = _state_write("xla")(state, entries, positions, meta)
    for backend in ("xla", "interpret"):
      _equal(self, _state_write(backend, static)(state, arrays, positions, meta).layers,
             want.layers)
    # A projection that does not fit the pool, or a pool that is not MLA's.
    bad = MlaProjection(kv=_remade(lambda a: a[..., :-2], proj.kv), norm_scale=proj.norm_scale,
                        cos=proj.cos, sin=proj.sin, eps=proj.eps, interleave=True)
    with self.assertRaisesRegex(ValueError, "does not match"):
      state.write(1, bad, positions, meta)
    bad = MlaProjection(kv=proj.kv, norm_scale=proj.norm_scale,
                        cos=_remade(lambda a: a[..., :2], proj.cos), sin=proj.sin, eps=proj.eps,
                        interleave=True)
    with self.assertRaisesRegex(ValueError, "cos has shape"):
      state.write(1, bad, positions, meta)


class PageWriteH200Test(h200_compile_cases.H200CompilerTest):

  def test_one_launch_without_spills(self):
    from pallas_kernels.h200 import compile as hc
    # Kimi K2.6's decode step on one H200: 64 rows, a 16,384-page fp8 pool of 64 tokens,
    # latent 512 and rope 64; the pool donated, so it is written in place (no copy).
    n, p, rows, widths = 16384, 64, 64, (512, 64)

    def fn(entries, pages, scales, page, slot):
      return write_pages(entries, pages, scales, page, slot, backend="pallas")
    self.assert_one_launch_without_spills(
        jax.jit(fn, donate_argnums=(1, 2)),
        tuple(hc.spec((rows, d), jnp.bfloat16) for d in widths),
        tuple(hc.spec((n, p, d), F8) for d in widths),
        tuple(hc.spec((n, p), jnp.float32) for _ in widths),
        hc.spec((rows,), jnp.int32), hc.spec((rows,), jnp.int32), kernel="page_write")

  def test_state_write_has_no_scatter(self):
    from pallas_kernels.h200 import compile as hc
    # A layer's write to an fp8 pool on the "pallas" backend, as a decode step runs it: the
    # kernel and the slot arithmetic, none of XLA's scatters (docs/step_time.md counts
    # what this saves per layer).
    cfg = TINY_MLA
    state = jax.eval_shape(lambda: init_paged_state(
        cfg, KVCacheConfig(num_pages=256, page_size=64, dtype="float8_e4m3fn")))
    B = 64

    def fn(state, latent, k_rope, tables, lengths, positions):
      meta = BatchMeta(block_tables=tables, lengths=lengths,
                       expected_tags=jnp.zeros_like(tables), page_size=64)
      return state.write(0, {"latent": latent, "k_rope": k_rope}, positions, meta,
                         backend="pallas")
    rep = hc.compile_for_h200(
        jax.jit(fn, donate_argnums=0), state, hc.spec((B, 1, cfg.kv_lora_rank), jnp.bfloat16),
        hc.spec((B, 1, cfg.qk_rope_head_dim), jnp.bfloat16), hc.spec((B, 8), jnp.int32),
        hc.spec((B,), jnp.int32), hc.spec((B, 1), jnp.int32))
    self.assertIn("page_write", rep.launches)
    self.assertEqual([n for n in rep.launches if "scatter" in n], [], rep.launches)
    self.assertEqual(rep.kernels["page_write"].spills, 0)

  @parameterized.parameters(F8, jnp.bfloat16)
  def test_mla_write_is_one_launch_without_spills(self, pool):
    from pallas_kernels.h200 import compile as hc
    # Kimi K2.6's decode step on one H200, as above, from the wkv_a projection: the norm,
    # the interleaved rope and the write in one launch, for fp8 and float pools.
    n, p, rows, c, r = 16384, 64, 64, 512, 64
    fp8 = pool == F8

    def fn(kv, norm, cos, sin, pages, scales, page, slot):
      return write_mla_pages(kv, norm, cos, sin, pages, scales if fp8 else None, page, slot,
                             eps=1e-6, interleave=True, backend="pallas")
    self.assert_one_launch_without_spills(
        jax.jit(fn, donate_argnums=(4, 5)), hc.spec((rows, c + r), jnp.bfloat16),
        hc.spec((c,), jnp.bfloat16), hc.spec((rows, r // 2), jnp.float32),
        hc.spec((rows, r // 2), jnp.float32), (hc.spec((n, p, c), pool), hc.spec((n, p, r), pool)),
        tuple(hc.spec((n, p), jnp.float32) for _ in range(2)),
        hc.spec((rows,), jnp.int32), hc.spec((rows,), jnp.int32), kernel="page_write_mla")


if __name__ == "__main__":
  absltest.main()
