"""The merge of the Mosaic GPU decode kernels' pieces (paged_attention/merge_pieces.py):
interpret mode against reference.combine_pieces on real schedules, its errors, its
tiles, the ops' merge choice, and an H200 compile of every configuration the engine
builds at the attention target shapes."""

import functools
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mgpu_shim
from pallas_kernels import schedule
from pallas_kernels import targets as kt
import h200_compile_cases
from host_data import put
from pallas_kernels.paged_attention import BlockSizes
from pallas_kernels.paged_attention.block_sizes import MERGES as MERGE_CHOICES
from pallas_kernels.paged_attention import merge_pieces as mp
from pallas_kernels.paged_attention import merge_pieces_mgpu as mm
from pallas_kernels.paged_attention import mla_mgpu
from pallas_kernels.paged_attention import mla_tokens_mgpu
from pallas_kernels.paged_attention import ops
from pallas_kernels.paged_attention import reference

H200 = "NVIDIA H200"


def _jitted(merge):
  """``merge`` under one jit: a program per configuration, where the eager call
  compiled each of its wrapper's operations on its own."""
  return jax.jit(merge, static_argnums=3, static_argnames=("rows", "out_dtype"))


# Both merge kernels, interpreted: the Triton one and the Mosaic GPU one (with race
# detection; the interpreter ignores the programmatic launch), the latter at its
# largest tiles (fewest CTAs, as the ops interpret it: the interpreter runs CTAs one
# after another) and at an H200's (two CTAs per SM: many small tiles, slow here).
MERGES = {
    "triton": _jitted(lambda *a, **kw: mp.merge_pieces(*a, interpret=True, **kw)),
    "mgpu": _jitted(lambda *a, **kw: mm.merge_pieces_mgpu(
        *a, interpret=mgpu_shim.interpret_params(), ctas=1, **kw)),
    "mgpu_h200_tiles": _jitted(lambda *a, **kw: mm.merge_pieces_mgpu(
        *a, interpret=mgpu_shim.interpret_params(), **kw)),
}


def _partials(seed, lengths, *, pieces, x, r, d, dtype, rl=None, page_size=64, max_pages=64):
  """(o, lse, schedule [5, G]): a real schedule over ``lengths`` and random partials
  on it: empty pieces carry o = 0 and a very negative lse, as the kernels write them."""
  sched = schedule.schedule_pieces(put(np.asarray(lengths, np.int32)), page_size=page_size,
                                   max_pages=max_pages, pieces=pieces)
  g = sched.shape[1]
  rng = np.random.default_rng(seed)
  empty = np.asarray(sched)[2] == 0
  o = rng.standard_normal((g, x, r, d)).astype(np.float32)
  lse = (rng.standard_normal((g, x, rl or r)) * 4).astype(np.float32)
  o[empty], lse[empty] = 0.0, mla_mgpu.NEG
  # Cast by numpy and placed by device_put: no compile (jnp.asarray compiles two).
  return put(o.astype(dtype)), put(lse), sched


def _request(sched):
  """The schedule's request row [G], sliced on the host: no program."""
  return put(np.asarray(sched)[0])


@functools.partial(jax.jit, static_argnums=(3, 4))
def _reference_jit(o, lse, request, batch, rows):
  g, x, _, d = o.shape
  out = reference.combine_pieces(o[:, :, :rows].astype(jnp.float32).reshape(g, x * rows, d),
                                 lse[:, :, :rows].reshape(g, x * rows), request, batch)
  return out.reshape(batch, x, rows, d)


def _reference(o, lse, request, batch, rows):
  """reference.combine_pieces on the real rows, jitted (one compile, not one per op)."""
  return np.asarray(_reference_jit(o, lse, request, batch, rows))


class MergeMatchesReferenceTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # MLA: 12 real heads of 16 partial rows, ragged requests, one with no tokens.
      ("mla_ragged", [700, 0, 64, 3000], dict(pieces=20, x=1, r=16, rl=64, d=512,
                                              dtype=jnp.bfloat16), 12),
      # One request over 128 pieces: more than one kp step per program. The Triton
      # merge only: interpreting the Mosaic GPU one's 256 CTAs takes a minute.
      ("one_long_request", [32768], dict(pieces=132, x=1, r=64, d=512, dtype=jnp.bfloat16,
                                         max_pages=512), 64, ("triton",)),
      # The same for the Mosaic GPU merge at an H200's tiles: 40 pieces, 8 CTAs of
      # one [128] row, 2 steps of 32 (MAX_LOADS).
      ("two_steps", [5120], dict(pieces=132, x=1, r=8, d=128, dtype=jnp.bfloat16,
                                 max_pages=128), 8, ("mgpu", "mgpu_h200_tiles")),
      # An H200's tiles over ragged requests and row groups (48 CTAs).
      ("gqa_h200_tiles", [100, 3000, 1], dict(pieces=12, x=4, r=64, d=128,
                                             dtype=jnp.float32), 4, ("mgpu_h200_tiles",)),
      # GQA: f32 partials of 2 KV heads x 64 rows, 5 real rows each (row tile 8, sliced).
      # Two row groups index the KV head as 8 do, with the same tiles (Triton (8, 16, 8),
      # Mosaic GPU (8, 128, 4)) in a quarter of the CTAs, which the interpreter runs in turn.
      ("gqa_group5", [100, 3000, 1, 900], dict(pieces=24, x=2, r=64, d=128,
                                               dtype=jnp.float32), 5),
      # Every piece of one request at once (kp >= its pieces), 3 real heads.
      ("three_heads", [4096, 128], dict(pieces=8, x=1, r=8, d=128, dtype=jnp.float32), 3),
      # 64 columns: the Triton merge only (the ops send GQA's 64 and 192 to it).
      ("narrow_columns", [4096, 128], dict(pieces=8, x=1, r=8, d=64, dtype=jnp.float32), 3,
       ("triton",)),
  )
  def test_matches_reference(self, lengths, kw, rows, kernels=("triton", "mgpu")):
    o, lse, sched = _partials(len(lengths) + rows, lengths, **kw)
    request = _request(sched)
    b = len(lengths)
    # The kernel writes the output dtype: bf16 (the ops' case) for bf16 partials.
    out_dtype = kw["dtype"]
    want = _reference(o, lse, request, b, rows)
    for kernel in kernels:
      with self.subTest(kernel=kernel):
        got = MERGES[kernel](o, lse, request, b, rows=rows, out_dtype=out_dtype)
        self.assertEqual(got.shape, (b, kw["x"], rows, kw["d"]))
        self.assertEqual(got.dtype, out_dtype)
        if out_dtype == jnp.float32:
          np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
        else:  # the f32 result rounded once: within a bf16 step of the rounded reference
          np.testing.assert_allclose(np.asarray(got, np.float32),
                                     want.astype(jnp.bfloat16).astype(np.float32),
                                     rtol=8e-3, atol=1e-6)
        if 0 in lengths:  # a request with no tokens: its one empty piece gives zeros
          np.testing.assert_array_equal(np.asarray(got, np.float32)[lengths.index(0)], 0.0)
        # The ranges the schedule carries (the ops' way): the same (small cases).
        if b * kw["x"] * rows <= 32 and kernel != "mgpu_h200_tiles":
          np.testing.assert_array_equal(
              np.asarray(MERGES[kernel](o, lse, request, b, rows=rows, out_dtype=out_dtype,
                                        ranges=sched), np.float32),
              np.asarray(got, np.float32))

  def test_pieces_far_apart_in_lse_weigh_by_it(self):
    # One request, three pieces whose lse differ by 60: the largest dominates, no overflow.
    o = np.random.default_rng(0).standard_normal((3, 1, 8, 128)).astype(np.float32)
    lse = (np.array([-30.0, 30.0, 0.0], np.float32)[:, None, None]
           * np.ones((3, 1, 8), np.float32))
    args = put(o, lse, np.zeros((3,), np.int32))
    for kernel, merge in MERGES.items():
      with self.subTest(kernel=kernel):
        got = merge(*args, 1)
        np.testing.assert_allclose(np.asarray(got)[0], o[1], rtol=1e-6, atol=1e-6)


