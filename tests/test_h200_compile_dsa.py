"""GLM 5's DeepSeek Sparse Attention decode kernels compiled for an H200 at every target
shape: sparse paged MLA decode (TP-8 and data-parallel heads, K = index_topk selected
positions), the paged indexer's scoring (all 32 indexer heads) and the top-k selection
after it (k = index_topk), batch 1-64, 32K and 128K contexts, bf16 and fp8 pages. They compile, spill no registers and fit the shared
memory of a block (see h200_compile_cases and docs/h200_compile.md).

A module of its own (22 compiles of about a second each) rather than part of the
attention module (about 100 s): under `pytest -n 2 --dist loadfile` (one file a worker) one worker can take
it and then the INT4 module (about 80 s) while the other compiles attention.
"""

from absl.testing import absltest

import h200_compile_cases
from pallas_kernels.h200 import kernel_readings as kc

GROUPS = kc.target_groups(("paged_mla_sparse_decode", "paged_index_scores", "topk_positions"))

H200CompileDsaTest = h200_compile_cases.make_test_case(__file__, GROUPS)


class ShortSelectionTest(absltest.TestCase):
  """A selection of a few positions (a short table): the op pads each split to two
  32-row steps, because ptxas spilled the one-step kernel in bf16 (12 B at 32 heads)."""

  def test_few_indices_compile_without_spills(self):
    import jax.numpy as jnp
    from pallas_kernels.h200 import compile as h200
    from pallas_kernels.paged_attention import paged_mla_sparse_decode
    b, h, c, r, page, m = 8, 64, 512, 64, 64, 8
    n = b * m + 1
    args = [h200.spec((b, h, c), jnp.bfloat16), h200.spec((b, h, r), jnp.bfloat16),
            h200.spec((n, page, c), jnp.bfloat16), h200.spec((n, page, r), jnp.bfloat16),
            None, None, h200.spec((b, m), jnp.int32), h200.spec((b,), jnp.int32),
            h200.spec((b, 7), jnp.int32)]
    report = h200.compile_for_h200(paged_mla_sparse_decode, *args, scale=0.1, backend="pallas")
    stats = report.kernels["paged_mla_sparse_decode"]
    self.assertEqual(stats.spills, 0, stats)

if __name__ == "__main__":
  absltest.main()
