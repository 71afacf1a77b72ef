"""The launches of one device's compiled GPU program, and the bytes and FLOPs of each.

``compiled.as_text()`` of a partitioned GPU program (``compile.compile_for_h200`` or
any GPU compile) is scheduled HLO: the entry computation lists, in order, every
kernel the device runs. This module reads it into :class:`Launch` records, which
``mlkit.plan.step_time`` turns into a step time (docs/step_time.md):

* an XLA **fusion** is one kernel. Its FLOPs are those of the dots it holds
  (``2 x result elements x contracted size``); its bytes are what it reads and
  writes, counted as XLA's cost analysis counts a fusion's operands: a parameter
  that is only sliced, dynamically sliced or gathered counts the slices' bytes
  (an embedding table, a KV pool), one that a dynamic-update-slice or scatter
  updates in place counts nothing to read and its update to write;
* a **library GEMM** (cuBLAS custom call) is one kernel with its dot's FLOPs;
* a **Pallas kernel** (Mosaic GPU or Triton custom call) keeps its operand and
  result types: what it reads depends on the data (context lengths, the experts a
  batch picks), which the step-time model supplies;
* a **collective** (all-reduce, all-gather, all-to-all, reduce-scatter,
  collective-permute; XLA also wraps small all-reduces in an async fusion) keeps
  its payload bytes;
* a **while loop** with a known trip count runs its body's launches that many
  times (``count``): a loop in a serving step is a launch storm, and this is
  where it shows.

Parameters, constants, tuples, bitcasts and the ``-done`` halves of async pairs
launch nothing. The reader uses text only (no jax), as ``step_placement`` does.
"""

from __future__ import annotations

import dataclasses
import math
import re

from pallas_kernels.h200.step_placement import (KERNEL_TARGETS, arrays, async_results,
                                                kernel_origin, type_bytes)

# Collective opcodes (and their async "-start" forms).
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute",
               "ragged-all-to-all")
# Instructions that launch nothing.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
         "replica-id", "after-all", "optimization-barrier", "add-dependency", "opt-barrier"}
# Ops that read only part of operand 0, and ops that update operand 0 in place.
_SLICING = ("slice", "dynamic-slice", "gather")
_IN_PLACE = ("dynamic-update-slice", "scatter")

