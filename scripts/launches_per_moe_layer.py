"""Kernel launches one MoE layer adds to Kimi K2.6's decode step on 8x H200, by kind.

Compiles the decode step (fp8 KV unless ``--kv-dtype bfloat16``, the h200_compile experiment's quick plan: its
concurrency, pool and INT4 experts) with the dense prefix and 1, then 2 MoE layers, reads
every launch from XLA's thunk sequences (``pallas_kernels.h200.compile.launches_in_dump``)
and prints the difference by kind: XLA's fusions by their emitter's name (loop_*,
input_*, gemm_fusion_*, ...), sorts, and custom calls (the Pallas kernels); then by the
jax op each launch comes from (the optimised HLO's op names). Launch names
carry a per-program number, which is dropped. Runs on a CPU in under a minute.

  python scripts/launches_per_moe_layer.py [--kv-dtype bfloat16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels.h200 import env as h200_env  # noqa: E402

h200_env.prepare()  # before jax is imported

from mlkit.plan import launch_count as lc  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", help="also write {n_moe: [launch names]} here")
  p.add_argument("--kv-dtype", default="float8_e4m3fn", choices=lc.KV_DTYPES,
                 help="the KV pool's dtype (default: %(default)s)")
  args = p.parse_args(argv)
  found = lc.per_moe_layer(args.kv_dtype)
  print(f"decode step launches: {len(found.one)} (dense prefix + 1 MoE layer), "
        f"{len(found.two)} (+ 2 MoE layers): {found.per_layer} per MoE layer")
  for kind, n in sorted(found.by_kind().items(), key=lambda kv: (-kv[1], kv[0])):
    print(f"{n:4d}  {kind}")
  # The same difference by what each launch computes (its jax op), layer index dropped.
  print("\nper MoE layer, by the jax op each launch comes from:")
  for (kind, op), n in sorted(found.by_op().items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"{n:4d}  {kind:28s} {op}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"1": [n for n, _ in found.one], "2": [n for n, _ in found.two]}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
