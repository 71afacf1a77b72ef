"""The compiled-program step-time model: reading launches from HLO text
(pallas_kernels.h200.program) and timing them (mlkit.plan.step_time).

The reader is checked on a hand-written scheduled HLO module, so every rule (slices,
in-place updates, dots, library GEMMs, loops, async collectives, Pallas calls) has a
known answer; the model on synthetic launches with the arithmetic written out. The
compiled steps themselves are read in the paper experiment's smoke run
(test_experiments.SmokeRunsTest)."""

import math
import os

from absl.testing import absltest

from configs import GLM_5_2, H200, KIMI_K2_6
from mlkit.plan import step_time as st
from pallas_kernels.h200 import program
from pallas_kernels.paged_attention import bench as attn_bench

HLO = """HloModule jit__step, is_scheduled=true, entry_computation_layout={()->f32[]}

%fused_gather (param_0: bf16[1000,64], param_1: s32[4,1]) -> bf16[4,64] {
  %param_0 = bf16[1000,64]{1,0} parameter(0)
  %param_1 = s32[4,1]{1,0} parameter(1)
  ROOT %gather.1 = bf16[4,64]{1,0} gather(%param_0, %param_1), offset_dims={1}, slice_sizes={1,64}
}

%fused_scatter (param_0.1: f32[100,8], param_1.1: s32[2,1], param_2: f32[2,8]) -> f32[100,8] {
  %param_0.1 = f32[100,8]{1,0} parameter(0)
  %param_1.1 = s32[2,1]{1,0} parameter(1)
  %param_2 = f32[2,8]{1,0} parameter(2)
  ROOT %scatter.1 = f32[100,8]{1,0} scatter(%param_0.1, %param_1.1, %param_2), to_apply=%add
}

%fused_dot (p0: bf16[4,16], p1: bf16[16,32]) -> f32[4,32] {
  %p0 = bf16[4,16]{1,0} parameter(0)
  %p1 = bf16[16,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_ar (q0: f32[64]) -> f32[64] {
  %q0 = f32[64]{0} parameter(0)
  ROOT %all-reduce.1 = f32[64]{0} all-reduce(%q0), replica_groups={}, to_apply=%add
}

%fused_add (a0: f32[64]) -> f32[64] {
  %a0 = f32[64]{0} parameter(0)
  ROOT %add.9 = f32[64]{0} add(%a0, %a0)
}

%body (s: (s32[], f32[64])) -> (s32[], f32[64]) {
  %s = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[64]{0} get-tuple-element(%s), index=1
  %loop_add = f32[64]{0} fusion(%v), kind=kLoop, calls=%fused_add
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %loop_add)
}

%cond (c: (s32[], f32[64])) -> pred[] {
  %c = (s32[], f32[64]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (table: bf16[1000,64], idx: s32[4,1], pool: f32[100,8], rows: s32[2,1], upd: f32[2,8], x: bf16[4,16], w: bf16[16,32]) -> f32[4,32] {
  %table = bf16[1000,64]{1,0} parameter(0), metadata={op_name="params[\\'embed\\']"}
  %idx = s32[4,1]{1,0} parameter(1)
  %pool = f32[100,8]{1,0} parameter(2)
  %rows = s32[2,1]{1,0} parameter(3)
  %upd = f32[2,8]{1,0} parameter(4)
  %x = bf16[4,16]{1,0} parameter(5)
  %w = bf16[16,32]{1,0} parameter(6)
  %embed = bf16[4,64]{1,0} fusion(%table, %idx), kind=kLoop, calls=%fused_gather, metadata={op_name="jit(_step)/embed/gather"}
  %write = f32[100,8]{1,0} fusion(%pool, %rows, %upd), kind=kInput, calls=%fused_scatter, metadata={op_name="jit(_step)/layer_0/paged_kv_write/scatter"}
  %proj = f32[4,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(_step)/layer_1/dot_general"}
  %gemm = (f32[4,32]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(_step)/layer_1/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %bitcast.1 = f32[128]{0} bitcast(%proj)
  %ar-start = ((f32[64]{0}), f32[64]{0}) fusion-start(%upd), kind=kCustom, calls=%fused_ar, metadata={op_name="jit(_step)/layer_1/psum"}
  %ar-done = f32[64]{0} fusion-done(%ar-start)
  %ag-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%upd), dimensions={0}
  %ag-done = f32[64]{0} all-gather-done(%ag-start)
  %init = (s32[], f32[64]{0}) tuple(%ar-done)
  %loop = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %kernel = bf16[4,64]{1,0} custom-call(%embed, %x), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(_step)/layer_1/jit(my_kernel)/my_kernel/mpmd_map"}
  ROOT %out = f32[4,32]{1,0} copy(%proj)
}
"""


class ProgramReadTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.launches = {ln.name: ln for ln in program.launches(HLO)}

  def test_what_launches(self):
    # Parameters, bitcasts, tuples and -done halves launch nothing; the loop's body does.
    self.assertEqual(list(self.launches), ["embed", "write", "proj", "gemm", "ar-start",
                                           "ag-start", "loop_add", "kernel", "out"])

  def test_a_gathered_table_counts_the_rows_read(self):
    embed = self.launches["embed"]
    # 4 rows of 64 bf16 read (not the 1000-row table), 16 B of indices, 4 x 64 bf16 written.
    self.assertEqual((embed.kind, embed.op, embed.layer), ("fusion", "kLoop", "-"))
    self.assertEqual(embed.bytes, 4 * 64 * 2 + 16 + 4 * 64 * 2)

  def test_an_in_place_scatter_counts_its_updates(self):
    write = self.launches["write"]
    # The pool is neither read nor written whole: 8 B of rows, 64 B of updates in, 64 out.
    self.assertEqual(write.bytes, 8 + 64 + 64)
    self.assertEqual(write.layer, "layer_0")

  def test_dots_and_library_gemms_count_their_flops(self):
    for name in ("proj", "gemm"):
      self.assertEqual(self.launches[name].flops, 2 * 4 * 32 * 16, name)
    self.assertEqual(self.launches["proj"].bytes, 4 * 16 * 2 + 16 * 32 * 2 + 4 * 32 * 4)
    self.assertEqual(self.launches["gemm"].kind, "gemm")

  def test_collectives_keep_their_payload(self):
    ar, ag = self.launches["ar-start"], self.launches["ag-start"]
    self.assertEqual((ar.kind, ar.op, ar.bytes), ("collective", "all-reduce", 64 * 4))
    self.assertEqual((ag.kind, ag.op, ag.bytes), ("collective", "all-gather", 64 * 4))

  def test_a_loop_body_runs_its_trip_count(self):
    body = self.launches["loop_add"]
    self.assertEqual((body.count, body.bytes), (5, 2 * 64 * 4))

  def test_a_pallas_call_keeps_its_types(self):
    k = self.launches["kernel"]
    self.assertEqual((k.kind, k.op, k.layer), ("pallas", "my_kernel", "layer_1"))
    self.assertEqual(k.operands, ("bf16[4,64]{1,0}", "bf16[4,16]{1,0}"))
    self.assertEqual(k.results, ("bf16[4,64]",))

  def test_text_without_an_entry_is_refused(self):
    with self.assertRaisesRegex(ValueError, "no ENTRY"):
      program.launches("HloModule m\n")


def _launch(name="f", kind="fusion", op="kLoop", layer="-", nbytes=0, flops=0, operands=(),
            results=(), count=1):
  return program.Launch(name, kind, op, layer, nbytes, flops, tuple(operands), tuple(results),
                        count)


DATA = st.StepData(KIMI_K2_6, rows=8, tokens=8, context=1000.0)


