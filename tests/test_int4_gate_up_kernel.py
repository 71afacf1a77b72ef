"""The routed experts' gate and up projections in one grouped INT4 launch.

``int4_grouped_matmul`` / ``int4_grouped_matmul_nk`` given tuples of weights and
scales run every weight over the same rows in one Mosaic GPU launch, their columns
side by side (docs/int4_matmul.md, "Gate and up in one launch"). Interpreted, the
fused launch must equal separate launches bit for bit (the same tiles, K steps and
accumulation order), for both layouts, with empty experts and rows past
sum(group_sizes); ``mlkit.quant.grouped_matmuls`` runs it for int4 weights of one
kind on the kernel backends and falls back to one call per weight otherwise; the
MoE experts compute what they did with two launches; and the fused kernel compiles
for an H200 at Kimi K2.6's per-device decode shape as one launch without spills.
"""

import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

import h200_compile_cases
import int4_test_data
from host_data import put
from interpret_races import keep_race_records
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gpu_interpret
from mlkit.model import moe
from mlkit.quant import Int4Weight, grouped_matmul, grouped_matmuls, quantize_fp8, quantize_int4
from pallas_kernels.int4_matmul import BlockSizes
from pallas_kernels.int4_matmul import int4_grouped_matmul
from pallas_kernels.int4_matmul import int4_grouped_matmul_nk

OPS = {"kn": int4_grouped_matmul, "nk": int4_grouped_matmul_nk}
# layout: (M, K, N, E, group_size, scales dtype, block sizes). Three persistent CTAs walk
# several work items each (a weight's n tile each, over the row tiles). The "nk" case
# runs two K steps, and its N=32 is padded to 64 per weight, so the fused result drops
# each weight's padded columns.
CASES = {
    "kn": (19, 128, 64, 4, 32, jnp.bfloat16, BlockSizes(64, 8, 128, max_ctas=3)),
    "nk": (13, 256, 32, 4, 128, jnp.float32, BlockSizes(64, 8, 128, max_ctas=3)),
}
# Rows per expert, several per case (one compile each: group_sizes is an operand).
GROUP_SIZES = {
    "kn": ([5, 0, 7, 4],    # an empty expert, 3 rows past sum(group_sizes)
           [0, 19, 0, 0]),  # one expert takes every row
    "nk": ([0, 6, 0, 7],    # empty experts, rows ending on M
           [1, 2, 3, 0]),   # 7 rows past sum(group_sizes)
}


