"""Reading launches from compiled HLO text (pallas_kernels.h200.program).

The reader is checked on a hand-written scheduled HLO module, so every rule (slices,
in-place updates, dots, library GEMMs, loops, async collectives, Pallas calls) has a
known answer; then on two pieces of the serving step compiled for 8 H200s."""

from absl.testing import absltest

from pallas_kernels.h200 import program

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
