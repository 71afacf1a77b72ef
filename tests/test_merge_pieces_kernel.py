"""The merge of the Mosaic GPU decode kernels' pieces (paged_attention/merge_pieces.py):
interpret mode against reference.combine_pieces on real schedules, its errors, its
tiles, the ops' merge choice, and an H200 compile of every configuration the engine
builds at the attention target shapes."""

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np

from experiments import kernel_targets as kt
from pallas_kernels import schedule
from pallas_kernels.h200 import env as h200_env
from pallas_kernels.paged_attention import BlockSizes
from pallas_kernels.paged_attention import merge_pieces as mp
from pallas_kernels.paged_attention import mla_mgpu
from pallas_kernels.paged_attention import mla_tokens_mgpu
from pallas_kernels.paged_attention import ops
from pallas_kernels.paged_attention import reference

H200 = "NVIDIA H200"


def _partials(seed, lengths, *, pieces, x, r, d, dtype, rl=None, page_size=64, max_pages=64):
  """A real schedule over ``lengths`` and random partials on it: empty pieces carry
  o = 0 and a very negative lse, as the kernels write them."""
  sched = schedule.schedule_pieces(jnp.asarray(lengths, jnp.int32), page_size=page_size,
                                   max_pages=max_pages, pieces=pieces)
  g = sched.shape[1]
  rng = np.random.default_rng(seed)
  empty = np.asarray(sched[2] == 0)
  o = rng.standard_normal((g, x, r, d)).astype(np.float32)
  lse = (rng.standard_normal((g, x, rl or r)) * 4).astype(np.float32)
  o[empty], lse[empty] = 0.0, mla_mgpu.NEG
  return jnp.asarray(o, dtype), jnp.asarray(lse), sched[0]


def _reference(o, lse, request, batch, rows):
  g, x, _, d = o.shape
  out = reference.combine_pieces(o[:, :, :rows].astype(jnp.float32).reshape(g, x * rows, d),
                                 lse[:, :, :rows].reshape(g, x * rows), request, batch)
  return np.asarray(out.reshape(batch, x, rows, d))


class MergeMatchesReferenceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # MLA: 12 real heads of 16 partial rows, ragged requests, one with no tokens.
      ("mla_ragged", [700, 0, 64, 3000], dict(pieces=20, x=1, r=16, rl=64, d=512,
                                              dtype=jnp.bfloat16), 12),
      # One request over 128 pieces: more than one kp step per program.
      ("one_long_request", [32768], dict(pieces=132, x=1, r=64, d=512, dtype=jnp.bfloat16,
                                         max_pages=512), 64),
      # GQA: f32 partials of 8 KV heads x 64 rows, 5 real rows each (row tile 8, sliced).
      ("gqa_group5", [100, 3000, 1, 900], dict(pieces=24, x=8, r=64, d=128,
                                               dtype=jnp.float32), 5),
      # Every piece of one request at once (kp >= its pieces), 3 real heads.
      ("three_heads", [4096, 128], dict(pieces=8, x=1, r=8, d=64, dtype=jnp.float32), 3),
  )
  def test_matches_reference(self, lengths, kw, rows):
    o, lse, request = _partials(len(lengths) + rows, lengths, **kw)
    b = len(lengths)
    # The kernel writes the output dtype: bf16 (the ops' case) for bf16 partials.
    out_dtype = kw["dtype"]
    got = mp.merge_pieces(o, lse, request, b, rows=rows, out_dtype=out_dtype, interpret=True)
    self.assertEqual(got.shape, (b, kw["x"], rows, kw["d"]))
    self.assertEqual(got.dtype, out_dtype)
    want = _reference(o, lse, request, b, rows)
    if out_dtype == jnp.float32:
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    else:  # the f32 result rounded once: within a bf16 step of the rounded reference
      np.testing.assert_allclose(np.asarray(got, np.float32),
                                 np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32),
                                 rtol=8e-3, atol=1e-6)
    if 0 in lengths:  # a request with no tokens: its one empty piece gives zeros
      np.testing.assert_array_equal(np.asarray(got, np.float32)[lengths.index(0)], 0.0)

  def test_pieces_far_apart_in_lse_weigh_by_it(self):
    # One request, three pieces whose lse differ by 60: the largest dominates, no overflow.
    o = jnp.asarray(np.random.default_rng(0).standard_normal((3, 1, 8, 64)), jnp.float32)
    lse = jnp.asarray(np.array([-30.0, 30.0, 0.0], np.float32)[:, None, None]
                      * np.ones((3, 1, 8), np.float32))
    got = mp.merge_pieces(o, lse, jnp.zeros((3,), jnp.int32), 1, interpret=True)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(o[1]), rtol=1e-6, atol=1e-6)


class MergeErrorsTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.o = jnp.zeros((4, 1, 8, 64), jnp.bfloat16)
    self.lse = jnp.zeros((4, 1, 8), jnp.float32)
    self.req = jnp.array([0, 0, 1, -1], jnp.int32)

  @parameterized.named_parameters(
      ("o_not_4d", lambda s: (s.o[:, 0], s.lse, s.req, {}), "must be"),
      ("lse_pieces", lambda s: (s.o, s.lse[:3], s.req, {}), "disagree"),
      ("request_pieces", lambda s: (s.o, s.lse, s.req[:3], {}), "disagree"),
      ("rows_too_many", lambda s: (s.o, s.lse, s.req, {"rows": 9}), "rows must be"),
      ("rows_zero", lambda s: (s.o, s.lse, s.req, {"rows": 0}), "rows must be"),
      ("lse_bf16", lambda s: (s.o, s.lse.astype(jnp.bfloat16), s.req, {}), "lse f32"),
      ("o_int", lambda s: (s.o.astype(jnp.int32), s.lse, s.req, {}), "floating"),
      ("columns", lambda s: (jnp.zeros((4, 1, 8, 40)), s.lse, s.req, {}), "divisible"),
      ("lse_rows_short", lambda s: (s.o, s.lse[:, :, :4], s.req, {}), "must fit"),
  )
  def test_rejects(self, make, msg):
    o, lse, req, kw = make(self)
    with self.assertRaisesRegex(ValueError, msg):
      mp.merge_pieces(o, lse, req, 2, interpret=True, **kw)