class StepTimeTest(absltest.TestCase):

  def test_memory_compute_and_collective_times(self):
    eff = st.Efficiency(launch_gap_s=3e-6)
    t, kind, _, _ = st.launch_time(_launch(nbytes=10**9), DATA, eff)
    self.assertEqual(kind, "fusion")
    self.assertAlmostEqual(t, 1e9 / (4.3 / 4.8 * H200.hbm_bandwidth) + 3e-6, delta=1e-12)
    t, kind, _, _ = st.launch_time(_launch(nbytes=1000, flops=10**12, operands=("bf16[4]",)),
                                   DATA, eff)
    self.assertEqual(kind, "gemm")
    self.assertAlmostEqual(t, 1e12 / (790 / 989 * H200.bf16_flops) + 3e-6, delta=1e-12)
    t, _, _, _ = st.launch_time(_launch(nbytes=1000, flops=10**12, operands=("f8e4m3fn[4]",)),
                                DATA, eff)
    self.assertAlmostEqual(t, 1e12 / (1550 / 1979 * H200.fp8_flops) + 3e-6, delta=1e-12)
    t, kind, _, _ = st.launch_time(_launch(kind="collective", op="all-reduce", nbytes=10**6),
                                   DATA, eff)
    # No launch gap: the alpha covers it.
    self.assertEqual(kind, "collective")
    self.assertAlmostEqual(t, 10e-6 + 10**6 * 2 * 7 / 8 / (0.8 * 450e9), delta=1e-12)

  def test_mla_attention_reads_the_context_not_the_pool(self):
    ops = ("bf16[8,16,512]", "bf16[8,16,64]", "bf16[5000,64,512]", "bf16[5000,64,64]",
           "s32[8,32]", "s32[8]")
    ln = _launch(kind="pallas", op="paged_mla_decode_tokens_mgpu", operands=ops,
                 nbytes=5000 * 64 * 576 * 2)
    nbytes, flops, kind = st.pallas_cost(ln, DATA)
    want = attn_bench.job_cost("paged_mla_decode", {"batch": 8, "heads": 16, "c": 512, "r": 64,
                                                    "kv": "bf16", "context": 1000,
                                                    "max_pages": 32})
    self.assertEqual((nbytes, flops, kind), (*map(float, want), "attention"))
    fp8 = ("bf16[8,16,512]", "bf16[8,16,64]", "f8e4m3fn[5000,64,512]", "f8e4m3fn[5000,64,64]",
           "f32[5000,64]", "f32[5000,64]", "s32[8,32]", "s32[8]")
    nbytes8, _, _ = st.pallas_cost(_launch(kind="pallas", op="paged_mla_decode_tokens_mgpu",
                                           operands=fp8), DATA)
    self.assertLess(nbytes8, 0.6 * nbytes)

  def test_the_page_write_moves_its_rows_not_the_pools(self):
    # As the engine calls it: page and slot, the latent and rope rows, then the fp8 pools
    # (flattened) and their scales, aliased to its results.
    ops = ("s32[64]", "s32[64]", "bf16[64,512]", "bf16[64,64]", "f8e4m3fn[1048576,512]",
           "f8e4m3fn[1048576,64]", "f32[1048576]", "f32[1048576]")
    ln = _launch(kind="pallas", op="page_write", operands=ops, results=ops[4:],
                 nbytes=2 * 1048576 * (576 + 8))
    nbytes, flops, kind = st.pallas_cost(ln, DATA)
    read = 2 * 64 * 4 + 64 * 576 * 2
    self.assertEqual((nbytes, flops, kind), (float(read + 64 * (512 + 4) + 64 * (64 + 4)),
                                              0.0, "fusion"))

  def test_grouped_int4_reads_the_experts_the_batch_picks(self):
    local = KIMI_K2_6.n_routed_experts // 8
    # As the engine's kernel is called: its schedule, the activations in two halves of K,
    # the packed weights [E, K/2, N] and their group scales.
    ops = ("s32[5,82]", "bf16[64,3584]", "bf16[64,3584]", f"u8[{local},3584,2048]",
           f"bf16[{local},224,2048]")
    ln = _launch(kind="pallas", op="int4_grouped_matmul", operands=ops,
                 results=("bf16[64,2048]",))
    nbytes, flops, kind = st.pallas_cost(ln, DATA)
    weights = local * 3584 * 2048 + local * 224 * 2048 * 2
    frac = 1 - (1 - 8 / 384) ** 8
    rest = 5 * 82 * 4 + 64 * 7168 * 2 + 64 * 2048 * 2
    self.assertEqual(kind, "int4")
    self.assertAlmostEqual(nbytes, weights * frac + rest, delta=1)
    self.assertAlmostEqual(flops, 2 * (8 * 8 / 8) * 7168 * 2048)

  def test_grouped_fp8_reads_the_experts_the_batch_picks_at_its_own_anchor(self):
    local = GLM_5_2.n_routed_experts // 8
    data = st.StepData(GLM_5_2, rows=8, tokens=8, context=1000.0)
    # As the engine's kernel is called: its schedule, the activations padded by a tile,
    # the fp8 values [E, K, N] and a scale per 128 x 128 block.
    ops = ("s32[5,70]", "bf16[72,6144]", f"f8e4m3fn[{local},6144,2048]",
           f"f32[{local},48,16]")
    ln = _launch(kind="pallas", op="fp8_grouped_matmul", operands=ops,
                 results=("bf16[64,2048]",))
    nbytes, flops, kind = st.pallas_cost(ln, data)
    weights = local * 6144 * 2048 + local * 48 * 16 * 4
    frac = 1 - (1 - 8 / 256) ** 8
    rest = 5 * 70 * 4 + 72 * 6144 * 2 + 64 * 2048 * 2
    self.assertEqual(kind, "fp8_grouped")
    self.assertAlmostEqual(nbytes, weights * frac + rest, delta=1)
    self.assertAlmostEqual(flops, 2 * (8 * 8 / 8) * 6144 * 2048)
    eff = st.Efficiency(launch_gap_s=0.0)
    t, _, _, _ = st.launch_time(ln, data, eff)
    self.assertAlmostEqual(t, nbytes / (2064 / 3350 * H200.hbm_bandwidth), delta=1e-12)

  def test_the_moe_layer_runs_once_per_moe_layer_and_loops_their_trip_count(self):
    prog = [_launch("a", nbytes=10**6), _launch("b", layer="layer_1", nbytes=2 * 10**6),
            _launch("c", layer="layer_1", kind="collective", op="all-gather", nbytes=800),
            _launch("d", nbytes=10**5, count=7)]
    eff = st.Efficiency(launch_gap_s=1e-6)
    r = st.step_time(prog, DATA, eff, moe_layer="layer_1", moe_layers=60)
    self.assertEqual(r["launches"], 1 + 60 + 60 + 7)
    self.assertEqual(r["kernel_launches"], 1 + 60 + 7)
    self.assertEqual(r["layer_launches"], 2)
    t = {ln.name: st.launch_time(ln, DATA, eff)[0] for ln in prog}
    self.assertAlmostEqual(r["seconds"], t["a"] + 60 * (t["b"] + t["c"]) + 7 * t["d"], delta=1e-12)
    self.assertAlmostEqual(r["moe_layer"]["fusion"]["seconds"], t["b"], delta=1e-12)
    self.assertEqual(r["by_kind"]["collective"]["launches"], 60)

  def test_the_launch_gap_is_fitted_back(self):
    progs = {c: [_launch(nbytes=c * 10**7)] * 300 for c in (1, 8, 32)}
    data = {c: st.StepData(KIMI_K2_6, c, c, 1000.0) for c in progs}
    truth = st.Efficiency(launch_gap_s=4e-6)
    reported = {c: c / st.step_time(progs[c], data[c], truth)["seconds"] for c in progs}
    points = [(progs[c], data[c], {}) for c in progs]
    gap = st.calibrate_gap(points, reported, st.Efficiency())
    self.assertAlmostEqual(gap, 4e-6, delta=1e-9)
    with self.assertRaisesRegex(ValueError, "no reported point"):
      st.calibrate_gap([], reported, st.Efficiency())

  def test_gpu_check_measurements_replace_the_anchors(self):
    case = lambda name, kernel, nbytes, flops, t, status="ok", **dims: {  # noqa: E731
        "type": "case", "name": name, "kernel": kernel, "dims": dims, "status": status,
        "bytes": nbytes, "flops": flops, "time_s": t}
    cases = [case("ceiling/copy", "ceiling", 4.0e9, 0, 1e-3),
             case("ceiling/matmul_bf16", "ceiling", 0, 6e11, 1e-3),
             case("mla/tp8/bf16/b8", "paged_mla_decode", 3e9, 0, 1e-3, kv="bf16"),
             case("mla/tp8/bf16/b64", "paged_mla_decode", 4e9, 0, 1e-3, kv="bf16"),
             case("mla/tp8/bf16/b1", "paged_mla_decode", 5e9, 0, 1e-3, kv="bf16"),
             case("mla/tp8/fp8/b8", "paged_mla_decode", 1e9, 0, 1e-3, kv="fp8"),
             case("int4g/kimi/up/r8", "int4_grouped_matmul", 1.2e9, 0, 1e-3),
             case("int4g/kimi/up/prefill", "int4_grouped_matmul", 9e9, 0, 1e-3),
             case("int4g/glm/up/r8", "int4_grouped_matmul", 9e9, 0, 1e-3, status="timeout")]
    eff = st.Efficiency.from_gpu_check(cases)
    bw = H200.hbm_bandwidth
    self.assertAlmostEqual(eff.fusion_bw, 4e12 / bw)
    self.assertAlmostEqual(eff.bf16_gemm_flops, 6e14 / H200.bf16_flops)
    self.assertAlmostEqual(eff.attention_bw, 4e12 / bw)  # the median of three
    self.assertAlmostEqual(eff.attention_fp8_bw, 1e12 / bw)
    # Decode rows only, and only cases that ran.
    self.assertAlmostEqual(eff.int4_bw, 1.2e12 / bw)
    self.assertEqual(eff.measured, ("attention_bw", "attention_fp8_bw", "bf16_gemm_flops",
                                    "fusion_bw", "int4_bw"))
    # Unmeasured kinds keep their anchors.
    self.assertEqual((eff.fp8_gemm_flops, eff.sparse_bw), (st.Efficiency().fp8_gemm_flops,
                                                           st.Efficiency().sparse_bw))
    self.assertEqual(st.Efficiency.from_gpu_check([]), st.Efficiency())

  def test_the_committed_gpu_check_runs_are_read(self):
    from mlkit.plan import step_programs
    eff = step_programs.measured_efficiency()
    self.assertIsNotNone(eff)
    self.assertIn("attention_fp8_bw", eff.measured)
    self.assertTrue(all(0 < getattr(eff, f) < 1.2 for f in eff.measured))
    self.assertIsNone(step_programs.measured_efficiency(os.path.dirname(__file__)))

  def test_the_sweeps_compile_every_column_once(self):
    from mlkit.plan import step_programs
    jobs = step_programs.jobs_for(False, kimi_fp8_peak=82)
    keys = [j.key for j in jobs]
    self.assertLen(set(keys), len(keys))
    self.assertLen(jobs, 23)  # Kimi 2 x 5 + its fp8 peak, GLM 2 x (5 decode + 1 prefill)
    self.assertEqual(jobs[10].key, "kimi-k2.6 int4 experts | float8_e4m3fn | decode | 82")
    self.assertLen(step_programs.jobs_for(False, kimi_fp8_peak=64), 22)
    self.assertEqual([j.rows for j in step_programs.jobs_for(True)], [1, 64])

  def test_predict_fits_one_column_and_judges_the_others(self):
    prog = [_launch(nbytes=10**8)] * 100
    entries = []
    for c in (1, 8):
      data, kw = st.job_data(KIMI_K2_6, "decode", c, 1, 1000.0)
      entries.append({"key": f"k{c}", "program": prog, "data": data, "kw": {}, "column": "fit",
                      "report": None, "calibrate": True})
    truth = st.Efficiency(launch_gap_s=2.5e-6)
    reported = {e["data"].rows: e["data"].rows / st.step_time(prog, e["data"], truth)["seconds"]
                for e in entries}
    for e in entries:
      e["report"] = reported[e["data"].rows]
    other, _ = st.job_data(KIMI_K2_6, "prefill", 2, 1024, 0.0)
    self.assertEqual((other.rows, other.tokens, other.context), (2, 2048, 512.0))
    entries.append({"key": "p", "program": prog, "data": other, "kw": {}, "column": "other",
                    "report": 1.0, "calibrate": False})
    out = st.predict(entries, reported)
    self.assertTrue(out["fitted"])
    self.assertAlmostEqual(out["launch_gap_s"], 2.5e-6, delta=1e-9)
    rows = {r["key"]: r for r in out["rows"]}
    self.assertTrue(rows["k1"]["within_25"])
    self.assertAlmostEqual(rows["k8"]["ratio"], 1.0, places=4)
    self.assertFalse(rows["p"]["within_25"])  # 1 tok/s reported: far off
    self.assertTrue(math.isfinite(rows["p"]["tok_s"]))


