"""What one GPU runs in a compiled serving step: its Pallas kernels and XLA's all-gathers.

A Pallas kernel is one custom call, and XLA cannot split one: where a kernel's
operands are split over the mesh and the kernel has no partitioning rule, XLA
all-gathers them and every GPU runs the whole call. The step's compiled HLO (per
device, after partitioning) shows both, so reading it tells whether every kernel
runs on its own GPU's shard:

* each kernel call (Mosaic GPU or Triton custom call) with the layer it belongs
  to, the kernel's own name and its per-GPU result type;
* each all-gather with its result type and bytes.

A kernel fed a gathered weight shows its unsplit result shape beside an
all-gather of the weight's size (docs/int4_matmul.md, "Under tensor
parallelism", has the case this found). ``python -m experiments h200_compile``
records both per compiled step; ``scripts/step_kernels.py`` prints them for one.

It reads the program ``compile.compile_for_h200`` (or any GPU compile) returns, and
knows the Pallas kernels' custom-call targets, so it sits beside that compile; it
reads text only (no jax), and the model is just the ``layer_N`` segments of the
op names.
"""

from __future__ import annotations

import collections
import math
import re

# Custom-call targets of Pallas kernels in a GPU program: Mosaic GPU and Triton.
KERNEL_TARGETS = ("mosaic_gpu_v2", "mosaic_gpu", "__gpu$xla.gpu.triton")

# Bytes per element of XLA's element types (sub-byte types packed).
_ELEMENT_BYTES = {"pred": 1, "s1": 0.125, "u1": 0.125, "s2": 0.25, "u2": 0.25, "s4": 0.5,
                  "u4": 0.5, "f4e2m1fn": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                  "f8e4m3": 1, "f8e3m4": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
                  "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                  "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}

# "%name = TYPE custom-call(...)": TYPE is an array type or a (nested) tuple of them; its
# characters exclude the '%', '=' and '"' of operands and attributes, so a match cannot run past it.
_TYPE = r"([\w\[\]{}(),:* ]+?)"
_CALL_RE = re.compile(r"^\s*(?:ROOT )?%\S+ = " + _TYPE + r" custom-call\(.*?"
                      r"custom_call_target=\"([^\"]+)\"")
_GATHER_RE = re.compile(r"^\s*(?:ROOT )?%\S+ = " + _TYPE + r" all-gather(-start)?\(")
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
_LAYER_RE = re.compile(r"^layer_(\d+)$")
# A Mosaic GPU module's kernel symbol, a NUL-terminated string in the serialized module's
# string table, printed as "\00<name>_mosaic_gpu\00" ("stable_mosaic_gpu" is its dialect);
# a Triton call's name.
_MOSAIC_NAME_RE = re.compile(r"\\00([A-Za-z]\w*)_mosaic_gpu\\00")
_TRITON_NAME_RE = re.compile(r'\bname = \\?"(\w+)\\?"')


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(element type, shape) of each array in an HLO result type, e.g. ``f32[64,8]{0,1}``
  -> [("f32", (64, 8))]; a tuple type gives one entry per array, in order."""
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _ARRAY_RE.findall(type_text)]


def array_bytes(type_text: str) -> int:
  """Bytes of an HLO result type: one array (``f32[64,8]{0,1}``) or a tuple of them.

  Raises:
    ValueError: on an element type the table does not know, or no array at all.
  """
  found = arrays(type_text)
  if not found:
    raise ValueError(f"no array type in {type_text!r}")
  total = 0.0
  for dtype, shape in found:
    if dtype not in _ELEMENT_BYTES:
      raise ValueError(f"unknown HLO element type {dtype!r} in {type_text!r}")
    total += _ELEMENT_BYTES[dtype] * math.prod(shape)
  return int(math.ceil(total))


def type_bytes(type_text: str) -> int:
  """:func:`array_bytes`, or 0 for a type with no array in it (a token, an empty tuple)."""
  return array_bytes(type_text) if arrays(type_text) else 0


def async_results(type_text: str) -> str:
  """The results of an async collective's "-start" tuple, which holds its operands and then
  its results: ``(f32[8], f32[64])`` -> ``f32[64]`` (a tuple when several)."""
  found = arrays(type_text)
  found = found[len(found) // 2:]
  result = ", ".join(f"{t}[{','.join(map(str, shape))}]" for t, shape in found)
  return f"({result})" if len(found) > 1 else result


def _strip_layouts(type_text: str) -> str:
  return re.sub(r"\{[^{}]*\}", "", type_text)


def kernel_origin(line: str) -> tuple[str, str]:
  """(layer, name) of a kernel call.

  The name is the kernel's own (``kernel_name=`` / the Pallas call's name): a
  Mosaic GPU call's serialized module defines ``<name>_mosaic_gpu``, a Triton
  call's config has ``name = "<name>"``; else the op_name path's segment before
  its final ``pallas_call`` / ``mpmd_map``. The layer is the op_name path's
  ``layer_N`` segment ("-" outside the layers), e.g. ``jit(_step)/layer_1/
  shard_map/jit(int4_grouped_matmul_nk)/int4_grouped_matmul_nk/mpmd_map``.
  """
  m = _OP_NAME_RE.search(line)
  parts = [p for p in m.group(1).split("/") if p] if m else []
  layer = next((p for p in parts if _LAYER_RE.match(p)), "-")
  mosaic = [n for n in _MOSAIC_NAME_RE.findall(line) if n != "stable"]
  triton = _TRITON_NAME_RE.search(line)
  if mosaic:
    name = mosaic[0]
  elif triton:
    name = triton.group(1)
  else:
    name = parts[-2] if len(parts) >= 2 else (parts[-1] if parts else "?")
  return layer, name


def step_placement(hlo: str) -> dict:
  """Kernel calls and all-gathers of one device's compiled HLO text.

  Args:
    hlo: ``compiled.as_text()`` of a partitioned GPU program.

  Returns:
    {"kernels": [{"layer", "name", "target", "result"}] in program order,
     "all_gathers": [{"result", "bytes"}], "all_gather_bytes": their sum}.
    Result types are printed without layouts, e.g. ``bf16[512,2048]``.
  """
  kernels, gathers = [], []
  for line in hlo.splitlines():
    call = _CALL_RE.match(line)
    if call and call.group(2) in KERNEL_TARGETS:
      layer, name = kernel_origin(line)
      kernels.append({"layer": layer, "name": name, "target": call.group(2),
                      "result": _strip_layouts(call.group(1))})
      continue
    gather = _GATHER_RE.match(line)
    if gather:
      result = _strip_layouts(gather.group(1))
      if gather.group(2):
        result = async_results(result)
      gathers.append({"result": result, "bytes": array_bytes(result)})
  return {"kernels": kernels, "all_gathers": gathers,
          "all_gather_bytes": sum(g["bytes"] for g in gathers)}


def kernel_rows(kernels: list[dict]) -> list[list]:
  """Table rows [kernel, target, per-GPU result, layers, calls]: one per distinct
  (name, target, result), layers listed in order ("layer_0, layer_1")."""
  groups: dict[tuple, list[str]] = collections.OrderedDict()
  for k in kernels:
    groups.setdefault((k["name"], k["target"], k["result"]), []).append(k["layer"])
  rows = []
  for (name, target, result), layers in groups.items():
    distinct = list(dict.fromkeys(layers))
    rows.append([name, target, f"`{result}`", ", ".join(distinct), len(layers)])
  return rows
