"""Kernel launches one MoE layer adds to Kimi K2.6's decode step on 8x H200.

The decode step of the ``h200_compile`` quick plan (its concurrency, pool and INT4 experts)
is compiled for an 8x H200 topology from the CPU (``mlkit.plan.step_compile``) with the
dense prefix and 1, then 2 MoE layers; every launch is read from XLA's thunk sequences
(``pallas_kernels.h200.compile.launches_in_dump``) and the per-layer count is the
difference. Collectives are not launches of a thunk sequence here, and what a step runs
once (the embedding, the sampler, a device index) cancels out. docs/step_time.md,
"Launches per MoE layer", lists what the count is made of and why each launch is separate;
``scripts/launches_per_moe_layer.py`` prints the difference by kind and by jax op, and
``tests/test_launches_per_moe_layer.py`` holds the count.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile

from mlkit.plan import step_compile as sc
from pallas_kernels.h200 import compile as hc

KV_DTYPES = ("float8_e4m3fn", "bfloat16")

# An instruction of XLA's optimised HLO: its name, the computation it calls and the jax op
# it came from ('%fusion.12 = ... calls=%fused_computation.3, metadata={op_name="..."}').
_INSTR_RE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = [^\n]*", re.M)
_CALLS_RE = re.compile(r"calls=%([\w.\-]+)")
_OP_RE = re.compile(r'op_name="([^"]*)"')
_COMP_RE = re.compile(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", re.M | re.S)


def kind_of(name: str) -> str:
  """A launch's name without its per-program numbering ("loop_add_fusion_12" -> "loop_add_fusion")."""
  return re.sub(r"[._\d]+$", "", re.sub(r"(\.\d+)+", "", name)).rstrip("_")


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


def decode_launches(n_moe: int, kv_dtype: str = "float8_e4m3fn") -> list[tuple[str, str]]:
  """[(launch name, jax op name)] of Kimi K2.6's decode step with the dense prefix and
  ``n_moe`` MoE layers, in the order the GPU runs them (one compile, about 15 CPU-s).

  Raises:
    ValueError: on a KV dtype the plan does not sweep, or n_moe < 1.
  """
  if kv_dtype not in KV_DTYPES:
    raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
  plan = dataclasses.replace(sc.plan_for(quick=True, smoke=False), moe_depths=(n_moe,),
                             kinds=("decode",), kv_dtypes=(kv_dtype,), variants=(sc.KIMI,))
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


@dataclasses.dataclass(frozen=True)
class LayerLaunches:
  """The launches of the decode step with 1 and with 2 MoE layers, and their difference."""
  one: tuple[tuple[str, str], ...]  # (launch name, jax op name), dense prefix + 1 MoE layer
  two: tuple[tuple[str, str], ...]  # the same with 2 MoE layers

  @property
  def per_layer(self) -> int:
    """Launches one MoE layer adds."""
    return len(self.two) - len(self.one)

  def by_kind(self) -> collections.Counter:
    """{launch kind (fusion emitter, kernel name): launches one MoE layer adds}."""
    out = collections.Counter(kind_of(n) for n, _ in self.two)
    out.subtract(collections.Counter(kind_of(n) for n, _ in self.one))
    return +out

  def by_op(self) -> collections.Counter:
    """{(launch kind, what it computes): launches one MoE layer adds}."""
    out = collections.Counter((kind_of(n), what(op)) for n, op in self.two)
    out.subtract(collections.Counter((kind_of(n), what(op)) for n, op in self.one))
    return +out


def per_moe_layer(kv_dtype: str = "float8_e4m3fn") -> LayerLaunches:
  """Compiles the decode step at 1 and 2 MoE layers (two compiles, about 30 CPU-s)."""
  return LayerLaunches(tuple(decode_launches(1, kv_dtype)), tuple(decode_launches(2, kv_dtype)))
