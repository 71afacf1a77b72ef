"""Registers of the Mosaic GPU merge (paged_attention/merge_pieces_mgpu.py) against
the loads one step issues, compiled for an H200 (ptxas, sm_90a; no GPU needed, about
15 s on two cores): the reading behind ``merge_pieces_mgpu.MAX_LOADS``.

Each (piece, row) a step loads brings its own scalar log-sum-exp, weight and [bd]
row, so registers follow kp x bh; the rows print as
``bh bd kp partial-dtype: registers, spilled bytes``.

    .venv/bin/python scripts/merge_mgpu_tiles.py
"""

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.h200 import env  # noqa: E402

env.prepare()  # before jax is imported: XLA's GPU compiler settings

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels.h200 import compile as hc  # noqa: E402
from pallas_kernels.paged_attention import merge_pieces as mp  # noqa: E402
from pallas_kernels.paged_attention import merge_pieces_mgpu as mm  # noqa: E402

# (row tile, column tile, pieces per step, partials' dtype): one request of 132
# pieces of [64, 512], as at 64 heads, batch 1.
TILES = ((1, 128, 64, jnp.bfloat16), (1, 128, 32, jnp.bfloat16), (1, 128, 16, jnp.bfloat16),
         (1, 128, 32, jnp.float32), (8, 512, 2, jnp.bfloat16), (4, 512, 4, jnp.bfloat16),
         (8, 128, 8, jnp.float32), (8, 128, 4, jnp.float32))


def registers(bh: int, bd: int, kp: int, dtype) -> tuple[int, int]:
  """(registers, spilled bytes) of the merge kernel at these tiles."""
  def fn(o, lse, req):
    ranges = mp.request_ranges(req, 1)
    kernel = functools.partial(mm.merge_kernel, bh=bh, bd=bd, kp=kp,
                               row_blocks=64 // bh, pdl=True)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((1, 1, 64, 512), jnp.bfloat16),
                        grid=(1, 64 // bh, 512 // bd), grid_names=("b", "j", "c"),
                        kernel_name="merge_tiles")(ranges, o, lse)
  rep = hc.compile_for_h200(fn, hc.spec((132, 1, 64, 512), dtype),
                            hc.spec((132, 1, 64), jnp.float32), hc.spec((132,), jnp.int32))
  st = rep.kernels["merge_tiles_mosaic_gpu_kernel"]
  return st.registers, st.spills


def main() -> int:
  for bh, bd, kp, dtype in TILES:
    regs, spills = registers(bh, bd, kp, dtype)
    print(f"{bh} {bd} {kp} {jnp.dtype(dtype).name}: {regs} registers, {spills} B spilled",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
