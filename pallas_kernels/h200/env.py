"""The process environment for deviceless H200 compiles, set before jax is imported.

Four things must hold when jax first loads its backends (they are read once):

* ``JAX_PLATFORMS=cpu`` when no NVIDIA GPU is present. With the CUDA plugin
  installed, jax otherwise probes the driver, prints a cuDNN traceback and
  (for ``get_topology_desc``) fails with "topology not implemented for cuda".
* ``TF_CPP_MIN_LOG_LEVEL=0`` and ``TF_CPP_VMODULE=subprocess_compilation=3``:
  XLA then logs ``ptxas -v`` (registers, stack, spills) for every kernel it
  compiles, which is how :mod:`pallas_kernels.h200.compile` reads them.
* The ``nvidia-cuda-nvcc`` wheel's ``ptxas`` first on ``PATH``: Mosaic GPU looks
  for ptxas on PATH (then /usr/local/cuda); XLA and Triton find the wheel.
* Child processes started without address-space randomisation. ptxas 13.0's
  register allocation depends on where its heap lands: the same PTX compiled
  twice with ASLR gives e.g. 191 or 193 registers. The personality flag is
  inherited by the threads and processes started after it is set, so it must be
  set before jax starts its compile threads; with it, repeated compiles of one
  kernel read the same (docs/h200_compile.md).

This module does not import jax.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_VMODULE = "subprocess_compilation=3"
# linux/personality.h: exec'd programs get a fixed address-space layout.
_ADDR_NO_RANDOMIZE = 0x0040000


def gpu_present() -> bool:
  """Whether this machine has an NVIDIA driver (a device node or the driver's proc entry)."""
  return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def wheel_ptxas() -> str | None:
  """Path of ptxas from the ``nvidia-cuda-nvcc`` wheel, or None if it is not installed."""
  try:
    import nvidia  # a namespace package installed by the nvidia-* wheels
  except ImportError:
    return None
  for root in getattr(nvidia, "__path__", []):
    # CUDA 13 wheels: nvidia/cu13/bin; CUDA 12 wheels: nvidia/cuda_nvcc/bin.
    found = sorted(glob.glob(os.path.join(root, "*", "bin", "ptxas")))
    if found:
      return found[0]
  return None


def prepare(*, ptxas_report: bool = True) -> None:
  """Sets the environment for deviceless H200 compiles; call before jax is imported.

  Leaves ``JAX_PLATFORMS`` alone on a machine with a GPU, and any value the user
  set. Idempotent.

  Args:
    ptxas_report: also turn on XLA's ``ptxas -v`` logging and put the wheel's
      ptxas first on PATH.

  Raises:
    RuntimeError: if jax was already imported (the settings would be ignored).
  """
  if "jax" in sys.modules and not _prepared():
    raise RuntimeError("pallas_kernels.h200.env.prepare() must run before jax is imported: "
                       "jax reads these settings once, when it loads its backends")
  if not gpu_present() and not os.environ.get("JAX_PLATFORMS"):
    os.environ["JAX_PLATFORMS"] = "cpu"
  if not ptxas_report:
    return
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
  vmodule = os.environ.get("TF_CPP_VMODULE", "")
  if _VMODULE not in vmodule:
    os.environ["TF_CPP_VMODULE"] = ",".join(filter(None, [vmodule, _VMODULE]))
  ptxas = wheel_ptxas()
  if ptxas is not None:
    bin_dir = os.path.dirname(ptxas)
    path = os.environ.get("PATH", "")
    if not path.startswith(bin_dir + os.pathsep):
      os.environ["PATH"] = bin_dir + os.pathsep + path
  _fix_child_address_layout()


def _personality(flags: int) -> int:
  """personality(2): sets the process's execution domain flags (0xffffffff reads them)."""
  return ctypes.CDLL(None, use_errno=True).personality(ctypes.c_ulong(flags))


def _fix_child_address_layout() -> None:
  """Starts later child processes (ptxas) without address-space randomisation."""
  try:
    current = _personality(0xFFFFFFFF)
    if current != -1 and not current & _ADDR_NO_RANDOMIZE:
      _personality(current | _ADDR_NO_RANDOMIZE)
  except (OSError, AttributeError):  # not Linux: readings may then vary by a register or two
    pass


def _prepared() -> bool:
  return (_VMODULE in os.environ.get("TF_CPP_VMODULE", "")
          and os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0")


def check(*, ptxas_report: bool = True) -> list[str]:
  """What is missing for a deviceless compile (with a ptxas report if asked); [] when all is set."""
  problems = []
  if not gpu_present() and os.environ.get("JAX_PLATFORMS") != "cpu":
    problems.append("JAX_PLATFORMS is not 'cpu' on a machine without a GPU")
  if ptxas_report and not _prepared():
    problems.append("ptxas logging is off (TF_CPP_MIN_LOG_LEVEL=0 and "
                    f"TF_CPP_VMODULE={_VMODULE} must be set before jax is imported)")
  if wheel_ptxas() is None:
    problems.append("no ptxas: install the test extra (nvidia-cuda-nvcc==13.0.*)")
  try:
    import jax_plugins.xla_cuda13  # noqa: F401
  except ImportError:
    problems.append("no CUDA compiler plugin: install the test extra (jax-cuda13-plugin==0.11.2)")
  return problems
