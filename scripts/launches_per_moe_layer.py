"""Kernel launches one MoE layer adds to Kimi K2.6's decode step on 8x H200, by kind.

Compiles the decode step (fp8 KV, the h200_compile experiment's quick plan: its
concurrency, pool and INT4 experts) with the dense prefix and 1, then 2 MoE layers, reads
every launch from XLA's thunk sequences (``pallas_kernels.h200.compile.launches_in_dump``)
and prints the difference by kind: XLA's fusions by their emitter's name (loop_*,
input_*, gemm_fusion_*, ...), sorts, and custom calls (the Pallas kernels). Launch names
carry a per-program number, which is dropped. Runs on a CPU in under a minute.

  python scripts/launches_per_moe_layer.py [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pallas_kernels.h200 import env as h200_env  # noqa: E402

h200_env.prepare()  # before jax is imported

from mlkit.plan import step_compile as sc  # noqa: E402
from pallas_kernels.h200 import compile as hc  # noqa: E402


def kind_of(name: str) -> str:
  """A launch's name without its per-program numbering ("loop_add_fusion_12" -> "loop_add_fusion")."""
  return re.sub(r"[._\d]+$", "", re.sub(r"(\.\d+)+", "", name)).rstrip("_")


def launches(n_moe: int) -> list[str]:
  plan = dataclasses.replace(sc.plan_for(quick=True, smoke=False), moe_depths=(n_moe,),
                             kinds=("decode",), kv_dtypes=("float8_e4m3fn",),
                             variants=(sc.KIMI,))
  mesh = sc.h200_mesh()
  _, jobs = sc.plan_jobs(plan, mesh)
  (job,) = jobs
  lowered, _ = sc.lower(*job, plan=plan, mesh=mesh)
  with tempfile.TemporaryDirectory(prefix="launches_") as dump:
    lowered.compile(dict(sc.COMPILE_OPTIONS, xla_dump_to=dump))
    return list(hc.launches_in_dump(dump))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", help="also write {n_moe: [launch names]} here")
  args = p.parse_args(argv)
  names = {n: launches(n) for n in (1, 2)}
  per_layer = collections.Counter(map(kind_of, names[2]))
  per_layer.subtract(collections.Counter(map(kind_of, names[1])))
  print(f"decode step launches: {len(names[1])} (dense prefix + 1 MoE layer), "
        f"{len(names[2])} (+ 2 MoE layers): {len(names[2]) - len(names[1])} per MoE layer")
  for kind, n in sorted(per_layer.items(), key=lambda kv: (-kv[1], kv[0])):
    if n:
      print(f"{n:4d}  {kind}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({str(k): v for k, v in names.items()}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
