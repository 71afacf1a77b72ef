"""Batched page-tag check kernel against its jnp reference."""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tag_check import BlockSizes
from pallas_kernels.tag_check import tag_check
from pallas_kernels.tag_check import tag_check_reference

ON_GPU = jax.default_backend() == "gpu"


def make_case(seed, *, batch, max_pages, num_pages, page_size):
  """Random tables with known corruption; returns args and the expected flags."""
  rng = np.random.default_rng(seed)
  tags = rng.integers(0, 2**31 - 1, num_pages, dtype=np.int32)
  bt = rng.integers(0, num_pages, (batch, max_pages), dtype=np.int32)
  # Lengths: 0, 1, exact page boundaries, full, ragged.
  full = max_pages * page_size
  lengths = np.array([[0, 1, page_size, full][b] if b < 4 else
                      rng.integers(1, full + 1) for b in range(batch)], np.int32)
  expected = tags[bt].copy()
  used = (lengths + page_size - 1) // page_size
  want = np.ones(batch, bool)
  for b in range(batch):
    action = rng.integers(0, 3)
    if action == 1 and used[b] > 0:
      # A stale tag on a used page (the page was reallocated): must fail.
      i = rng.integers(0, used[b])
      expected[b, i] ^= 1 << int(rng.integers(0, 31))
      want[b] = False
    elif action == 2 and used[b] < max_pages:
      # A mismatch past the used pages is ignored.
      expected[b, rng.integers(used[b], max_pages)] += 1
  # PAD_PAGE (-1) past the used pages is ignored; a used -1 fails.
  for b in range(batch):
    if used[b] < max_pages:
      bt[b, max_pages - 1] = -1
  if batch > 5 and used[5] > 0:
    bt[5, used[5] - 1] = -1
    want[5] = False
  # The last request's first page mismatches: checks the first page is read.
  if used[-1] > 0:
    expected[-1, 0] += 1
    want[-1] = False
  args = (jnp.asarray(tags), jnp.asarray(bt), jnp.asarray(expected),
          jnp.asarray(lengths))
  return args, want


class TagCheckTest(parameterized.TestCase):
  """Compiled kernel at realistic sizes (GPU only)."""

  INTERPRET = False
  SIZES = ((64, 2048, 100_000, 64), (256, 512, 100_000, 16))

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and not ON_GPU:
      self.skipTest("compiled Pallas kernels need a GPU")

  @property
  def backend(self):
    return "interpret" if self.INTERPRET else "pallas"

  @parameterized.parameters(0, 1)
  def test_matches_reference(self, which):
    batch, max_pages, num_pages, page_size = self.SIZES[which]
    args, want = make_case(which, batch=batch, max_pages=max_pages,
                           num_pages=num_pages, page_size=page_size)
    ref = tag_check_reference(*args, page_size=page_size)
    np.testing.assert_array_equal(np.asarray(ref), want)
    # A block size that does not divide the batch: padded rows are dropped.
    out = tag_check(*args, page_size=page_size, backend=self.backend,
                    block_sizes=BlockSizes(block_b=4))
    self.assertEqual(out.dtype, jnp.bool_)
    np.testing.assert_array_equal(np.asarray(out), want)
    out = tag_check(*args, page_size=page_size, backend=self.backend)
    np.testing.assert_array_equal(np.asarray(out), want)


class TagCheckInterpretTest(TagCheckTest):
  INTERPRET = True
  # (batch, max pages, physical pages, page size); 7 requests, 5 pages: no
  # power-of-two, so both paddings are exercised.
  SIZES = ((7, 5, 40, 4), (9, 8, 30, 2))


class TagCheckMiscTest(parameterized.TestCase):

  def test_shape_mismatch_raises(self):
    args, _ = make_case(3, batch=5, max_pages=3, num_pages=10, page_size=2)
    with self.assertRaisesRegex(ValueError, "shape"):
      tag_check(args[0], args[1], args[2][:, :2], args[3], page_size=2, backend="xla")


if __name__ == "__main__":
  absltest.main()
