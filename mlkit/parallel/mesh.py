"""Device meshes with named axes, and disjoint sub-meshes for serving pools.

Every mesh here has the same three named axes, ``("data", "tensor", "expert")``,
so sharding rules never depend on how many devices a pool has: an axis of size 1
simply replicates.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

# Axis names of every mesh built here (data parallel, tensor parallel, expert parallel).
AXES = ("data", "tensor", "expert")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Sizes of the three mesh axes. Their product is the number of devices used.

  Raises:
    ValueError: naming the field if an axis size is not a positive int.
  """

  # Data-parallel replicas (requests; with data-parallel attention also MLA pages).
  data: int = 1
  # Tensor-parallel ways (attention heads, FFN width, vocabulary).
  tensor: int = 1
  # Expert-parallel ways (routed experts).
  expert: int = 1

  def __post_init__(self):
    for name in AXES:
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"MeshConfig.{name} must be a positive int, got {v!r}")

  @property
  def num_devices(self) -> int:
    return self.data * self.tensor * self.expert

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.data, self.tensor, self.expert)

  @classmethod
  def for_devices(cls, n: int, *, expert: int = 1, data: int = 1) -> "MeshConfig":
    """``n`` devices with the given expert and data ways and the rest on the tensor axis.

    Raises:
      ValueError: if data * expert does not divide n.
    """
    if n <= 0 or n % (expert * data):
      raise ValueError(f"MeshConfig.for_devices: data ({data}) * expert ({expert}) must divide "
                       f"the device count {n}")
    return cls(data=data, tensor=n // (expert * data), expert=expert)


def make_mesh(config: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with axes ``AXES`` over ``devices`` (default: all devices, every process's).

  Args:
    config: axis sizes; None puts every device on the tensor axis.
    devices: the devices to use, in order (default ``jax.devices()``, which under
      ``jax.distributed`` is the global device list, so one program works on one
      process or many).

  Returns:
    A ``jax.sharding.Mesh`` of shape config.shape.

  Raises:
    ValueError: if the config needs a different number of devices than given.
  """
  devices = list(jax.devices() if devices is None else devices)
  config = config or MeshConfig(tensor=len(devices))
  if config.num_devices != len(devices):
    raise ValueError(f"mesh {config.shape} needs {config.num_devices} devices, got {len(devices)}")
  return Mesh(np.asarray(devices, dtype=object).reshape(config.shape), AXES)


def split_mesh(configs: Sequence[MeshConfig], devices: Sequence[jax.Device] | None = None
               ) -> list[Mesh]:
  """Disjoint sub-meshes, one per config, over consecutive runs of ``devices``.

  Used for the prefill and decode pools: no device belongs to two pools, so the
  two pools' steps can run at the same time.

  Args:
    configs: one MeshConfig per pool.
    devices: the devices to split (default ``jax.devices()``).

  Returns:
    One Mesh per config, in order.

  Raises:
    ValueError: if the configs need more devices than there are.
  """
  devices = list(jax.devices() if devices is None else devices)
  need = sum(c.num_devices for c in configs)
  if need > len(devices):
    raise ValueError(f"split_mesh: pools need {need} devices "
                     f"({' + '.join(str(c.num_devices) for c in configs)}), only {len(devices)} exist")
  meshes, start = [], 0
  for c in configs:
    meshes.append(make_mesh(c, devices[start:start + c.num_devices]))
    start += c.num_devices
  return meshes


def axis_size(mesh: Mesh, axes) -> int:
  """Devices along a mesh axis name, a tuple of names, or None (1)."""
  if axes is None:
    return 1
  if isinstance(axes, str):
    axes = (axes,)
  return math.prod(mesh.shape[a] for a in axes)
