"""The block-size tables read the target device kind from an active GPU abstract mesh.

An engine step compiled for an H200 topology from this CPU host traces on the CPU
backend; the tables must still pick their H200 rows there.
"""

from absl.testing import absltest
import jax
from jax._src import mesh as mesh_lib

from pallas_kernels import device
from pallas_kernels.int4_matmul import BlockSizes as Int4BlockSizes
from pallas_kernels.paged_attention import BlockSizes as AttnBlockSizes
from pallas_kernels.paged_attention import block_sizes as attn_block_sizes

H200 = "NVIDIA H200"


def _abstract_mesh(kind: str, platform: str) -> mesh_lib.AbstractMesh:
  return mesh_lib.AbstractMesh(
      (1,), ("x",), abstract_device=mesh_lib.AbstractDevice(kind, 132, platform))


class DeviceKindTest(absltest.TestCase):

  def test_gpu_abstract_mesh_wins_over_local_devices(self):
    local = jax.devices()[0].device_kind
    self.assertEqual(device.device_kind(), local)
    with jax.sharding.use_abstract_mesh(_abstract_mesh(H200, "cuda")):
      self.assertEqual(device.device_kind(), H200)
    self.assertEqual(device.device_kind(), local)

  def test_cpu_abstract_mesh_is_ignored(self):
    with jax.sharding.use_abstract_mesh(jax.make_mesh((1,), ("x",)).abstract_mesh):
      self.assertEqual(device.device_kind(), jax.devices()[0].device_kind)

  def test_int4_table_uses_mesh_kind(self):
    m, n, k = 8, 2048, 7168
    h200 = Int4BlockSizes.get_default(m, n, k, device_kind=H200)
    self.assertNotEqual(h200, Int4BlockSizes.get_default(m, n, k, device_kind="cpu"))
    with jax.sharding.use_abstract_mesh(_abstract_mesh(H200, "cuda")):
      self.assertEqual(Int4BlockSizes.get_default(m, n, k), h200)
      # An explicit kind still wins.
      self.assertNotEqual(Int4BlockSizes.get_default(m, n, k, device_kind="cpu"), h200)

  def test_attention_table_uses_mesh_kind(self):
    # The H200 and default rows agree today, so a row of a made-up kind shows the lookup.
    attn_block_sizes.TILES[("Test GPU", "mla")] = attn_block_sizes.Tiles(16, 2, 3)
    try:
      kw = dict(num_heads=64, page_size=64, max_pages=512, batch=8)
      ours = AttnBlockSizes.get_default("mla", **kw, device_kind="Test GPU")
      self.assertEqual((ours.block_h, ours.num_warps, ours.num_stages), (16, 2, 3))
      self.assertNotEqual(AttnBlockSizes.get_default("mla", **kw), ours)
      with jax.sharding.use_abstract_mesh(_abstract_mesh("Test GPU", "gpu")):
        self.assertEqual(AttnBlockSizes.get_default("mla", **kw), ours)
        self.assertNotEqual(AttnBlockSizes.get_default("mla", **kw, device_kind="cpu"), ours)
    finally:
      del attn_block_sizes.TILES[("Test GPU", "mla")]

  def test_h200_attention_rows(self):
    kw = dict(page_size=64, max_pages=512, batch=8, device_kind=H200)
    dp = AttnBlockSizes.get_default("mla", num_heads=64, **kw)
    tp8 = AttnBlockSizes.get_default("mla", num_heads=8, **kw)
    self.assertEqual((dp.block_h, dp.num_warps), (32, 8))  # 64 heads spill (see TILES)
    self.assertEqual((tp8.block_h, tp8.num_warps), (16, 8))
    self.assertEqual(tp8.num_splits, 64)  # the first power of two with 8 x splits >= 264 programs


if __name__ == "__main__":
  absltest.main()
