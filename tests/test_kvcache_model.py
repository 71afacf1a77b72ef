"""The paged state as the model's cache: prefill then decode match the contiguous path."""

import dataclasses
import functools

import jax
import numpy as np
from absl.testing import absltest, parameterized

from configs import TINY_GQA, TINY_MLA
from mlkit import kvcache as kvc
from mlkit import model
from numpy_params import init_params_np
from host_data import put

PAGE = 4  # small pages so the tiny sequences cross page boundaries
NUM_PAGES = 10
MAX_PAGES = 3
T = 5  # prefill chunk
PREFILL_LENGTHS = (5, 3, 4)  # ragged: request 1 pads positions 3-4; request 2 ends on a page boundary
MAX_LEN = 16
# TINY_MLA cut to one dense and one MoE layer: a second layer's cache and both FFN kinds,
# at two thirds of the compile time.
MLA = dataclasses.replace(TINY_MLA, n_layers=2)


def _bf16(cfg):
  return dataclasses.replace(cfg, dtype="bfloat16", param_dtype="bfloat16")


def _dense_only(cfg):
  # Top-k expert routing is discontinuous: a lossy cache can flip an expert choice and
  # move a logit by O(1), so the fp8 tolerance is checked on the attention path alone.
  # Dense FFNs also compile much faster; the cache path does not depend on the FFN, and
  # the full MoE configs are covered by the f32 exactness tests.
  return dataclasses.replace(cfg, n_layers=2, first_k_dense=2)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("paged",))
def _prefill_decode(params, tokens, positions, dec_tokens, dec_positions, contig, paged, meta1,
                    meta2, *, cfg):
  """Both caches through the same prefill chunk and one decode step."""
  lc1, contig = model.apply(params, tokens, positions, contig, cfg=cfg)
  lc2, contig = model.apply(params, dec_tokens, dec_positions, contig, cfg=cfg)
  lp1, paged = model.apply(params, tokens, positions, paged, cfg=cfg, batch_meta=meta1)
  lp2, paged = model.apply(params, dec_tokens, dec_positions, paged, cfg=cfg, batch_meta=meta2)
  return (lc1, lc2), (lp1, lp2), paged


# Jitted: one compile instead of one per op.
_tag_check = jax.jit(kvc.tag_check_reference, static_argnames="page_size")


def _valid_logits(l1, l2):
  """Logits of real tokens only: each request's prefill prefix plus its decode token."""
  # Sliced on the host: an eager slice of a jax array compiles a program per shape.
  l1, l2 = np.asarray(l1).astype(np.float32), np.asarray(l2).astype(np.float32)
  rows = [l1[b, :L] for b, L in enumerate(PREFILL_LENGTHS)]
  return np.concatenate(rows + [l2[:, 0]])


class PagedModelTest(parameterized.TestCase):

  def _run(self, cfg, kv_dtype):
    rng = np.random.default_rng(0)
    B = len(PREFILL_LENGTHS)
    params = init_params_np(cfg)
    # Cast in numpy and placed with device_put: jnp.asarray compiles a program per shape.
    tokens, positions, dec_tokens, dec_positions = put(
        rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
        np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
        rng.integers(0, cfg.vocab_size, (B, 1)).astype(np.int32),
        np.asarray(PREFILL_LENGTHS, np.int32)[:, None])

    alloc = kvc.PageAllocator(NUM_PAGES, PAGE)
    alloc.allocate(2)  # so requests do not start at page 0
    ids = ["a", "b", "c"]
    for rid, n in zip(ids, PREFILL_LENGTHS):
      self.assertIsNone(alloc.admit(rid, n))
    meta1 = alloc.batch_meta(ids, max_pages=MAX_PAGES)
    for rid, n in zip(ids, PREFILL_LENGTHS):
      self.assertIsNone(alloc.extend(rid, n + 1))  # request c needs a new page here
    meta2 = alloc.batch_meta(ids, max_pages=MAX_PAGES)
    kv_cfg = kvc.KVCacheConfig(num_pages=NUM_PAGES, page_size=PAGE, dtype=kv_dtype)
    paged = kvc.sync_tags(kvc.init_paged_state(cfg, kv_cfg), alloc.device_tags())
    kvc.validate_state(paged, kv_cfg, cfg)
    for meta, pos in ((meta1, positions), (meta2, dec_positions)):  # host-side, before the jit
      kvc.validate_batch(paged, meta, pos)
    contig = model.init_cache(cfg, B, MAX_LEN)
    old_leaf = paged.layers[0][paged.names[0]]
    (lc1, lc2), (lp1, lp2), paged = _prefill_decode(params, tokens, positions, dec_tokens,
                                                    dec_positions, contig, paged, meta1, meta2,
                                                    cfg=cfg)
    self.assertTrue(old_leaf.is_deleted())  # the paged state was donated
    ok = _tag_check(paged.page_tags, meta2.block_tables, meta2.expected_tags,
                                 meta2.lengths, page_size=PAGE)
    np.testing.assert_array_equal(np.asarray(ok), True)
    got, want = _valid_logits(lp1, lp2), _valid_logits(lc1, lc2)
    self.assertTrue(np.all(np.isfinite(got)))
    self.assertTrue(np.all(np.isfinite(want)))
    return got, want

  @parameterized.named_parameters(("mla", MLA), ("gqa", TINY_GQA))
  def test_f32_pages_match_contiguous(self, cfg):
    got, want = self._run(cfg, "float32")
    # Paged and contiguous attention sum in different orders: a long-reduction comparison by
    # relative norm (tolerance table), plus an elementwise bound a few f32 ulps of the logits wide.
    self.assertLessEqual(np.linalg.norm(got - want) / np.linalg.norm(want), 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  @parameterized.named_parameters(("mla", MLA), ("gqa", TINY_GQA))
  def test_bf16_pages_match_contiguous(self, cfg):
    got, want = self._run(_bf16(_dense_only(cfg)), "bfloat16")
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)

  @parameterized.named_parameters(("mla", MLA), ("gqa", TINY_GQA))
  def test_fp8_pages_within_tolerance_of_f32(self, cfg):
    got, want = self._run(_dense_only(cfg), "float8_e4m3fn")
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    self.assertLessEqual(err, 5e-2)
    self.assertGreater(err, 1e-4)  # the pages really are lossy fp8

  def test_eager_apply_rejects_bad_block_table(self):
    cfg = dataclasses.replace(TINY_GQA, n_layers=1)
    params = init_params_np(cfg)
    state = kvc.init_paged_state(cfg, kvc.KVCacheConfig(4, PAGE, "bfloat16"))
    block_tables, lengths, expected_tags, tokens, positions = put(
        np.asarray([[0, 9]], np.int32), np.asarray([6], np.int32), np.zeros((1, 2), np.int32),
        np.ones((1, 2), np.int32), np.asarray([[4, 5]], np.int32))
    meta = kvc.BatchMeta(block_tables=block_tables, lengths=lengths,
                         expected_tags=expected_tags, page_size=PAGE)
    with self.assertRaisesRegex(ValueError, r"entry \[0, 1\] = 9 points outside the pool of 4"):
      model.apply(params, tokens, positions, state, cfg=cfg, batch_meta=meta)
    with self.assertRaisesRegex(ValueError, "needs batch_meta=BatchMeta"):
      model.apply(params, tokens, positions, state, cfg=cfg)
    with self.assertRaisesRegex(ValueError, "batch metadata was built for 8"):
      model.apply(params, tokens, positions, state, cfg=cfg, batch_meta=meta.replace(page_size=8))


if __name__ == "__main__":
  absltest.main()
