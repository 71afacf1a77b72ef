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
import collections
import dataclasses
import glob
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


def launches(n_moe: int, kv_dtype: str = "float8_e4m3fn") -> list[tuple[str, str]]:
  plan = dataclasses.replace(sc.plan_for(quick=True, smoke=False), moe_depths=(n_moe,),
                             kinds=("decode",), kv_dtypes=(kv_dtype,),
                             variants=(sc.KIMI,))
  mesh = sc.h200_mesh()
  _, jobs = sc.plan_jobs(plan, mesh)
  (job,) = jobs
  lowered, _ = sc.lower(*job, plan=plan, mesh=mesh)
  with tempfile.TemporaryDirectory(prefix="launches_") as dump:
    lowered.compile(dict(sc.COMPILE_OPTIONS, xla_dump_to=dump))
    ops = {}
    for path in glob.glob(os.path.join(dump, "*gpu_after_optimizations.txt")):
      with open(path) as f:
        ops.update(op_names(f.read()))
    return [(name, ops.get(name, "")) for name in hc.launches_in_dump(dump)]


# An instruction of XLA's optimised HLO: its name, the computation it calls and the jax op
# it came from ('%fusion.12 = ... calls=%fused_computation.3, metadata={op_name="..."}').
_INSTR_RE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*", re.M)
_CALLS_RE = re.compile(r"calls=%([\w.\-]+)")
_OP_RE = re.compile(r'op_name="([^"]*)"')
_COMP_RE = re.compile(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", re.M | re.S)


def op_names(hlo: str) -> dict[str, str]:
  """{launch name (the thunk's: dots as underscores): jax op name} for the instructions of an
  optimised HLO module. A fusion without an op name of its own takes the first of the
  computation it calls, which XLA may share between layers: the layer it names is then
  not reliable, what it computes is."""
  comp_ops = {m.group(1): _OP_RE.findall(m.group(2)) for m in _COMP_RE.finditer(hlo)}
  out = {}
  for m in _INSTR_RE.finditer(hlo):
    op, calls = _OP_RE.search(m.group(0)), _CALLS_RE.search(m.group(0))
    if op:
      out[m.group(1).replace(".", "_")] = op.group(1)
    elif calls and comp_ops.get(calls.group(1)):
      out[m.group(1).replace(".", "_")] = comp_ops[calls.group(1)][0]
  return out


def what(op_name: str) -> str:
  """What a launch computes: its op name below the step and the layer (jax's ``jit(f)``
  wrappers shown as ``f``), or "?" for a launch XLA's HLO names no op for (the Pallas
  kernels' custom calls, copies)."""
  if not op_name:
    return "?"
  parts = [re.sub(r"^(?:jit|pjit)\((.*)\)$", r"\1", p) for p in op_name.split("/")]
  parts = [p for p in parts[1:] if not re.fullmatch(r"layer_\d+", p)]
  return "/".join(parts) or op_name


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", help="also write {n_moe: [launch names]} here")
  p.add_argument("--kv-dtype", default="float8_e4m3fn", choices=("float8_e4m3fn", "bfloat16"),
                 help="the KV pool's dtype (default: %(default)s)")
  args = p.parse_args(argv)
  found = {n: launches(n, args.kv_dtype) for n in (1, 2)}
  names = {n: [name for name, _ in v] for n, v in found.items()}
  per_layer = collections.Counter(map(kind_of, names[2]))
  per_layer.subtract(collections.Counter(map(kind_of, names[1])))
  print(f"decode step launches: {len(names[1])} (dense prefix + 1 MoE layer), "
        f"{len(names[2])} (+ 2 MoE layers): {len(names[2]) - len(names[1])} per MoE layer")
  for kind, n in sorted(per_layer.items(), key=lambda kv: (-kv[1], kv[0])):
    if n:
      print(f"{n:4d}  {kind}")
  # The same difference by what each launch computes (its jax op), layer index dropped.
  by_op = collections.Counter((kind_of(n), what(op)) for n, op in found[2])
  by_op.subtract(collections.Counter((kind_of(n), what(op)) for n, op in found[1]))
  print("\nper MoE layer, by the jax op each launch comes from:")
  for (kind, op), n in sorted(by_op.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    if n:
      print(f"{n:4d}  {kind:28s} {op}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({str(k): v for k, v in names.items()}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