class TilesTest(absltest.TestCase):

  def test_fills_the_machine_and_keeps_the_tile(self):
    for b, x, rows, d in [(1, 1, 64, 512), (8, 1, 64, 512), (64, 1, 64, 512), (1, 8, 8, 128),
                          (64, 8, 1, 128), (1, 1, 8, 512)]:
      bh, bd, kp = mp.tiles(b, x, rows, d, kind=H200)
      programs = b * x * -(-rows // bh) * d // bd
      self.assertEqual(d % bd, 0)
      self.assertEqual(bh * bd * kp, mp.TILE_ELEMENTS)
      # The widest columns that still give every SM two programs; the narrowest otherwise.
      wider = [c for c in mp._COL_TILES if c > bd and d % c == 0]
      if programs >= 2 * 132:
        for c in wider:
          self.assertLess(b * x * -(-rows // bh) * d // c, 2 * 132)
      else:
        self.assertEqual(bd, mp._COL_TILES[-1])
    self.assertEqual(mp.tiles(64, 1, 64, 512, kind=H200)[1], 128)
    self.assertEqual(mp.tiles(1, 1, 64, 512, kind=H200)[1], 16)
    # Pieces per step: no more than an average request has (132 pieces over 64: 4).
    self.assertEqual(mp.tiles(64, 1, 64, 512, 132, kind=H200), (8, 128, 4))
    self.assertEqual(mp.tiles(1, 1, 64, 512, 132, kind=H200), (8, 16, 64))
    self.assertEqual(mp.tiles(8, 1, 64, 512, 132, kind=H200), (8, 64, 16))


class OpsMergeChoiceTest(absltest.TestCase):

  def test_kernel_and_xla_merges_agree(self):
    # The ops' merge step either way (BlockSizes.merge; every op test runs "kernel"):
    # GQA-shaped f32 partials, 3 real rows of each KV head's 64, bf16 out.
    o, lse, request = _partials(7, [300, 2000, 0], pieces=16, x=2, r=64, d=64,
                                dtype=jnp.float32)
    outs = [ops._merge(o, lse, request, 3, rows=3, out_dtype=jnp.bfloat16, merge=m,
                       interpret=True) for m in ("kernel", "xla")]
    self.assertEqual(outs[1].shape, (3, 2, 3, 64))
    self.assertEqual(outs[1].dtype, jnp.bfloat16)
    # The same f32 merge in another order, rounded to bf16: at most a bf16 step apart.
    np.testing.assert_allclose(np.asarray(outs[0], np.float32),
                               np.asarray(outs[1], np.float32), rtol=8e-3, atol=1e-6)

  def test_unknown_merge_is_refused(self):
    with self.assertRaisesRegex(ValueError, "merge must be"):
      BlockSizes(merge="atomic")


def _target_merges() -> dict:
  """The merge each MLA and GQA decode target case builds on an H200 (the engine's
  Mosaic GPU kernels), by what its compiled kernel depends on; the case with the
  most pieces stands for its configuration."""
  out = {}
  for case in kt.mla_cases():
    d = case.d
    b, h = d["batch"], d["heads"]
    g = ops.mla_mgpu_pieces(b, h, d["max_pages"], kind=H200)
    tokens = h <= mla_tokens_mgpu.MAX_HEADS  # "auto" at 64-token pages, C and R % 64 == 0
    rows = mla_mgpu.partial_rows(h)
    lse_rows = rows if tokens else -(-h // mla_mgpu.BLOCK_H) * mla_mgpu.BLOCK_H
    args = (b, (g, 1, rows, d["c"]), mla_mgpu.PARTIAL_DTYPE, (g, 1, lse_rows), h)
    key = ("mla", mp.tiles(b, 1, h, d["c"], g, kind=H200), h)
    if key not in out or out[key][1][0] < g:
      out[key] = args
  for case in kt.gqa_cases():
    d = case.d
    b, kv, grp = d["batch"], d["kv_heads"], d["group"]
    blocks = -(-d["max_pages"] * d["page_size"] // 64)
    g = ops.gqa_mgpu_pieces(b, kv, blocks, kind=H200)
    args = (b, (g, kv, 64, d["head_dim"]), jnp.float32, (g, kv, 64), grp)
    key = ("gqa", mp.tiles(b, kv, grp, d["head_dim"], g, kind=H200), grp)
    if key not in out or out[key][1][0] < g:
      out[key] = args
  return out


class MergeCompilesForH200Test(absltest.TestCase):
  """Every merge configuration of the attention target cases compiles for sm_90a with
  zero spills (the op compiles of test_h200_compile_attention read only one each)."""

  def test_every_target_configuration(self):
    problems = h200_env.check()
    if problems:
      self.fail("; ".join(problems))  # never skip: `make test` installs the compiler
    from pallas_kernels.h200 import compile as hc
    merges = _target_merges()
    self.assertGreaterEqual(len(merges), 6)
    for key, (b, oshape, odt, lshape, rows) in merges.items():
      fn = lambda o, lse, req, b=b, rows=rows: mp.merge_pieces(
          o, lse, req, b, rows=rows, out_dtype=jnp.bfloat16)
      rep = hc.compile_for_h200(fn, hc.spec(oshape, odt), hc.spec(lshape, jnp.float32),
                                hc.spec(oshape[:1], jnp.int32))
      st = rep.kernels["merge_pieces"]
      with self.subTest(key=key):
        self.assertEqual(st.spills, 0, f"{key}: {st}")
        self.assertLessEqual(st.registers, hc.MAX_REGISTERS)
        # One small reduction for the request ranges, then the merge: no GEMM.
        self.assertEqual(len(rep.launches), 2, rep.launches)


if __name__ == "__main__":
  absltest.main()