if __name__ == "__main__":
  absltest.main()


class CompiledForH200Test(absltest.TestCase):
  """Two pieces of the serving step compiled for 8 H200s (vocabulary split 8 ways), read
  with the launch reader: what the step-time model found, held."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from pallas_kernels.h200 import compile as hc
    cls.jax = jax
    cls.mesh = hc.mesh((8,), ("tensor",))
    cls.split = NamedSharding(cls.mesh, PartitionSpec(None, "tensor"))
    cls.rows_split = NamedSharding(cls.mesh, PartitionSpec("tensor", None))
    cls.whole = NamedSharding(cls.mesh, PartitionSpec())
    cls.spec = staticmethod(hc.spec)

  def _launches(self, fn, *args):
    from mlkit.plan.step_compile import COMPILE_OPTIONS
    with self.jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
      lowered = self.jax.jit(fn).trace(*args).lower()
    return program.launches(lowered.compile(COMPILE_OPTIONS).as_text())

  def test_top_p_prefix_sums_compile_without_a_loop(self):
    import jax.numpy as jnp
    from mlkit.sampling import filtered_logits
    logits = self.spec((64, 8 * 2048), jnp.float32, self.split)
    vec = lambda dtype: self.spec((64,), dtype, self.whole)  # noqa: E731
    args = (logits, vec(jnp.float32), vec(jnp.int32), vec(jnp.float32))
    looped = lambda ls: sum(ln.count for ln in ls if ln.count > 1)  # noqa: E731
    self.assertEqual(looped(self._launches(filtered_logits, *args)), 0)
    # What it replaced: jnp.cumsum over the split vocabulary is a sequential loop here.
    cumsum = self._launches(lambda x: jnp.cumsum(x, axis=-1), logits)
    self.assertGreater(looped(cumsum), 2000)

  def test_one_token_lookup_gathers_no_table(self):
    import jax.numpy as jnp
    from mlkit.model.transformer import embed_tokens
    table = self.spec((8 * 4096, 1024), jnp.bfloat16, self.rows_split)
    for rows in (1, 8):
      tokens = self.spec((rows, 1), jnp.int32, self.whole)
      launches = self._launches(embed_tokens, table, tokens)
      gathers = [ln for ln in launches if ln.kind == "collective" and ln.op == "all-gather"]
      self.assertEqual(gathers, [], rows)
    # What it replaced: a one-token jnp.take all-gathers the whole table.
    launches = self._launches(lambda t, x: jnp.take(t, x, axis=0), table,
                              self.spec((1, 1), jnp.int32, self.whole))
    gathered = sum(ln.bytes for ln in launches if ln.kind == "collective" and ln.op == "all-gather")
    self.assertEqual(gathered, 8 * 4096 * 1024 * 2)