def _weights(seed, e, k, n, group_size, scale_dtype, layout):
  """A random [E, K, N] int4 weight in ``layout`` (numpy), its scales [E, K/g, N] and its
  float64 dequantised values [E, K, N]."""
  rng = np.random.default_rng(seed)
  q = rng.integers(-8, 8, (e, k, n)).astype(np.int8)
  s = np.asarray(rng.uniform(0.25, 2.0, (e, k // group_size, n)) / 16, scale_dtype)
  w = int4_test_data.to_nk(q) if layout == "nk" else int4_test_data.pack(q)
  return w, s, q * np.repeat(np.asarray(s, np.float64), group_size, axis=-2)


@functools.cache
def _case_np(layout):
  """``layout``'s case in numpy: (x [M, K] bf16, (gate, up) weights, (gate, up) scales,
  (gate, up) float64 dequantised weights)."""
  m, k, n, e, g, sdt, _ = CASES[layout]
  x = np.asarray(np.random.default_rng(0).standard_normal((m, k)), jnp.bfloat16)
  (wg, sg, dg), (wu, su, du) = (_weights(seed, e, k, n, g, sdt, layout) for seed in (1, 2))
  return x, (wg, wu), (sg, su), (dg, du)


@functools.cache
def _case(layout):
  """(x [M, K] bf16, (gate, up) weights, (gate, up) scales) of ``layout``'s case, on the
  device."""
  x, (wg, wu), (sg, su), _ = _case_np(layout)
  return put(x), put(wg, wu), put(sg, su)


def _run(layout, x, w, s, gs):
  *_, g, _, bs = CASES[layout]
  return OPS[layout](x, w, s, put(np.asarray(gs, np.int32)), group_size=g,
                     backend="interpret", block_sizes=bs)


def _f64_reference(x, dense, gs):
  """x @ dense per expert in float64 (dense [E, K, N]: the dequantised weight), the bf16
  x as the kernels read it."""
  xf = np.asarray(x, np.float64)
  out = np.zeros((x.shape[0], dense.shape[-1]))
  start = 0
  for e, rows in enumerate(gs):
    out[start:start + rows] = xf[start:start + rows] @ dense[e]
    start += rows
  return out


class FusedGateUpInterpretTest(parameterized.TestCase):
  """The fused launch against separate launches and a float64 product."""

  def setUp(self):
    super().setUp()
    gpu_interpret.reset_gpu_interpret_mode_state()
    self.races = keep_race_records(self)

  @parameterized.parameters("kn", "nk")
  def test_equals_separate_launches(self, layout):
    x, w, s = _case(layout)
    dense = _case_np(layout)[3]
    n = CASES[layout][2]
    for gs in GROUP_SIZES[layout]:
      with self.subTest(group_sizes=gs):
        fused = np.asarray(_run(layout, x, w, s, gs), np.float32)
        self.assertEqual(fused.shape, (x.shape[0], 2 * n))
        self.assertTrue(np.isfinite(fused).all(), "unwritten output")
        self.assertFalse(self.races.races_found())
        for i in range(2):
          alone = np.asarray(_run(layout, x, w[i], s[i], gs), np.float32)
          np.testing.assert_array_equal(fused[:, i * n:(i + 1) * n], alone)
          ref = _f64_reference(x, dense[i], gs)
          err = np.linalg.norm(fused[:, i * n:(i + 1) * n] - ref) / np.linalg.norm(ref)
          self.assertLessEqual(err, 1e-2)  # bf16 output
        np.testing.assert_array_equal(fused[sum(gs):], 0)

  @parameterized.parameters("kn", "nk")
  def test_bad_input(self, layout):
    x, (wg, wu), (sg, su) = _case(layout)
    _, (_, wu_np), (_, su_np), _ = _case_np(layout)
    gs = np.asarray(GROUP_SIZES[layout][0], np.int32)
    narrow_w = wu_np[..., :32] if layout == "kn" else wu_np[:, :16]  # a weight of another N
    narrow_s = su_np[..., :narrow_w.shape[-1 if layout == "kn" else -2]]
    bad = {
        "share shapes": ((wg, put(narrow_w)), (sg, put(narrow_s))),
        "as many weights as scales": ((wg, wu), (sg,)),
        "both be arrays or both tuples": ((wg, wu), sg),
        "share shapes and dtypes": ((wg, wu), (sg, put(su_np.astype(
            jnp.float16 if su.dtype == jnp.float32 else jnp.float32)))),
    }
    for msg, (w, s) in bad.items():
      with self.subTest(msg), self.assertRaisesRegex(ValueError, msg):
        _run(layout, x, w, s, gs)
    with self.assertRaisesRegex(ValueError, "group_sizes must be"):
      _run(layout, x, (wg, wu), (sg, su), gs[:-1])


def _kernel_launches(fn, *args) -> list[str]:
  """The int4 grouped kernels ``fn`` traces (their kernel names, one per launch)."""
  text = str(jax.make_jaxpr(fn)(*args))
  return re.findall(r"kernel_name='(int4_grouped_matmul\w*)'", text)


class GroupedMatmulsTest(parameterized.TestCase):
  """mlkit.quant.grouped_matmuls: one launch for int4 weights of one kind on the kernel
  backends, one call per weight otherwise (and on "xla", today's numerics exactly)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    rng = np.random.default_rng(3)
    cls.x = put(np.asarray(rng.standard_normal((10, 128)), jnp.bfloat16))
    cls.gs = put(np.array([2, 0, 5, 1], np.int32))
    dense_np = [np.asarray(rng.standard_normal((4, 128, 64)) * 0.1, np.float32) for _ in range(2)]
    cls.dense = [put(d.astype(jnp.bfloat16)) for d in dense_np]
    dense = [put(d) for d in dense_np]
    cls.int4 = [quantize_int4(d, 32) for d in dense]
    cls.int4_g128 = quantize_int4(dense[1], 128)
    cls.fp8 = quantize_fp8(dense[1], None)  # per-channel scales: the XLA reference

  def _launches(self, ws):
    return _kernel_launches(lambda x, ws, gs: grouped_matmuls(x, ws, gs, backend="interpret"),
                            self.x, ws, self.gs)

  def test_one_launch_for_int4_weights_of_one_kind(self):
    self.assertLen(self._launches(tuple(self.int4)), 1)
    nk = tuple(w.to_layout("nk") for w in self.int4)
    self.assertLen(self._launches(nk), 1)

  def test_other_weights_run_one_call_each(self):
    for ws, launches in (((self.int4[0], self.dense[1]), 1),
                         ((self.int4[0], self.fp8), 1),
                         ((self.int4[0], self.int4_g128), 2),
                         ((self.int4[0], self.int4[1].to_layout("nk")), 2),
                         ((self.int4[0],), 1)):
      with self.subTest(ws=[type(w).__name__ for w in ws]):
        self.assertLen(self._launches(ws), launches)

  def test_xla_is_one_grouped_matmul_per_weight(self):
    for ws in (tuple(self.int4), tuple(self.dense), (self.int4[0], self.fp8),
               (self.dense[0], self.int4[1])):
      with self.subTest(ws=[type(w).__name__ for w in ws]):
        got = jax.jit(lambda x, ws, gs: grouped_matmuls(x, ws, gs, backend="xla"))(
            self.x, ws, self.gs)
        want = jax.jit(lambda x, ws, gs: tuple(grouped_matmul(x, w, gs, backend="xla")
                                               for w in ws))(self.x, ws, self.gs)
        self.assertLen(got, len(ws))
        for a, b in zip(got, want):
          np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _experts_before(p, x, token_of, group_sizes, row_weights, slot, backend):
  """The routed experts as they ran with one launch per projection (moe._run_experts)."""
  xs = x[token_of]
  gmm = functools.partial(grouped_matmul, group_sizes=group_sizes, backend=backend)
  h = jax.nn.silu(gmm(xs, p["w_gate"])) * gmm(xs, p["w_up"])
  ys = gmm(h, p["w_down"], out_dtype=jnp.float32) * row_weights[:, None].astype(jnp.float32)
  R = ys.shape[0]
  return sum(jnp.where((slot[:, j] >= 0)[:, None], ys[jnp.clip(slot[:, j], 0, R - 1)], 0.0)
             for j in range(slot.shape[1]))


class MoeExpertsTest(parameterized.TestCase):
  """moe._run_experts with int4 experts: what the three-launch form computed."""

  @parameterized.parameters("interpret", "xla")
  def test_int4_experts_equal_before(self, backend):
    gpu_interpret.reset_gpu_interpret_mode_state()
    rng = np.random.default_rng(4)
    e, d, f, n, k = 4, 128, 64, 5, 2
    p = {name: quantize_int4(put(np.asarray(rng.standard_normal(shape) * 0.1, np.float32)), 32)
         for name, shape in (("w_gate", (e, d, f)), ("w_up", (e, d, f)), ("w_down", (e, f, d)))}
    self.assertIsInstance(p["w_gate"], Int4Weight)
    x = np.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    # The routing's sort, in numpy: rows by expert (stable), each (token, choice)'s row.
    order = np.argsort(ids.reshape(-1), kind="stable")
    token_of = (order // k).astype(np.int32)
    slot = np.zeros((n * k,), np.int32)
    slot[order] = np.arange(n * k, dtype=np.int32)
    slot = slot.reshape(n, k)
    gs = np.bincount(ids.reshape(-1), minlength=e).astype(np.int32)
    args = (p, *put(x, token_of, gs, wts.reshape(-1)[order], slot))
    got = jax.jit(moe._run_experts, static_argnums=6)(*args, backend)
    want = jax.jit(_experts_before, static_argnums=6)(*args, backend)
    self.assertTrue(np.isfinite(np.asarray(got)).all())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class FusedGateUpH200Test(h200_compile_cases.H200CompilerTest):
  """The fused kernel at Kimi K2.6's per-device decode shape on 8 H200s (the launch count
  script's step: 64 requests x top-8 = 512 rows over 48 local experts, d_model 7168 ->
  moe_ffn 2048, group 32, bf16 scales): one launch, as one weight's, no spills."""

  @parameterized.parameters("kn", "nk")
  def test_one_launch_without_spills(self, layout):
    from pallas_kernels.h200 import compile as hc
    m, k, n, e, g = 512, 7168, 2048, 48, 32
    w = (hc.spec((e, k // 2, n), jnp.uint8) if layout == "kn"
         else hc.spec((e, n, k), jnp.int4))
    s = hc.spec((e, k // g, n), jnp.bfloat16)
    rep = hc.compile_for_h200(
        lambda x, wg, sg, wu, su, gs: OPS[layout](x, (wg, wu), (sg, su), gs, group_size=g,
                                                  backend="pallas"),
        hc.spec((m, k), jnp.bfloat16), w, s, w, s, hc.spec((e,), jnp.int32))
    kernel = "int4_grouped_matmul" + ("_nk" if layout == "nk" else "")
    st = rep.kernels[kernel + "_mosaic_gpu_kernel"]
    self.assertEqual(st.spills, 0, st)
    self.assertLessEqual(st.registers, hc.MAX_REGISTERS)
    # One kernel for both weights, beside the schedule and x's operand fusion that one
    # weight's call has too.
    self.assertEqual(rep.launches.count("kCustomCall"), 1, rep.launches)
    self.assertLen(rep.launches, 3, rep.launches)


if __name__ == "__main__":
  absltest.main()
