"""Which device a kernel is being built for, as the block-size tables see it.

The tables are keyed by device kind ("NVIDIA H200", ...). The kind usually comes
from ``jax.devices()``, but a program compiled ahead of time for a GPU topology
from a CPU host (``jax.sharding.use_abstract_mesh(mesh.abstract_mesh)`` over an
H200 topology, see docs/h200_compile.md) runs on the CPU backend while tracing:
there the abstract mesh carries the target's kind, and it is the one the tables
must use. Pallas itself reads the target GPU from the same place.
"""

import jax

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def device_kind() -> str:
  """The kind of device the current trace targets.

  Returns:
    The active abstract mesh's device kind when it describes a GPU (an AOT
    compile for a GPU topology), else ``jax.devices()[0].device_kind``, else
    "cpu" if no backend can be initialised.
  """
  abstract = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if abstract is not None and abstract.platform in _GPU_PLATFORMS:
    return abstract.device_kind
  try:
    return jax.devices()[0].device_kind
  except RuntimeError:
    return "cpu"


# Streaming multiprocessors per device kind, for persistent grids sized to the
# machine. Kinds not listed read ``core_count`` from the local device.
_SM_COUNT = {"NVIDIA H200": 132, "NVIDIA H100 80GB HBM3": 132}


def num_sms(kind: str | None = None) -> int:
  """Streaming multiprocessors of the device a trace targets (132 on an H200).

  Args:
    kind: a device kind; None reads :func:`device_kind`.

  Returns:
    The table's count for a known kind, else the local device's ``core_count``
    when it has one, else 132 (what the Hopper tables are sized for; the
    interpreter and the CPU have no SMs).
  """
  kind = device_kind() if kind is None else kind
  if kind in _SM_COUNT:
    return _SM_COUNT[kind]
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except RuntimeError:
    return 132