class MergeErrorsTest(parameterized.TestCase):

  # The bad operands are made on the host and placed as they are: no program makes them.
  def setUp(self):
    super().setUp()
    self.o_h = np.zeros((4, 1, 8, 128), jnp.bfloat16)
    self.lse_h = np.zeros((4, 1, 8), np.float32)
    self.req_h = np.array([0, 0, 1, -1], np.int32)
    self.o, self.lse, self.req = put(self.o_h, self.lse_h, self.req_h)

  @parameterized.named_parameters(
      ("o_not_4d", lambda s: (put(s.o_h[:, 0]), s.lse, s.req, {}), "must be"),
      ("lse_pieces", lambda s: (s.o, put(s.lse_h[:3]), s.req, {}), "disagree"),
      ("request_pieces", lambda s: (s.o, s.lse, put(s.req_h[:3]), {}), "disagree"),
      ("rows_too_many", lambda s: (s.o, s.lse, s.req, {"rows": 9}), "rows must be"),
      ("rows_zero", lambda s: (s.o, s.lse, s.req, {"rows": 0}), "rows must be"),
      ("lse_bf16", lambda s: (s.o, put(s.lse_h.astype(jnp.bfloat16)), s.req, {}), "lse f32"),
      ("o_int", lambda s: (put(s.o_h.astype(np.int32)), s.lse, s.req, {}), "floating"),
      ("columns", lambda s: (put(np.zeros((4, 1, 8, 40), np.float32)), s.lse, s.req, {}),
       "divisible by"),
      ("lse_rows_short", lambda s: (s.o, put(s.lse_h[:, :, :4]), s.req, {}), "must fit"),
  )
  def test_rejects(self, make, msg):
    o, lse, req, kw = make(self)
    for kernel, merge in MERGES.items():
      with self.subTest(kernel=kernel), self.assertRaisesRegex(ValueError, msg):
        merge(o, lse, req, 2, **kw)

  def test_refuses_ranges_it_cannot_read(self):
    for bad in put(np.zeros((1, 4), np.int32), np.zeros((5, 1), np.int32),
                   np.zeros((5, 4), np.float32), np.zeros((4,), np.int32)):
      for kernel, merge in MERGES.items():
        with self.subTest(kernel=kernel, shape=bad.shape, dtype=bad.dtype), \
             self.assertRaisesRegex(ValueError, "ranges must be int32"):
          merge(self.o, self.lse, self.req, 2, ranges=bad)

  def test_mgpu_needs_columns_in_128s(self):
    with self.assertRaisesRegex(ValueError, "divisible by 128; got 64"):
      MERGES["mgpu"](put(np.zeros((4, 1, 8, 64), np.float32)), self.lse, self.req, 2)
    self.assertTrue(mm.supports(128) and mm.supports(512))
    self.assertFalse(mm.supports(64) or mm.supports(192))


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


