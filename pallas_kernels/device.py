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
