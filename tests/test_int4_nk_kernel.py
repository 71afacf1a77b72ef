"""The [N, K] int4 kernels (pallas_kernels.int4_matmul.nk) against the references.

Interpret-mode tests run the Mosaic GPU kernels in the GPU interpreter on CPU with
race detection and NaN-filled fresh buffers, so an output element never written
fails the comparison (test_int4_matmul_kernel's base class); the compiled tests
need a GPU. The random scales vary by group and column, so a scale applied to the
wrong columns fails, and K spans several steps and groups, so a misplaced group or
step fails too.
"""

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.h200 import compile as hc
from pallas_kernels.int4_matmul import BlockSizes
from pallas_kernels.int4_matmul import int4_grouped_matmul_reference
from pallas_kernels.int4_matmul import int4_matmul_reference
from pallas_kernels.int4_matmul import nk
from pallas_kernels.int4_matmul import reference
import int4_test_data
from host_data import put
from test_int4_matmul_kernel import _KernelTestBase
from test_int4_matmul_kernel import SCALE_DTYPES


def _make(seed, m, k, n, group_size, *, experts=None, scale_dtype="bf16", x_dtype=jnp.bfloat16):
  """Fresh random (x [M, K], packed [(E,) K//2, N], w_nk [(E,) N, K] int4, scales
  [(E,) K//g, N]) on the device, laid out in numpy (no XLA program), and the int4
  codes q [(E,) K, N] as numpy."""
  x, q, s = int4_test_data.draw(seed, m, k, n, group_size, experts=experts,
                                scale_dtype=SCALE_DTYPES[scale_dtype], x_dtype=x_dtype)
  return (*put(x, int4_test_data.pack(q), int4_test_data.to_nk(q), s), q)


@jax.jit
def _layouts(p, s):
  """to_nk, its round trip and both dequantisations (group 32), in one program."""
  w_nk = nk.to_nk(p)
  return (w_nk, nk.from_nk(w_nk), reference.dequantize_int4_nk(w_nk, s, 32),
          reference.dequantize_int4(p, s, 32))


class LayoutTest(parameterized.TestCase):

  def test_to_nk_is_the_transpose_and_round_trips(self):
    _, p, _, s, q = _make(0, 1, 256, 64, 32, experts=3)
    w_nk, packed, deq_nk, deq = _layouts(p, s)
    self.assertEqual((w_nk.shape, w_nk.dtype), ((3, 64, 256), jnp.int4))
    np.testing.assert_array_equal(np.asarray(w_nk, np.int8), np.swapaxes(q, 1, 2))
    np.testing.assert_array_equal(packed, p)
    np.testing.assert_array_equal(deq_nk, deq)

  def test_references_match_the_packed_layout(self):
    x, p, w_nk, s, q = _make(1, 5, 256, 64, 64, experts=4)
    gs = put(np.array([2, 0, 2, 1], np.int32))
    np.testing.assert_array_equal(
        reference.int4_grouped_matmul_nk_reference(x, w_nk, s, gs, group_size=64),
        int4_grouped_matmul_reference(x, p, s, gs, group_size=64))
    p0, w_nk0, s0 = put(int4_test_data.pack(q[0]), int4_test_data.to_nk(q[0]),
                        np.asarray(s)[0])
    np.testing.assert_array_equal(
        nk.int4_matmul_nk(x, w_nk0, s0, group_size=64, backend="xla"),
        int4_matmul_reference(x, p0, s0, group_size=64))

  def test_bad_inputs_raise(self):
    x, p, w_nk, s, q = _make(2, 4, 128, 64, 32)
    xn, sn = np.asarray(x), np.asarray(s)
    with self.assertRaisesRegex(ValueError, "int4"):
      nk.int4_matmul_nk(x, p, s, group_size=32)  # the packed uint8 layout
    with self.assertRaisesRegex(ValueError, "2-D"):
      nk.int4_matmul_nk(x, put(int4_test_data.to_nk(q[None])), s, group_size=32)
    with self.assertRaisesRegex(ValueError, "x has K=64 but w_nk has K=128"):
      nk.int4_matmul_nk(put(xn[:, :64]), w_nk, s, group_size=32)
    with self.assertRaisesRegex(ValueError, "group_size"):
      nk.int4_matmul_nk(x, w_nk, s, group_size=16)
    with self.assertRaisesRegex(ValueError, "scales"):
      nk.int4_matmul_nk(x, w_nk, put(sn[:, :32]), group_size=32)
    with self.assertRaisesRegex(ValueError, "backend"):
      nk.int4_matmul_nk(x, w_nk, s, group_size=32, backend="triton")
    with self.assertRaisesRegex(ValueError, "group_sizes"):
      nk.int4_grouped_matmul_nk(x, *put(int4_test_data.to_nk(q[None]), sn[None],
                                        np.array([1, 2], np.int32)),
                                group_size=32, backend="xla")


# Dense (M, K, N, group, scale dtype, x dtype, block sizes): several K steps and
# splits; f32 scales (the f32 multiply); unaligned tiny-model shapes (K and N
# padded, M not a multiple of tile_m, f32 activations).
DENSE_CASES = [
    (12, 512, 192, 32, "bf16", jnp.bfloat16, (64, 8, 128, 2, 2)),
    (5, 384, 128, 128, "f32", jnp.bfloat16, (128, 8, 128, 1, 3)),
    (3, 64, 32, 32, "bf16", jnp.float32, None),
]
# Grouped (M, K, N, group sizes, group, block sizes): empty experts, an expert over
# three tiles (19 rows at tile_m 8), rows past sum(group_sizes) (zeros), several
# persistent CTAs each walking several items, unaligned tiny-model shapes.
GROUPED_CASES = [
    (19, 256, 64, (0, 19, 0, 0, 0), 128, (64, 8, 128)),
    (21, 384, 128, (3, 0, 9, 5, 2, 0), 64, (64, 8, 128, 1, 2, 3)),
    (10, 32, 64, (2, 0, 3, 1, 0, 2, 1, 1), 32, None),
]


