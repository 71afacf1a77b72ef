"""Registers the heads-in-M MLA decode kernel's compute warpgroups need beside a
producer warpgroup, read from ptxas for an H200 (no GPU needed).

With a producer (BlockSizes.loads = "producer"), the kernel launches 384 threads,
so ptxas reports the launch allocation (65,536 / 384, rounded down to 8: 168
registers) for every variant; the compute warpgroups raise theirs with setmaxnreg
to mla_mgpu.COMPUTE_REGS and the producer lowers its own to PRODUCER_REGS. What
the compute code needs therefore shows only as spills once that limit is too low.
This script compiles each variant (bf16 cache; fp8 cache with fp8 QK and with f16
QK) at 64 heads with the limit lowered step by step (the producer given the rest
of the CTA's 3 x 168 registers per lane, at most 256) and prints the spills at
each, so the smallest spill-free limit is each variant's need
(docs/paged_attention.md).

Usage: .venv/bin/python scripts/mla_producer_registers.py   (about a minute)
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels.h200 import env  # noqa: E402

env.prepare()  # before jax is imported: ptxas' report is read from XLA's log

import jax  # noqa: E402

from pallas_kernels.h200 import kernel_readings as kc  # noqa: E402
from pallas_kernels.paged_attention import mla_mgpu  # noqa: E402

LIMITS = (240, 232, 224, 216, 208, 200, 192, 184, 176)
CASES = ("mla/dp/bf16/b8/ctx32768", "mla/dp/fp8/b8/ctx32768")


def variants():
  """The engine's heads-in-M builds at 64 heads (bf16; fp8 with fp8 QK) and the
  fp8 cache's f16-QK twin, each with its producer warpgroup."""
  out = []
  for g in kc.target_groups(("paged_mla_decode",), other_impl=True, only=CASES):
    for b in g.builds:
      if (b.case.name in CASES and b.impl == "mgpu" and b.block_sizes.mla_m == "heads"
          and b.block_sizes.loads == "producer"):
        out.append(b)
  return sorted({b.variant + " " + b.case.d["kv"]: b for b in out}.items())


def spills_at(build, regs: int) -> int | None:
  """Spilled bytes per thread (stores + loads) of ``build`` compiled with its compute
  warpgroups limited to ``regs`` (the producer given the rest of the CTA's pool, at
  most 256); None if
  it does not compile. Restores the module's limits and clears jax's caches, whose
  traces would otherwise keep the first limit they saw."""
  saved = mla_mgpu.COMPUTE_REGS, mla_mgpu.PRODUCER_REGS
  mla_mgpu.COMPUTE_REGS = regs
  mla_mgpu.PRODUCER_REGS = min(256, 3 * mla_mgpu.LAUNCH_REGS - 2 * regs)
  jax.clear_caches()
  try:
    r = kc.compile_build(build)
  finally:
    mla_mgpu.COMPUTE_REGS, mla_mgpu.PRODUCER_REGS = saved
    jax.clear_caches()
  return None if r["error"] else r["spill_stores"] + r["spill_loads"]


def main():
  print("compute warpgroup limit -> spilled bytes per thread (stores + loads)")
  print("| variant | " + " | ".join(str(r) for r in LIMITS) + " |")
  print("|---|" + "---|" * len(LIMITS))
  for name, b in variants():
    cells = ["error" if (x := spills_at(b, regs)) is None else str(x) for regs in LIMITS]
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
