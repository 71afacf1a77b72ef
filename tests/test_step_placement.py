"""Reading a compiled step's kernels and all-gathers (pallas_kernels.h200.step_placement).

The lines below are shortened copies of lines from a tiny model's decode step compiled for
8 H200s (the h200_compile experiment's smoke run, which tests the whole path).
"""

from absl.testing import absltest

from pallas_kernels.h200 import step_placement as sp

_MOSAIC = (
    '  %mpmd_map.12 = bf16[128,64]{1,0} custom-call(%loop_concatenate_fusion, %loop_pad_fusion.3),'
    ' custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[5,4]{1,0},'
    ' bf16[192,128]{1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={kernel_hash = "\\AC",'
    ' module = "ML\\EFR\\01MLIR24.0.0git\\00builtin\\00stable_mosaic_gpu\\00llvm.emit_c_interface'
    '\\00int4_grouped_matmul_nk_mosaic_gpu\\00or"}, metadata={op_name="jit(_step)/layer_1/shard_map/'
    'jit(int4_grouped_matmul_nk)/int4_grouped_matmul_nk/mpmd_map" source_file="k.py"}')
# Under custom partitioning the op_name keeps only the layer; the module names the kernel.
_PARTITIONED = (
    '  %custom-call.3 = f32[4,1536,64]{2,1,0} custom-call(%p.1, %p.2, %p.3),'
    ' custom_call_target="mosaic_gpu_v2", backend_config={module = "ML\\EFR\\00dump_basename'
    '\\00int4_matmul_nk_3\\00stable_mosaic_gpu.version\\00int4_matmul_nk_mosaic_gpu\\00"},'
    ' metadata={op_name="jit(_step)/layer_0/custom_partitioning"}')
_TRITON = (
    '  %pallas_call.29 = s32[64]{0} custom-call(%copy.65, %param.37), custom_call_target='
    '"__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 1 : i32, ir = "ML\\EFR",'
    ' name = "tag_check", num_stages = 3 : i32}, metadata={op_name="jit(_step)/tag_check/'
    'jit(tag_check)/tag_check/pallas_call"}')
_GATHER = ('  %all-gather.9 = f32[64,8]{0,1} all-gather(%bitcast.477.0), channel_id=20,'
           ' dimensions={1}, metadata={op_name="jit(_step)/jit(cumsum)/cumsum"}')
_GATHER_TUPLE = ('  %all-gather.10 = (s32[64,8]{0,1}, f32[64,8]{0,1}) all-gather(%a, %b),'
                 ' dimensions={1}')
# Async: the start's tuple is (operand, result); only the result is gathered data.
_GATHER_START = ('  %all-gather-start = (bf16[512,16]{1,0}, bf16[4096,16]{1,0}) all-gather-start('
                 '%param.4), dimensions={0}')
_OTHER = ('  %fusion.1 = bf16[64,7168]{1,0} fusion(%p), kind=kLoop, calls=%fused_computation,'
          ' metadata={op_name="all-gather(custom-call)"}')
_CUSTOM_OTHER = ('  %cublas = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(%a, %b),'
                 ' custom_call_target="__cublas$gemm"')


class StepPlacementTest(absltest.TestCase):

  def test_kernels_named_with_layer_and_per_gpu_result(self):
    got = sp.step_placement("\n".join([_TRITON, _MOSAIC, _PARTITIONED, _CUSTOM_OTHER, _OTHER]))
    self.assertEqual(got["kernels"], [
        {"layer": "-", "name": "tag_check", "target": "__gpu$xla.gpu.triton",
         "result": "s32[64]"},
        {"layer": "layer_1", "name": "int4_grouped_matmul_nk", "target": "mosaic_gpu_v2",
         "result": "bf16[128,64]"},
        {"layer": "layer_0", "name": "int4_matmul_nk", "target": "mosaic_gpu_v2",
         "result": "f32[4,1536,64]"},
    ])
    self.assertEqual((got["all_gathers"], got["all_gather_bytes"]), ([], 0))

  def test_all_gathers_and_their_bytes(self):
    got = sp.step_placement("\n".join([_GATHER, _GATHER_TUPLE, _GATHER_START, _OTHER]))
    self.assertEqual(got["all_gathers"], [
        {"result": "f32[64,8]", "bytes": 64 * 8 * 4},
        {"result": "(s32[64,8], f32[64,8])", "bytes": 2 * 64 * 8 * 4},
        {"result": "bf16[4096,16]", "bytes": 4096 * 16 * 2},
    ])
    self.assertEqual(got["all_gather_bytes"], 64 * 8 * 4 * 3 + 4096 * 16 * 2)

  def test_array_bytes(self):
    self.assertEqual(sp.array_bytes("s4[1,64,128]{2,1,0}"), 64 * 128 // 2)
    self.assertEqual(sp.array_bytes("(f8e4m3fn[10], u32[])"), 10 + 4)
    with self.assertRaisesRegex(ValueError, "unknown HLO element type 'q7'"):
      sp.array_bytes("q7[4]")
    with self.assertRaisesRegex(ValueError, "no array type"):
      sp.array_bytes("token")

  def test_kernel_rows_group_calls(self):
    kernels = [{"layer": f"layer_{i}", "name": "paged_mla_decode", "target": "t", "result": "r"}
               for i in (0, 1)] + [
                   {"layer": "layer_1", "name": "int4_matmul_nk", "target": "m", "result": "a"},
                   {"layer": "layer_1", "name": "int4_matmul_nk", "target": "m", "result": "a"},
                   {"layer": "layer_1", "name": "int4_matmul_nk", "target": "m", "result": "b"}]
    self.assertEqual(sp.kernel_rows(kernels), [
        ["paged_mla_decode", "t", "`r`", "layer_0, layer_1", 2],
        ["int4_matmul_nk", "m", "`a`", "layer_1", 2],
        ["int4_matmul_nk", "m", "`b`", "layer_1", 1]])


if __name__ == "__main__":
  absltest.main()