class NkKernelTest(_KernelTestBase):
  """Compiled (GPU only; the marks sit on the methods so the interpret subclass,
  which re-declares them, is not skipped)."""
  INTERPRET = False

  @pytest.mark.gpu
  def test_dense(self):
    self._dense()

  @pytest.mark.gpu
  def test_grouped(self):
    self._grouped()

  def _dense(self):
    for m, k, n, g, sdt, xdt, bs in DENSE_CASES:
      with self.subTest(m=m, k=k, n=n, g=g):
        x, p, w_nk, s, _ = _make(10 + m, m, k, n, g, scale_dtype=sdt, x_dtype=xdt)
        out = nk.int4_matmul_nk(x, w_nk, s, group_size=g, backend=self.backend,
                                block_sizes=None if bs is None else BlockSizes(*bs))
        self.assert_close(out, int4_matmul_reference(x, p, s, group_size=g))

  def _grouped(self):
    for m, k, n, gs, g, bs in GROUPED_CASES:
      with self.subTest(m=m, k=k, n=n, gs=gs):
        x, p, w_nk, s, _ = _make(20 + m, m, k, n, g, experts=len(gs))
        gs = put(np.asarray(gs, np.int32))
        out = nk.int4_grouped_matmul_nk(x, w_nk, s, gs, group_size=g,
                                        backend=self.backend,
                                        block_sizes=None if bs is None else BlockSizes(*bs))
        self.assert_close(out, int4_grouped_matmul_reference(x, p, s, gs, group_size=g))
        np.testing.assert_array_equal(np.asarray(out, np.float32)[int(np.asarray(gs).sum()):], 0)


class NkKernelInterpretTest(NkKernelTest):
  INTERPRET = True

  def test_dense(self):
    self._dense()

  def test_grouped(self):
    self._grouped()


class NkRegisterOperandTest(parameterized.TestCase):
  """The hazard the interpreter cannot show (docs/int4_matmul.md, "On hardware"): a
  wgmma reads its register A operand while it runs, and the next pipeline step
  converts into the same registers, so each register-operand wgmma must be retired
  (wait_group 0) first. Checked in the PTX of deviceless sm_90a compiles: a dense
  loop of 4 steps per K split, as many as the pipeline has slots, so no refill code
  sits between the steps (the shape of the dense case that returned NaN on an H200
  with wait_group 1), and a grouped one."""

  def _waits(self, fn, *args):
    report = hc.compile_for_h200(fn, *args, mosaic_ptx=True)
    self.assertTrue(report.register_wgmma_waits, "no Mosaic GPU PTX was dumped")
    return [w for ws in report.register_wgmma_waits.values() for w in ws]

  def test_dense_and_grouped_retire_each_register_operand_wgmma(self):
    k, n, g = 2048, 128, 32
    dense = self._waits(
        lambda x, w, sc: nk.int4_matmul_nk(x, w, sc, group_size=g, backend="pallas",
                                           block_sizes=BlockSizes(64, 8, 256, 2, 4)),
        hc.spec((8, k), jnp.bfloat16), hc.spec((n, k), jnp.int4),
        hc.spec((k // g, n), jnp.bfloat16))
    grouped = self._waits(
        lambda x, w, sc, gs: nk.int4_grouped_matmul_nk(
            x, w, sc, gs, group_size=g, backend="pallas",
            block_sizes=BlockSizes(128, 16, 128, 1, 4)),
        hc.spec((64, k), jnp.bfloat16), hc.spec((4, n, k), jnp.int4),
        hc.spec((4, k // g, n), jnp.bfloat16), hc.spec((4,), jnp.int32))
    for waits in (dense, grouped):
      self.assertTrue(waits, "no register-operand wgmma in the PTX")
      self.assertEqual(set(waits), {0})

  def test_reading_the_waits(self):
    reg = "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%r1,%r2}, {%r3,%r4}, %rd1, p;"
    desc = "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%r1,%r2}, %rd2, %rd1, p;"
    wait = "wgmma.wait_group.sync.aligned {};"
    ptx = "\n".join([desc, wait.format(1), reg, reg, wait.format(1), reg, wait.format(0), reg])
    self.assertEqual(hc.register_wgmma_waits(ptx), (1, 1, 0, -1))
    self.assertEqual(hc.register_wgmma_waits(desc + wait.format(1)), ())

  def test_splitting_the_ptx_of_several_kernels(self):
    head = "//\n// Generated by LLVM NVPTX Back-End\n//\n.version 8.8\n"
    module = lambda *names: head + "".join(
        f".visible .entry {n}_mosaic_gpu_kernel(\n  .param .u64 p\n)\n{{ ret; }}\n" for n in names)
    self.assertEqual([n for n, _ in hc.split_ptx_modules(module("a") + module("merge_b"))],
                     ["a", "merge_b"])
    self.assertEqual(hc.split_ptx_modules("no ptx here"), [])
    with self.assertRaisesRegex(ValueError, "entry points"):
      hc.split_ptx_modules(module())
    with self.assertRaisesRegex(ValueError, "entry points"):
      hc.split_ptx_modules(module("a", "b"))


if __name__ == "__main__":
  absltest.main()
