"""The page write in one Pallas Triton launch (``pallas_kernels.page_write``).

Interpret mode stores the same bytes as the jnp reference (e4m3 quantisation per token,
one scatter per pool array) at MLA's shapes, with rows that are padding or past their
request (no write); the written rows dequantise to the entries within the fp8 bound and
no other row changes; float pools and shapes the kernel does not take run the reference;
bad input; ``PagedKVState.write`` on the kernel backends equals "xla"; and compiles for
an H200 at Kimi K2.6's decode shapes: one launch, no spills.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import h200_compile_cases
from configs import TINY_MLA
from mlkit.kvcache import BatchMeta, KVCacheConfig
from mlkit.kvcache.state import init_paged_state
from pallas_kernels.page_write import kernel_takes, write_pages, write_pages_reference

F8 = jnp.float8_e4m3fn


def _case(seed, *, n=12, p=8, widths=(128, 32), rows=10, pool=F8, entry=jnp.bfloat16,
          dropped=(3,)):
  """Random pools (not zeros), entries, and distinct (page, slot) targets; rows in
  ``dropped`` get page n (outside the pool: not written), and one a negative page."""
  rng = np.random.default_rng(seed)
  pages = tuple(jnp.asarray(rng.normal(size=(n, p, d)), jnp.float32).astype(pool)
                for d in widths)
  scales = (tuple(jnp.asarray(rng.uniform(0.5, 2, (n, p)), jnp.float32) for _ in widths)
            if pool == F8 else None)
  # Entries over several magnitudes, one row all zeros (scale 1).
  entries = [rng.normal(size=(rows, d)) * rng.choice([1e-3, 1.0, 300.0], (rows, 1))
             for d in widths]
  for e in entries:
    e[min(1, rows - 1)] = 0.0
  entries = tuple(jnp.asarray(e, jnp.float32).astype(entry) for e in entries)
  flat = rng.permutation(n * p)[:rows]
  page, slot = (flat // p).astype(np.int32), (flat % p).astype(np.int32)
  for r in dropped:
    page[r] = n
  if rows > 5:
    page[5] = -1
  return entries, pages, scales, jnp.asarray(page), jnp.asarray(slot)


def _equal(test, got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    test.assertEqual(g.dtype, w.dtype)
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)),
                                  np.asarray(w.astype(jnp.float32)))


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
    run = jax.jit(lambda *a: write_pages(*a, backend="interpret"))
    got = run(entries, pages, scales, page, slot)
    _equal(self, got, write_pages_reference(entries, pages, scales, page, slot))

  def test_written_rows_hold_the_entries_and_nothing_else_changes(self):
    entries, pages, scales, page, slot = _case(1, widths=(512, 64), rows=16)
    new_pages, new_scales = write_pages(entries, pages, scales, page, slot,
                                        backend="interpret")
    page_np, slot_np = np.asarray(page), np.asarray(slot)
    written = np.zeros(pages[0].shape[:2], bool)
    for r in range(len(page_np)):
      if 0 <= page_np[r] < pages[0].shape[0]:
        written[page_np[r], slot_np[r]] = True
    self.assertEqual(written.sum(), 16 - 2)  # row 3 past the pool, row 5 a negative page
    for e, old, new, old_s, new_s in zip(entries, pages, new_pages, scales, new_scales):
      deq = np.asarray(new.astype(jnp.float32)) * np.asarray(new_s)[..., None]
      for r in range(len(page_np)):
        if not 0 <= page_np[r] < old.shape[0]:
          continue
        want = np.asarray(e[r].astype(jnp.float32))
        got = deq[page_np[r], slot_np[r]]
        if not want.any():  # an all-zero row: zeros under scale 1
          np.testing.assert_array_equal(got, 0.0)
          self.assertEqual(float(new_s[page_np[r], slot_np[r]]), 1.0)
          continue
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        self.assertLessEqual(err, 5e-2)
        self.assertLessEqual(np.abs(np.asarray(new[page_np[r], slot_np[r]].astype(
            jnp.float32))).max(), 448.0)
      np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32))[~written],
                                    np.asarray(old.astype(jnp.float32))[~written])
      np.testing.assert_array_equal(np.asarray(new_s)[~written], np.asarray(old_s)[~written])

  def test_shapes_the_kernel_does_not_take_run_the_reference(self):
    for kw in (dict(widths=(96, 32)),  # a width that is no power of two
               dict(pool=jnp.bfloat16, entry=jnp.float32), dict(pool=jnp.float32)):
      entries, pages, scales, page, slot = _case(2, **kw)
      self.assertFalse(kernel_takes(entries, pages, scales))
      fn = lambda *a: write_pages(*a, backend="interpret")  # noqa: E731
      self.assertNotIn("pallas_call", str(jax.make_jaxpr(fn)(entries, pages, scales, page,
                                                              slot)))
      _equal(self, fn(entries, pages, scales, page, slot),
             write_pages_reference(entries, pages, scales, page, slot))
    # Per-head pools (GQA: [N, P, KV, hd]) and mismatched scales are not the kernel's.
    entries, pages, scales, page, slot = _case(3)
    gqa = tuple(x.reshape(x.shape[0], x.shape[1], 2, -1) for x in pages)
    self.assertFalse(kernel_takes([e.reshape(e.shape[0], 2, -1) for e in entries], gqa,
                                  scales))
    self.assertFalse(kernel_takes(entries, pages, scales[:1]))
    self.assertFalse(kernel_takes(entries, pages, tuple(s.astype(jnp.bfloat16)
                                                        for s in scales)))
    self.assertFalse(kernel_takes((), (), None))

  def test_bad_input(self):
    entries, pages, scales, page, slot = _case(4)
    with self.assertRaisesRegex(ValueError, "page must be int32"):
      write_pages(entries, pages, scales, page.astype(jnp.float32), slot, backend="interpret")
    with self.assertRaisesRegex(ValueError, "slot must be int32"):
      write_pages(entries, pages, scales, page, slot[:3], backend="interpret")
    with self.assertRaisesRegex(ValueError, "backend must be one of"):
      write_pages(entries, pages, scales, page, slot, backend="cuda")

  @parameterized.parameters("float8_e4m3fn", "bfloat16")
  def test_state_write_on_the_kernel_backend_equals_xla(self, kv_dtype):
    cfg = TINY_MLA
    state = init_paged_state(cfg, KVCacheConfig(num_pages=16, page_size=4, dtype=kv_dtype))
    rng = np.random.default_rng(5)
    B, T = 3, 1
    new = {"latent": jnp.asarray(rng.normal(size=(B, T, cfg.kv_lora_rank)), jnp.bfloat16),
           "k_rope": jnp.asarray(rng.normal(size=(B, T, cfg.qk_rope_head_dim)), jnp.bfloat16)}
    tables = jnp.asarray([[3, 7, -1, -1], [1, -1, -1, -1], [9, 2, 4, -1]], jnp.int32)
    lengths = jnp.asarray([6, 2, 9], jnp.int32)
    # The third row is padding past its request's length: not written.
    positions = jnp.asarray([[5], [1], [11]], jnp.int32)
    meta = BatchMeta(block_tables=tables, lengths=lengths,
                     expected_tags=jnp.zeros_like(tables), page_size=4)
    want = state.write(1, new, positions, meta, backend="xla")
    got = state.write(1, new, positions, meta, backend="interpret")
    _equal(self, got.layers, want.layers)
    self.assertFalse(all(np.array_equal(np.asarray(a.astype(jnp.float32)),
                                        np.asarray(b.astype(jnp.float32)))
                         for a, b in zip(jax.tree.leaves(got.layers[1]),
                                         jax.tree.leaves(state.layers[1]))))


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


if __name__ == "__main__":
  absltest.main()
