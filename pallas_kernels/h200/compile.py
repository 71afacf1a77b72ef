"""Deviceless compiles for an NVIDIA H200: ptxas readings per kernel, memory per device.

``compile_for_h200(fn, *args)`` lowers and compiles ``fn`` with XLA's real GPU
compiler against an H200 topology built from ``target_config.txtpb`` (the H200's
limits, and the rates XLA's performance model fuses by, in the form of openxla/xla's
``xla/backends/gpu/target_config/specs/h200.txtpb``).
No GPU is needed and nothing is allocated: the arguments are
``jax.ShapeDtypeStruct``s, with shardings on a topology mesh for multi-device
programs. It returns what ptxas reported for every Pallas kernel (registers,
spill stores/loads, stack, shared memory), XLA's ``memory_analysis()`` and the
kernels the program launches.

Needs the environment of :mod:`pallas_kernels.h200.env` (``env.prepare()``
before jax is imported) and the CUDA compiler packages of the test extra
(``jax-cuda13-plugin==0.11.2``, ``nvidia-cuda-nvcc==13.0.*``, matching the
H200 machine's image). Shared-memory overflow surfaces as an exception: at
lowering for Mosaic GPU, at compile for Triton.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import os
import pathlib
import re
import sys
import tempfile
import time
from typing import Any, Callable

import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.h200 import env

TARGET_CONFIG = pathlib.Path(__file__).with_name("target_config.txtpb")
# H200 limits (from the target config): the opt-in shared memory per block and registers per thread.
SMEM_LIMIT_BYTES = 232448
MAX_REGISTERS = 255
DEVICE_MEMORY_BYTES = 151397597184

_PTXAS_RE = re.compile(
    r"Function properties for (\S+)\n\s+(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads\nptxas info\s+: Used (\d+) registers")
# ptxas' warning that it serialised a kernel's wgmmas (each waits for the last),
# which costs the MMA pipeline its overlap without showing in registers or spills.
_SERIALIZED_RE = re.compile(r"wgmma\.mma_async instructions are serialized due to (.*?) "
                            r"in the function '(\S+?)'")
# XLA's own fusions and copies, which are not Pallas kernels.
_XLA_KERNEL_RE = re.compile(r"(loop|input|wrapped|fusion|gemm_fusion|copy|transpose|concatenate|reduce)_?")


class H200CompileUnavailable(RuntimeError):
  """The environment or packages for deviceless H200 compiles are missing."""


@dataclasses.dataclass(frozen=True)
class KernelStats:
  """What ptxas reported for one kernel.

  Attributes:
    registers: registers per thread.
    spill_stores / spill_loads: bytes of register spills per thread.
    stack: stack frame bytes per thread.
    smem: shared memory bytes per block (static + dynamic), None if not read.
    wgmma_serialized: why ptxas serialised the kernel's wgmmas, None if it did not.
  """

  registers: int
  spill_stores: int
  spill_loads: int
  stack: int
  smem: int | None = None
  wgmma_serialized: str | None = None

  @property
  def spills(self) -> int:
    return self.spill_stores + self.spill_loads


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """One deviceless compile.

  Attributes:
    seconds: lowering + compile wall time.
    kernels: Pallas kernel name -> KernelStats.
    memory: per-device bytes from ``memory_analysis()`` (argument, output,
      temp, generated code, alias), or {} if XLA reported none.
    launches: what the compiled program launches, in order: the name of every
      kernel (XLA's fusions, Triton and Mosaic GPU kernels) and library call
      (custom calls, GEMMs) of XLA's thunk sequence.
    register_wgmma_waits: with ``mosaic_ptx=True``, per Mosaic GPU module, the
      :func:`register_wgmma_waits` of its PTX.
  """

  seconds: float
  kernels: dict[str, KernelStats]
  memory: dict[str, int]
  launches: tuple[str, ...] = ()
  register_wgmma_waits: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@functools.cache
def topology(devices: int = 1):
  """An H200 topology of ``devices`` GPUs on one host (1 or 8 typically)."""
  problems = env.check(ptxas_report=False)
  if problems:
    raise H200CompileUnavailable("cannot compile for an H200 here: " + "; ".join(problems))
  return topologies.get_topology_desc(platform="cuda", topology_name="h200",
                                      target_config=TARGET_CONFIG.read_text(),
                                      topology=f"1x1x{int(devices)}")


def mesh(shape: tuple[int, ...] = (1,), axis_names: tuple[str, ...] = ("x",)):
  """A ``jax.sharding.Mesh`` of compile-only H200 devices with the given axes."""
  n = 1
  for s in shape:
    n *= int(s)
  return topologies.make_mesh(topology(n), tuple(shape), tuple(axis_names))


def spec(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
  """A ShapeDtypeStruct on one H200 (replicated) unless a sharding is given."""
  if sharding is None:
    sharding = NamedSharding(mesh(), P())
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _mosaic_smem(asm: str) -> tuple[str | None, int] | None:
  """(ptxas' name of the kernel, its dynamic shared memory) of a serialised Mosaic
  GPU kernel (private jax internals); None where they cannot be read."""
  try:
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import mosaic_gpu_dialect
    from jax.experimental.mosaic.gpu import core as mgpu_core
    from jaxlib.mlir import ir
    ctx = jmlir.make_ir_context()
    mosaic_gpu_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    with ctx, ir.Location.unknown():
      txt = str(mgpu_core._run_serde_pass(ir.Module.parse(asm), serialize=False))  # noqa: SLF001
    var = re.search(r"gpu\.launch .*dynamic_shared_memory_size (%\S+)", txt).group(1)
    smem = int(re.search(re.escape(var) + r" = \S+ (\d+)", txt).group(1))
    # ptxas names the kernel after the module: "<kernel_name>_mosaic_gpu_kernel".
    module = re.match(r"\s*module @([\w.$-]+)", txt)
    return (module.group(1) + "_mosaic_gpu_kernel" if module else None), smem
  except Exception:  # a jax upgrade moved the internals: report no reading, not a failure
    return None


@contextlib.contextmanager
def _mosaic_kernels_lowered():
  """Yields a dict that holds, once the block exits, every Mosaic GPU kernel lowered
  inside it ({kernel id: serialised module}), including kernels an earlier compile in
  this process lowered too: Mosaic GPU's registry of known kernels is swapped for an
  empty one for the block, then the two are merged back (private jax internals; with
  them moved, the dict stays empty and shared memory reads None)."""
  got: dict = {}
  try:
    from jax.experimental.mosaic.gpu import core as mgpu_core
    saved = mgpu_core.KNOWN_KERNELS
  except Exception:
    yield got
    return
  mgpu_core.KNOWN_KERNELS = {}
  try:
    yield got
  finally:
    got.update(mgpu_core.KNOWN_KERNELS)
    saved.update(got)
    mgpu_core.KNOWN_KERNELS = saved


def parse_ptxas_log(text: str) -> dict[str, dict]:
  """Per Pallas kernel, what ptxas' ``-v`` log says: {name: KernelStats fields}
  (registers, spills, stack; wgmma_serialized when ptxas warned that it
  serialised the kernel's wgmmas; smem None, read elsewhere). XLA's own fusions
  are left out."""
  stats: dict[str, dict] = {}
  for name, stack, st, ld, regs in _PTXAS_RE.findall(text):
    if _XLA_KERNEL_RE.match(name):
      continue
    stats[name] = dict(registers=int(regs), spill_stores=int(st), spill_loads=int(ld),
                       stack=int(stack), smem=None)
  for reason, name in _SERIALIZED_RE.findall(text):
    if name in stats:
      stats[name]["wgmma_serialized"] = reason
  return stats


def compile_for_h200(fn: Callable[..., Any], *args, mesh_=None, ptxas_report: bool = True,
                     mosaic_ptx: bool = False, **kwargs) -> CompileReport:
  """Lowers and compiles ``fn(*args, **kwargs)`` for an H200 and reads ptxas' report.

  Args:
    fn: the function (keyword arguments are closed over, so they may be static).
    *args: ShapeDtypeStructs (see :func:`spec`), sharded on a mesh of :func:`mesh`.
    mesh_: the mesh the arguments live on (default: one H200); Pallas reads the
      GPU kind from it.
    ptxas_report: require XLA's ptxas logging (``env.prepare()``), so that every
      kernel's registers and spills are read; False for memory-only compiles.
    mosaic_ptx: also have Mosaic GPU dump its kernels' PTX and read their
      ``register_wgmma_waits``.
    **kwargs: static keyword arguments of ``fn``.

  Returns:
    A CompileReport.

  Raises:
    H200CompileUnavailable: the environment or packages are missing.
    Whatever lowering or compiling raises (unsupported op, shared memory overflow).
  """
  if ptxas_report and (problems := env.check()):
    raise H200CompileUnavailable("cannot read ptxas' report here: " + "; ".join(problems))
  m = mesh() if mesh_ is None else mesh_
  with tempfile.TemporaryDirectory(prefix="h200_dump_") as dump:
    if not mosaic_ptx:
      return _compile(fn, args, kwargs, m, dump)
    modules, report = read_mosaic_ptx(lambda: _compile(fn, args, kwargs, m, dump))
  waits = {name: register_wgmma_waits(ptx) for name, ptx in modules}
  return dataclasses.replace(report, register_wgmma_waits=waits)


# The line LLVM's NVPTX back end opens every module with, and a Mosaic GPU entry point.
_PTX_HEADER_RE = re.compile(r"^//\n// Generated by LLVM NVPTX Back-End\n", re.MULTILINE)
_MOSAIC_ENTRY_RE = re.compile(r"\.entry\s+(\w+?)_mosaic_gpu_kernel\s*\(")


def split_ptx_modules(text: str) -> list[tuple[str, str]]:
  """(kernel name, PTX) of every PTX module in ``text``, in order; the name is the
  Mosaic GPU module's (its entry point less ``_mosaic_gpu_kernel``).

  Raises:
    ValueError: a module with no Mosaic GPU entry point, or more than one.
  """
  starts = [m.start() for m in _PTX_HEADER_RE.finditer(text)]
  out = []
  for a, b in zip(starts, starts[1:] + [len(text)]):
    ptx = text[a:b]
    names = _MOSAIC_ENTRY_RE.findall(ptx)
    if len(names) != 1:
      raise ValueError(f"a PTX module with entry points {names}, not one Mosaic GPU kernel")
    out.append((names[0], ptx))
  return out


def read_mosaic_ptx(compile_fn: Callable[[], Any]) -> tuple[list[tuple[str, str]], Any]:
  """Runs ``compile_fn()`` with Mosaic GPU writing its kernels' PTX; returns
  (:func:`split_ptx_modules` of that PTX, what ``compile_fn()`` returned).

  ``MOSAIC_GPU_DUMP_PTX`` alone has Mosaic GPU write each kernel's PTX to file
  descriptor 1 (from C++), which is sent to a file for the compile. The dump directory
  (``MOSAIC_GPU_DUMP_TO``) is kept off: it turns on every dump Mosaic GPU has (the IR
  after each MLIR pass, tens of MB of text per kernel; the layout constraint system,
  formatted in Python), which made these compiles take about twice as long. Mosaic GPU
  reads the settings per lowering, so the kernels lowered inside ``compile_fn`` are
  the ones read. Anything else written to standard output meanwhile is passed on.
  """
  saved_env = {k: os.environ.pop(k, None) for k in _MOSAIC_DUMP_ENV}
  os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
  with tempfile.TemporaryFile() as out:
    sys.stdout.flush()
    saved_fd = os.dup(1)
    os.dup2(out.fileno(), 1)
    try:
      result = compile_fn()
    finally:
      sys.stdout.flush()
      os.dup2(saved_fd, 1)
      os.close(saved_fd)
      for k, v in saved_env.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
    out.seek(0)
    text = out.read().decode(errors="replace")
  first = _PTX_HEADER_RE.search(text)
  other = text if first is None else text[:first.start()]
  if other:
    sys.stdout.write(other)
  return split_ptx_modules(text), result


_MOSAIC_DUMP_ENV = ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTX")
# A wgmma whose A operand is a register list (the second brace group) rather than a
# shared-memory descriptor; and a wait for all but N wgmma groups.
_REGISTER_WGMMA_RE = re.compile(r"wgmma\.mma_async\S*\s+\{[^}]*\},\s*\{")
_WGMMA_WAIT_RE = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")


def register_wgmma_waits(ptx: str) -> tuple[int, ...]:
  """For each wgmma in ``ptx`` that reads its A operand from registers, in text order,
  the N of the first ``wgmma.wait_group N`` after it (-1 where none follows).

  A wgmma reads register operands while it runs, and PTX leaves writing them before a
  wait that covers it undefined: a kernel that goes on to reuse those registers (the
  next pipeline step converting into them) needs N = 0 here (docs/int4_matmul.md).
  """
  waits = [(m.start(), int(m.group(1))) for m in _WGMMA_WAIT_RE.finditer(ptx)]
  out = []
  for m in _REGISTER_WGMMA_RE.finditer(ptx):
    out.append(next((n for pos, n in waits if pos > m.start()), -1))
  return tuple(out)


def _compile(fn, args, kwargs, m, dump: str) -> CompileReport:
  log = tempfile.TemporaryFile()
  sys.stderr.flush()
  saved = os.dup(2)
  os.dup2(log.fileno(), 2)  # XLA logs ptxas -v on fd 2
  t0 = time.perf_counter()
  try:
    with jax.sharding.use_abstract_mesh(m.abstract_mesh), \
         _mosaic_kernels_lowered() as lowered_kernels:
      lowered = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower()
    # Level 3, XLA's default, whatever XLA_FLAGS says (the test suite lowers it for its
    # CPU programs): the readings are of the kernels as a real build compiles them.
    # No autotuning: with no device it times nothing, yet it still builds (and runs
    # ptxas on) candidate configs of XLA's own fusions around the kernel. It does not
    # touch the Pallas kernels: 327 readings of the attention, INT4 and sparse compile
    # tests are the same with and without it (docs/h200_compile.md).
    compiled = lowered.compile({"xla_dump_to": dump, "xla_backend_optimization_level": 3,
                                "xla_gpu_autotune_level": 0})
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)
  secs = time.perf_counter() - t0
  log.seek(0)
  stats = parse_ptxas_log(log.read().decode(errors="replace"))
  # Triton kernels: shared memory from the launch lines of XLA's thunk dump.
  for path in sorted(glob.glob(os.path.join(dump, "*thunk_sequence.txt"))):
    for mt in re.finditer(r"kCustomKernel.*?\] (\S+) grid: .*?shared_memory: (\d+) bytes",
                          open(path).read()):
      if mt.group(1) in stats:
        stats[mt.group(1)]["smem"] = int(mt.group(2))
  # Mosaic GPU kernels: dynamic shared memory from the serialised kernel.
  # By name (an op may launch two, such as a decode kernel and its merge); the
  # largest where no name can be read.
  read = [r for r in (_mosaic_smem(asm) for asm in lowered_kernels.values()) if r is not None]
  by_name = {name: smem for name, smem in read if name is not None}
  for name, s in stats.items():
    if name.endswith("_mosaic_gpu_kernel") and s["smem"] is None and read:
      s["smem"] = by_name.get(name) if by_name else max(smem for _, smem in read)
  memory = {}
  try:
    ma = compiled.memory_analysis()
    if ma is not None:
      for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                    "generated_code_size_in_bytes", "alias_size_in_bytes"):
        memory[field.removesuffix("_size_in_bytes")] = int(getattr(ma, field))
  except Exception:
    memory = {}
  return CompileReport(secs, {k: KernelStats(**v) for k, v in stats.items()}, memory,
                       launches_in_dump(dump))


def launches_in_dump(dump: str) -> tuple[str, ...]:
  """What the programs compiled with ``xla_dump_to=dump`` launch, in order: every
  kernel and library call of XLA's thunk sequences (one per compiled module)."""
  names = []
  for path in sorted(glob.glob(os.path.join(dump, "*thunk_sequence.txt"))):
    with open(path) as f:
      names += _launches(f.read())
  return tuple(names)


# One line of XLA's thunk sequence dump: "012: kKernel [prev=...] name grid: ...".
_THUNK_RE = re.compile(r"^\d+: (k\w+)\s+\[[^\]]*\]\s+(\S+)", re.M)
# Thunks that launch work on the device (the rest copy, wait or synchronise).
_LAUNCH_KINDS = ("kKernel", "kCustomKernel", "kCustomCall", "kGemm", "kCublasLtMatmul")


def _launches(thunk_sequence: str) -> list[str]:
  """Names of the kernels and library calls in one thunk sequence dump, in order."""
  return [name for kind, name in _THUNK_RE.findall(thunk_sequence) if kind in _LAUNCH_KINDS]