class MgpuTilesTest(absltest.TestCase):

  def test_fills_the_machine_within_the_register_budget(self):
    for b, x, rows, d, g in [(1, 1, 64, 512, 132), (8, 1, 64, 512, 132), (64, 1, 64, 512, 132),
                             (1, 1, 8, 512, 132), (64, 1, 8, 512, 132), (1, 8, 8, 128, 33),
                             (64, 8, 1, 128, 65), (3, 1, 12, 256, None)]:
      bh, bd, kp = mm.tiles(b, x, rows, d, g, kind=H200)
      ctas = b * x * -(-rows // bh) * d // bd
      self.assertEqual(d % bd, 0)
      self.assertLessEqual(bh, mp.pow2_at_least(rows))
      self.assertLessEqual(kp * bh, mm.MAX_LOADS)
      self.assertLessEqual(kp * bh * bd, mm.TILE_ELEMENTS)
      if g is not None:
        self.assertLessEqual(kp, mp.pow2_at_least(-(-g // b)))
      # The widest columns, then the most rows, that give every SM two CTAs;
      # the smallest tile (most CTAs) where none does.
      if ctas < 2 * 132:
        self.assertEqual((bh, bd), (1, mm.COL_TILES[-1]), (b, x, rows, d))
      else:
        for wider in (c for c in mm.COL_TILES if c > bd and d % c == 0):
          self.assertLess(b * x * rows * d // wider, 2 * 132)
    self.assertEqual(mm.tiles(64, 1, 64, 512, 132, kind=H200), (8, 512, 2))
    self.assertEqual(mm.tiles(1, 1, 64, 512, 132, kind=H200), (1, 128, 32))
    self.assertEqual(mm.tiles(8, 1, 64, 512, 132, kind=H200), (1, 512, 16))
    # Aiming for one CTA (the ops, interpreting): the largest tile.
    self.assertEqual(mm.tiles(1, 1, 64, 512, 132, kind=H200, ctas=1), (8, 512, 2))


# The ops' merge step under one jit, as the ops run it (inside theirs): a program per
# configuration, not a compile per eager operation.
_ops_merge = jax.jit(ops._merge, static_argnums=3,
                     static_argnames=("rows", "out_dtype", "merge", "interpret"))


class OpsMergeChoiceTest(absltest.TestCase):

  def test_every_merge_agrees(self):
    # The ops' merge step each way (BlockSizes.merge; every op test runs the default):
    # GQA-shaped f32 partials, 3 real rows of each KV head's 64, bf16 out.
    o, lse, sched = _partials(7, [300, 2000, 0], pieces=16, x=2, r=64, d=128,
                              dtype=jnp.float32)
    outs = {m: _ops_merge(o, lse, sched, 3, rows=3, out_dtype=jnp.bfloat16, merge=m,
                          interpret=True) for m in MERGE_CHOICES}
    self.assertEqual(BlockSizes().merge, "mgpu")
    for m, out in outs.items():
      self.assertEqual(out.shape, (3, 2, 3, 128), m)
      self.assertEqual(out.dtype, jnp.bfloat16, m)
      # The same f32 merge in another order, rounded to bf16: at most a bf16 step apart.
      np.testing.assert_allclose(np.asarray(out, np.float32),
                                 np.asarray(outs["xla"], np.float32), rtol=8e-3, atol=1e-6,
                                 err_msg=m)
    # Both launches of the Mosaic GPU merge are the same kernel, interpreted alike.
    np.testing.assert_array_equal(np.asarray(outs["mgpu"], np.float32),
                                  np.asarray(outs["mgpu_serial"], np.float32))

  def test_only_the_default_launches_the_merge_as_a_dependent(self):
    o, lse, sched = _partials(9, [300], pieces=4, x=1, r=8, d=128, dtype=jnp.float32)
    for merge, pdl in (("mgpu", True), ("mgpu_serial", False)):
      with mock.patch.object(mm, "merge_pieces_mgpu") as kernel:
        ops._merge(o, lse, sched, 1, rows=8, out_dtype=jnp.float32, merge=merge,
                   interpret=False)
      self.assertEqual(kernel.call_args.kwargs["pdl"], pdl, merge)
      self.assertIs(kernel.call_args.kwargs["ranges"], sched, merge)

  def test_columns_the_mgpu_merge_does_not_take_go_to_the_triton_one(self):
    o, lse, sched = _partials(8, [300, 2000], pieces=8, x=2, r=64, d=64,
                              dtype=jnp.float32)
    request = _request(sched)
    with mock.patch.object(mm, "merge_pieces_mgpu", side_effect=AssertionError("mgpu ran")):
      got = _ops_merge(o, lse, sched, 2, rows=4, out_dtype=jnp.float32, merge="mgpu",
                       interpret=True)
    np.testing.assert_allclose(np.asarray(got), _reference(o, lse, request, 2, 4),
                               rtol=1e-5, atol=1e-5)

  def test_unknown_merge_is_refused(self):
    with self.assertRaisesRegex(ValueError, "merge must be"):
      BlockSizes(merge="atomic")
    with self.assertRaisesRegex(ValueError, "merge must be"):
      BlockSizes(merge="kernel")  # the Triton merge's old name


def _target_merges(tiles) -> dict:
  """The merge each MLA and GQA decode target case builds on an H200 (the engine's
  Mosaic GPU kernels), by what its compiled kernel depends on (``tiles``: the merge
  kernel's tile choice); the case with the most pieces stands for its configuration."""
  out = {}
  for case in kt.mla_cases():
    d = case.d
    b, h = d["batch"], d["heads"]
    g = ops.mla_mgpu_pieces(b, h, d["max_pages"], kind=H200)
    tokens = h <= mla_tokens_mgpu.MAX_HEADS  # "auto" at 64-token pages, C and R % 64 == 0
    rows = mla_mgpu.partial_rows(h)
    lse_rows = rows if tokens else -(-h // mla_mgpu.BLOCK_H) * mla_mgpu.BLOCK_H
    args = (b, (g, 1, rows, d["c"]), mla_mgpu.PARTIAL_DTYPE, (g, 1, lse_rows), h)
    key = ("mla", tiles(b, 1, h, d["c"], g, kind=H200), h)
    if key not in out or out[key][1][0] < g:
      out[key] = args
  for case in kt.gqa_cases():
    d = case.d
    b, kv, grp = d["batch"], d["kv_heads"], d["group"]
    blocks = -(-d["max_pages"] * d["page_size"] // 64)
    g = ops.gqa_mgpu_pieces(b, kv, blocks, kind=H200)
    args = (b, (g, kv, 64, d["head_dim"]), jnp.float32, (g, kv, 64), grp)
    key = ("gqa", tiles(b, kv, grp, d["head_dim"], g, kind=H200), grp)
    if key not in out or out[key][1][0] < g:
      out[key] = args
  return out


def _compile_merge(merge, b, oshape, odt, lshape, rows, **kw):
  from pallas_kernels.h200 import compile as hc
  fn = lambda o, lse, req: merge(o, lse, req, b, rows=rows, out_dtype=jnp.bfloat16, **kw)
  return hc.compile_for_h200(fn, hc.spec(oshape, odt), hc.spec(lshape, jnp.float32),
                             hc.spec(oshape[:1], jnp.int32))


def _ptx(compile_fn) -> tuple[dict[str, str], object]:
  """({kernel name: PTX} of the Mosaic GPU kernels ``compile_fn()`` builds, what
  ``compile_fn()`` returns): the PTX alone, not Mosaic GPU's whole dump
  (pallas_kernels.h200.compile.read_mosaic_ptx)."""
  from pallas_kernels.h200 import compile as hc
  modules, result = hc.read_mosaic_ptx(compile_fn)
  return dict(modules), result


def pdl_problems(merge_ptx: str, decode_ptx: str | None = None) -> list[str]:
  """What breaks the programmatic launch in a merge's (and its decode kernel's) PTX:
  the merge must wait on its prerequisite grids before its first global load, and
  the decode kernel must let it launch."""
  out = []
  wait = merge_ptx.find("griddepcontrol.wait")
  first_load = merge_ptx.find("ld.global")
  if wait < 0:
    out.append("the merge never executes griddepcontrol.wait")
  elif first_load < 0:
    out.append("no global load found in the merge: the check is blind")
  elif first_load < wait:
    out.append("the merge loads from global memory before griddepcontrol.wait")
  if decode_ptx is not None and "griddepcontrol.launch_dependents" not in decode_ptx:
    out.append("the decode kernel never executes griddepcontrol.launch_dependents")
  return out


class MergeCompilesForH200Test(h200_compile_cases.H200CompilerTest):
  """Every merge configuration of the attention target cases compiles for sm_90a with
  zero spills (the op compiles of test_h200_compile_attention read only one each)."""

  @parameterized.named_parameters(
      ("triton", mp.tiles, lambda *a, **kw: mp.merge_pieces(*a, **kw), "merge_pieces"),
      ("mgpu", mm.tiles, lambda *a, **kw: mm.merge_pieces_mgpu(*a, **kw),
       "merge_pieces_mgpu_mosaic_gpu_kernel"),
  )
  def test_every_target_configuration(self, tiles, merge, name):
    from pallas_kernels.h200 import compile as hc
    merges = _target_merges(tiles)
    self.assertGreaterEqual(len(merges), 6)
    for key, args in merges.items():
      rep = _compile_merge(merge, *args)
      st = rep.kernels[name]
      with self.subTest(key=key):
        self.assertEqual(st.spills, 0, f"{key}: {st}")
        self.assertLessEqual(st.registers, hc.MAX_REGISTERS)
        self.assertIsNotNone(st.smem)
        # One small reduction for the request ranges, then the merge: no GEMM.
        self.assertEqual(len(rep.launches), 2, rep.launches)
        if name.endswith("_mosaic_gpu_kernel"):
          # At most 4 x 32 per lane (ptxas: 31-133 at MAX_LOADS), so several merge
          # CTAs fit an SM, beside a decode CTA where it leaves room.
          self.assertLessEqual(st.registers, 136, key)
          self.assertEqual(st.smem, 0, key)  # it reads global memory straight

  def test_the_merge_waits_before_it_reads_and_the_decode_kernel_lets_it_launch(self):
    case = {c.name: c for c in kt.target_cases(("paged_mla_decode",))}[
        "mla/tp8/fp8/b64/ctx32768"]
    from pallas_kernels.h200 import compile as hc
    specs = [None if a is None else hc.spec(*a) for a in case.arg_shapes()]

    def build(merge):
      bs = BlockSizes(impl="mgpu", merge=merge)
      return lambda: hc.compile_for_h200(
          lambda *a: ops.paged_mla_decode(*a, backend="pallas", block_sizes=bs,
                                          **case.static_kwargs()), *specs)

    ptx, report = _ptx(build("mgpu"))
    self.assertEqual(sorted(ptx), ["merge_pieces_mgpu", "paged_mla_decode_tokens_mgpu"])
    # Each Mosaic GPU kernel's shared memory, by name.
    smem = {k: st.smem for k, st in report.kernels.items()}
    self.assertEqual(smem["merge_pieces_mgpu_mosaic_gpu_kernel"], 0)
    self.assertGreater(smem["paged_mla_decode_tokens_mgpu_mosaic_gpu_kernel"], 150_000)
    self.assertEqual(pdl_problems(ptx["merge_pieces_mgpu"], ptx["paged_mla_decode_tokens_mgpu"]),
                     [])
    # Launched as an ordinary kernel (merge="mgpu_serial"), the merge does not wait.
    serial = _ptx(lambda: _compile_merge(
        mm.merge_pieces_mgpu, 64, (132, 1, 8, 512), jnp.bfloat16, (132, 1, 8), 8,
        pdl=False))[0]["merge_pieces_mgpu"]
    self.assertNotIn("griddepcontrol", serial)
    self.assertEqual(pdl_problems(serial), ["the merge never executes griddepcontrol.wait"])

  def test_the_pdl_check_sees_a_load_before_the_wait(self):
    ok = "\tgriddepcontrol.wait;\n\tld.global.u32 %r1, [%rd1];\n"
    self.assertEqual(pdl_problems(ok, "\tgriddepcontrol.launch_dependents;\n"), [])
    self.assertEqual(pdl_problems("\tld.global.u32 %r2, [%rd2];\n" + ok),
                     ["the merge loads from global memory before griddepcontrol.wait"])
    self.assertEqual(pdl_problems("\tgriddepcontrol.wait;\n"),
                     ["no global load found in the merge: the check is blind"])
    self.assertEqual(pdl_problems(ok, "\tbar.sync 0;\n"),
                     ["the decode kernel never executes griddepcontrol.launch_dependents"])


if __name__ == "__main__":
  absltest.main()
