"""The sparse-attention decode kernels compiled for an H200 at GLM 5's decode shape: each
compiles, spills no registers and fits a block's shared memory (docs/sparse_attention.md,
docs/h200_compile.md).

* Sparse paged MLA decode (pallas_kernels.paged_attention.paged_mla_sparse_decode):
  64 heads, latent 512, rope 64, index_topk 2048 selected positions.
* Paged indexer scoring (pallas_kernels.indexer.paged_index_scores): 32 heads of 128.

Both with data-parallel attention on one H200: 64-token pages, a 32K context (512
table entries), batch 1 and 8, bf16 and fp8 pages, default block sizes. Each case is
its own compile (about a second on a CPU): the split count, and with it the unrolled
trip count, differs between the batches.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp

from pallas_kernels.h200 import compile as h200
from pallas_kernels.h200 import env as h200_env
from pallas_kernels.indexer import paged_index_scores
from pallas_kernels.paged_attention import paged_mla_sparse_decode

HEADS, C, R, PAGE, TOPK, CONTEXT = 64, 512, 64, 64, 2048, 32768
INDEX_HEADS, INDEX_DIM = 32, 128


def _pages(batch, kv, width):
  """(pages [n, PAGE, width], scales [n, PAGE] or None, tables, lengths) specs."""
  m = CONTEXT // PAGE
  n = batch * m + 1
  dt = jnp.bfloat16 if kv == "bf16" else jnp.float8_e4m3fn
  sc = h200.spec((n, PAGE), jnp.float32) if kv == "fp8" else None
  return (h200.spec((n, PAGE, width), dt), sc, h200.spec((batch, m), jnp.int32),
          h200.spec((batch,), jnp.int32))


def _sparse_mla_args(batch, kv):
  lat, lat_s, tables, lengths = _pages(batch, kv, C)
  rope, rope_s, _, _ = _pages(batch, kv, R)
  return [h200.spec((batch, HEADS, C), jnp.bfloat16), h200.spec((batch, HEADS, R), jnp.bfloat16),
          lat, rope, lat_s, rope_s, tables, lengths, h200.spec((batch, TOPK), jnp.int32)]


def _indexer_args(batch, kv):
  keys, scales, tables, lengths = _pages(batch, kv, INDEX_DIM)
  return [h200.spec((batch, INDEX_HEADS, INDEX_DIM), jnp.bfloat16),
          h200.spec((batch, INDEX_HEADS), jnp.float32), keys, scales, tables, lengths]


KERNELS = {"paged_mla_sparse_decode": (paged_mla_sparse_decode, _sparse_mla_args,
                                       {"scale": 0.1}),
           "paged_index_scores": (paged_index_scores, _indexer_args, {})}


class H200CompileSparseTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    problems = h200_env.check()
    if problems:  # never skip: `make test` installs the compiler packages
      raise RuntimeError("the H200 compile tests cannot run: " + "; ".join(problems))

  @parameterized.product(kernel=tuple(KERNELS), batch=(1, 8), kv=("bf16", "fp8"))
  def test_compiles_without_spills(self, kernel, batch, kv):
    fn, make_args, kwargs = KERNELS[kernel]
    report = h200.compile_for_h200(fn, *make_args(batch, kv), backend="pallas", **kwargs)
    # An empty report (e.g. a compilation-cache hit that skipped ptxas) fails.
    self.assertIn(kernel, report.kernels, report.kernels)
    stats = report.kernels[kernel]
    print(f"{kernel} b{batch} {kv}: {stats} ({report.seconds:.1f} s)")
    self.assertEqual(stats.spills, 0, stats)
    self.assertLessEqual(stats.registers, h200.MAX_REGISTERS)
    self.assertIsNotNone(stats.smem)
    self.assertLessEqual(stats.smem, h200.SMEM_LIMIT_BYTES)


if __name__ == "__main__":
  absltest.main()
