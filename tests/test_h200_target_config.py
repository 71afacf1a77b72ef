"""The H200 that deviceless compiles target: XLA must fuse for it as for a real H200.

XLA's fusion decisions come from its performance model, which prices each kernel's
memory traffic and arithmetic with the device's rates. A target config without them
(as pallas_kernels/h200/target_config.txtpb was until it carried them) leaves the
model a memory bandwidth of zero, and fusing never pays: broadcasts and
elementwise producers become kernels of their own whose outputs go through memory,
and every temporary and kernel count read from such a compile describes a program a
real H200 would not run (docs/h200_compile.md).
"""

import re

import jax.numpy as jnp
from absl.testing import absltest

from pallas_kernels.h200 import compile as hc


def _field(text: str, name: str) -> float | None:
  m = re.search(rf"^\s*{name}: ([0-9.e+]+)\s*$", text, re.M)
  return None if m is None else float(m.group(1))


class TargetConfigTest(absltest.TestCase):

  def test_carries_the_rates_of_the_performance_model(self):
    text = hc.TARGET_CONFIG.read_text()
    # The H200 SXM's datasheet memory bandwidth, its boost clock, the L2 of its
    # Hopper die and the FP32 units of one SM.
    self.assertEqual(_field(text, "memory_bandwidth"), 4.8e12)
    self.assertEqual(_field(text, "clock_rate_ghz"), 1.98)
    self.assertEqual(_field(text, "l2_cache_size"), 50 * 2**20)
    self.assertEqual(_field(text, "fpus_per_core"), 128)
    # The limits the kernel readings are checked against.
    self.assertEqual(_field(text, "shared_memory_per_block_optin"), hc.SMEM_LIMIT_BYTES)
    self.assertEqual(_field(text, "device_memory_size"), hc.DEVICE_MEMORY_BYTES)

  def test_an_elementwise_chain_compiles_to_one_kernel(self):
    # Scale rows, clip to e4m3's range, cast: what ops.fp8_query does to a query. On
    # an H200 XLA fuses it into one kernel. Without the model's rates it launched four:
    # the broadcast scale and both clip bounds were each written out as [64, 64, 512]
    # f32 arrays (8 MiB apiece) and read back by the fourth.
    def quantise(x, s):
      y = jnp.clip(x.astype(jnp.float32) * s[..., None], -448.0, 448.0)
      return y.astype(jnp.float8_e4m3fn)

    report = hc.compile_for_h200(quantise, hc.spec((64, 64, 512), jnp.bfloat16),
                                 hc.spec((64, 64), jnp.float32), ptxas_report=False)
    self.assertLen(report.launches, 1, report.launches)
    self.assertEqual(report.memory.get("temp"), 0, report.memory)

  def test_launches_are_read_from_the_thunk_sequence(self):
    dump = ("000: kCustomKernel [source | next=002 (1)] loop_select_fusion grid: [4, 1, 1] "
            "threads: [128, 1, 1]  shared_memory: 0 bytes\n"
            "001: kWaitForStreams [source | next=002 (1)] wait\n"
            "002: kCustomCall   [prev=000 (1)  | sink         ] kCustomCall\n"
            "003: kKernel [prev=002 (1) | sink] paged_attention grid: [132, 1, 1]\n")
    self.assertEqual(hc._launches(dump), ["loop_select_fusion", "kCustomCall", "paged_attention"])


if __name__ == "__main__":
  absltest.main()