_HEADER_RE = re.compile(r"^(ENTRY )?%(\S+) \(.*\) -> .* \{$")
_INSTR_RE = re.compile(r"^\s*(ROOT )?%(\S+) = ([\w\[\]{}(),:* ]+?) ([a-z][a-z0-9-]*)\(([^)]*)\)(.*)$")
_OPERAND_RE = re.compile(r"%([\w.\-]+)")
_CALLS_RE = re.compile(r"\bcalls=%([\w.\-]+)")
_BODY_RE = re.compile(r"\bbody=%([\w.\-]+)")
_BRANCHES_RE = re.compile(r"\bbranch_computations=\{([^}]*)\}|\b(?:true|false)_computation=%([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_KIND_RE = re.compile(r"\bkind=(k\w+)")
_CONTRACT_RE = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_GEMM_CONTRACT_RE = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_LAYER_RE = re.compile(r"(?:^|/)layer_(\d+)(?:/|$)")


@dataclasses.dataclass(frozen=True)
class Launch:
  """One kernel (or collective) the device runs.

  Attributes:
    name: the HLO instruction.
    kind: "fusion", "gemm" (a library GEMM), "pallas", "collective" or "other" (a
      standalone XLA op: copy, sort, transpose, ...).
    op: the fusion's kind (kLoop, kInput, kCustom, ...), the Pallas kernel's name, the
      collective's opcode, or the opcode.
    layer: the model layer from the op name ("layer_3"), or "-" outside the layers.
    bytes: bytes it reads and writes (for a Pallas kernel: every operand and result,
      which the step-time model replaces by what the data makes it read).
    flops: FLOPs of its dots (0 for a Pallas kernel: the model supplies them).
    operands / results: per-device array types, e.g. ``bf16[64,8,512]``.
    count: times it runs per execution of the program (a loop body's trip count).
  """

  name: str
  kind: str
  op: str
  layer: str
  bytes: int
  flops: int
  operands: tuple[str, ...] = ()
  results: tuple[str, ...] = ()
  count: int = 1


@dataclasses.dataclass
class _Instr:
  name: str
  type: str
  opcode: str
  operands: list[str]
  rest: str
  line: str
  root: bool


def _computations(hlo: str) -> tuple[dict[str, list[_Instr]], str]:
  """{computation name: instructions in order}, and the entry computation's name."""
  comps: dict[str, list[_Instr]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    h = _HEADER_RE.match(line)
    if h:
      current = h.group(2)
      comps[current] = []
      if h.group(1):
        entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    if current is None:
      continue
    m = _INSTR_RE.match(line)
    if m:
      comps[current].append(_Instr(m.group(2), m.group(3), m.group(4),
                                   _OPERAND_RE.findall(m.group(5)), m.group(6), line,
                                   bool(m.group(1))))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text (pass compiled.as_text())")
  return comps, entry


def _layer(line: str) -> str:
  m = _OP_NAME_RE.search(line)
  lm = _LAYER_RE.search(m.group(1)) if m else None
  return f"layer_{lm.group(1)}" if lm else "-"


def _dot_flops(instr: _Instr, types: dict[str, str], contract_re=_CONTRACT_RE) -> int:
  """2 x result elements x contracted size of a dot (its lhs's contracting dims)."""
  m = contract_re.search(instr.rest)
  lhs_shape = arrays(types[instr.operands[0]])[0][1]
  dims = [int(d.strip().strip('"')) for d in m.group(1).split(",") if d.strip()] if m else []
  contracted = math.prod(lhs_shape[d] for d in dims) if dims else 1
  out = sum(math.prod(shape) for _, shape in arrays(instr.type)[:1])
  return 2 * out * contracted


class _Fused:
  """Bytes and FLOPs of one fused computation, by XLA's operand-utilisation rules."""

  def __init__(self, comps: dict[str, list[_Instr]], name: str):
    self.body = comps[name]
    self.types = {i.name: i.type for i in self.body}
    self.users: dict[str, list[_Instr]] = {}
    for i in self.body:
      for o in i.operands:
        self.users.setdefault(o, []).append(i)
    self.params = {int(re.search(r"parameter\((\d+)\)", i.line).group(1)): i.name
                   for i in self.body if i.opcode == "parameter"}
    self.flops = sum(_dot_flops(i, self.types) for i in self.body if i.opcode == "dot")
    self.comps = comps

  def read_bytes(self, index: int, full: int) -> int:
    """Bytes the fusion reads of parameter ``index`` (``full``: the whole operand)."""
    name = self.params.get(index)
    return full if name is None else min(full, self._used(name, full))

  def _used(self, name: str, full: int) -> int:
    total = 0
    for u in self.users.get(name, []):
      first = u.operands and u.operands[0] == name
      if u.opcode in _SLICING and first:
        total += type_bytes(u.type)
      elif u.opcode in _IN_PLACE and first:
        continue  # updated in place: nothing to read
      elif u.opcode in ("bitcast", "reshape"):
        total += self._used(u.name, full)
      else:
        return full
    return total

  def write_bytes(self, result_type: str) -> int:
    """Bytes the fusion writes: its result, or only the updates of in-place roots."""
    root = next((i for i in self.body if i.root), None)
    roots = [root] if root is not None else []
    if root is not None and root.opcode == "tuple":
      roots = [next(i for i in self.body if i.name == o) for o in root.operands
               if any(i.name == o for i in self.body)]
    total = 0
    for r in roots:
      while r.opcode == "bitcast" and r.operands:
        r = next(i for i in self.body if i.name == r.operands[0])
      if r.opcode == "dynamic-update-slice":
        total += type_bytes(self.types[r.operands[1]])
      elif r.opcode == "scatter":
        total += type_bytes(self.types[r.operands[-1]])
      else:
        total += type_bytes(r.type)
    return total if roots else type_bytes(result_type)

  def collective(self) -> str | None:
    """The collective this fused computation wraps (XLA's async all-reduce fusions), if any."""
    for i in self.body:
      op = i.opcode.removesuffix("-start")
      if op in COLLECTIVES:
        return op
      for callee in _CALLS_RE.findall(i.rest):
        if callee in self.comps:
          inner = _Fused(self.comps, callee).collective()
          if inner:
            return inner
    return None


def _payload(instr: _Instr) -> int:
  """A collective's result bytes (an async start's tuple holds operands, then results)."""
  start = instr.opcode.endswith("-start") and len(arrays(instr.type)) > 1
  return type_bytes(async_results(instr.type) if start else instr.type)


def launches(hlo: str) -> list[Launch]:
  """Every launch of the program's entry computation, in program order.

  Args:
    hlo: ``compiled.as_text()`` of a (partitioned) GPU program.

  Returns:
    :class:`Launch` records; a loop body's launches once each, with ``count`` its trip
    count (1 where the count is not known at compile time).

  Raises:
    ValueError: the text has no entry computation.
  """
  comps, entry = _computations(hlo)
  out: list[Launch] = []
  _walk(comps, entry, 1, out)
  return out


def _walk(comps: dict[str, list[_Instr]], comp: str, count: int, out: list[Launch]) -> None:
  body = comps[comp]
  types = {i.name: i.type for i in body}
  for i in body:
    op = i.opcode
    if op in _FREE or op.endswith("-done") or op == "copy-done":
      continue
    layer = _layer(i.line)
    operand_types = tuple(types.get(o, "") for o in i.operands)
    if op == "while":
      trip = _TRIP_RE.search(i.rest)
      _walk(comps, _BODY_RE.search(i.rest).group(1), count * (int(trip.group(1)) if trip else 1),
            out)
      continue
    if op == "conditional":
      m = _BRANCHES_RE.findall(i.rest)
      names = [n.strip().lstrip("%") for a, b in m for n in (a.split(",") if a else [b]) if n.strip()]
      # One branch runs: count the one with the most bytes.
      best: list[Launch] = []
      for n in names:
        trial: list[Launch] = []
        _walk(comps, n, count, trial)
        if sum(x.bytes for x in trial) >= sum(x.bytes for x in best):
          best = trial
      out.extend(best)
      continue
    if op == "call":
      _walk(comps, _CALLS_RE.search(i.rest).group(1) if _CALLS_RE.search(i.rest)
            else re.search(r"to_apply=%([\w.\-]+)", i.rest).group(1), count, out)
      continue
    if op in ("fusion", "fusion-start"):
      fused = _Fused(comps, _CALLS_RE.search(i.rest).group(1))
      coll = fused.collective()
      if coll:
        out.append(Launch(i.name, "collective", coll, layer, _payload(i), 0, operand_types,
                          (i.type,), count))
        continue
      read = sum(fused.read_bytes(k, type_bytes(t)) for k, t in enumerate(operand_types))
      kind = _KIND_RE.search(i.rest)
      out.append(Launch(i.name, "fusion", kind.group(1) if kind else "kLoop", layer,
                        read + fused.write_bytes(i.type), fused.flops, operand_types, (i.type,),
                        count))
      continue
    base = op.removesuffix("-start")
    if base in COLLECTIVES:
      out.append(Launch(i.name, "collective", base, layer, _payload(i), 0, operand_types,
                        (i.type,), count))
      continue
    io = sum(type_bytes(t) for t in operand_types) + type_bytes(i.type)
    if op == "custom-call":
      target = _TARGET_RE.search(i.rest).group(1)
      if target in KERNEL_TARGETS:
        _, kname = kernel_origin(i.line)
        results = tuple(f"{t}[{','.join(map(str, s))}]" for t, s in arrays(i.type))
        out.append(Launch(i.name, "pallas", kname, layer, io, 0, operand_types, results, count))
      elif target.startswith("__cublas"):
        gemm_type = i.type
        if gemm_type.startswith("("):  # (result, workspace)
          first = arrays(gemm_type)[0]
          gemm_type = f"{first[0]}[{','.join(map(str, first[1]))}]"
        flops = _dot_flops(dataclasses.replace(i, type=gemm_type), types, _GEMM_CONTRACT_RE)
        out.append(Launch(i.name, "gemm", target, layer, io, flops, operand_types, (i.type,),
                          count))
      else:
        out.append(Launch(i.name, "other", target, layer, io, 0, operand_types, (i.type,), count))
      continue
    if op in _IN_PLACE:
      update = type_bytes(operand_types[1] if op == "dynamic-update-slice" else operand_types[-1])
      io = 2 * update
    elif op in _SLICING:
      io = 2 * type_bytes(i.type)
    out.append(Launch(i.name, "other", op, layer, io, 0, operand_types, (i.type,), count))
