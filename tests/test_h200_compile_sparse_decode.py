"""Sparse paged MLA decode (ops.paged_mla_sparse_decode, the Triton-backend kernel)
compiled for an H200 at GLM 5's decode shape: it compiles, spills no registers and
fits the shared memory of a block (docs/sparse_attention.md, docs/h200_compile.md).

GLM 5 with data-parallel attention on one H200: 64 heads, latent 512, rope 64,
index_topk 2048 selected positions, 64-token pages, 32K context (512 table
entries), batch 1 and 8, bf16 and fp8 pages, default block sizes. Each case is
its own compile (about a second on a CPU): the split count, and with it the
unrolled trip count, differs between the batches.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp

from pallas_kernels.h200 import compile as h200
from pallas_kernels.h200 import env as h200_env
from pallas_kernels.paged_attention import paged_mla_sparse_decode

HEADS, C, R, PAGE, TOPK, CONTEXT = 64, 512, 64, 64, 2048, 32768


def _args(batch, kv):
  m = CONTEXT // PAGE
  n = batch * m + 1
  dt = jnp.bfloat16 if kv == "bf16" else jnp.float8_e4m3fn
  sc = h200.spec((n, PAGE), jnp.float32) if kv == "fp8" else None
  return [h200.spec((batch, HEADS, C), jnp.bfloat16),
          h200.spec((batch, HEADS, R), jnp.bfloat16),
          h200.spec((n, PAGE, C), dt), h200.spec((n, PAGE, R), dt), sc, sc,
          h200.spec((batch, m), jnp.int32), h200.spec((batch,), jnp.int32),
          h200.spec((batch, TOPK), jnp.int32)]


class H200CompileSparseDecodeTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    problems = h200_env.check()
    if problems:  # never skip: `make test` installs the compiler packages
      raise RuntimeError("the H200 compile tests cannot run: " + "; ".join(problems))

  @parameterized.product(batch=(1, 8), kv=("bf16", "fp8"))
  def test_compiles_without_spills(self, batch, kv):
    report = h200.compile_for_h200(paged_mla_sparse_decode, *_args(batch, kv),
                                   scale=0.1, backend="pallas")
    # An empty report (e.g. a compilation-cache hit that skipped ptxas) fails.
    self.assertIn("paged_mla_sparse_decode", report.kernels, report.kernels)
    stats = report.kernels["paged_mla_sparse_decode"]
    print(f"sparse MLA decode b{batch} {kv}: {stats} ({report.seconds:.1f} s)")
    self.assertEqual(stats.spills, 0, stats)
    self.assertLessEqual(stats.registers, h200.MAX_REGISTERS)
    self.assertIsNotNone(stats.smem)
    self.assertLessEqual(stats.smem, h200.SMEM_LIMIT_BYTES)


if __name__ == "__main__":
  absltest.main()
