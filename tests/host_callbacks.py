"""Host callbacks that receive numpy arrays: the interpreted Mosaic GPU kernels, faster.

Pallas' Mosaic GPU interpreter runs every memory access, barrier and copy of a kernel as
a Python ``io_callback``. jax's ``io_callback_impl`` first places each argument of each
call on a CPU device (``jax.device_put``) and hands the callback jax arrays. The
interpreter's callbacks only read those arguments as integers and numpy data (``int``,
``.item()``, ``np.asarray``), so the placement is pure overhead: it was about a third of
``tests/test_paged_attention_kernel.py``'s time (docs/testing.md). :func:`install` swaps
in an ``io_callback_impl`` that hands the callback numpy copies of its arguments, and
teaches the interpreter's one type check (``shared_memory._to_int``, which accepted jax
arrays and Python ints) numpy scalars.

What the interpreter computes is unchanged: the same callbacks run on the same values, in
the same order, on the same threads; the interpreted-kernel tests compare against their
references and check for races either way. ``JAX_IO_CALLBACKS=jax`` runs jax's own
implementation instead. It is installed only on the jax it was written against (the
pinned 0.11.2), where the replaced functions have the signatures below.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np

_logger = logging.getLogger("jax._src.callback")

_JAX_VERSION = "0.11.2"


def install() -> bool:
  """Replaces jax's ``io_callback_impl`` and the Mosaic GPU interpreter's ``_to_int`` as
  the module docstring says. Returns whether it did: not under ``JAX_IO_CALLBACKS=jax``,
  nor on another jax version."""
  if os.environ.get("JAX_IO_CALLBACKS") == "jax" or jax.__version__ != _JAX_VERSION:
    return False
  from jax._src import callback
  from jax._src import config
  from jax._src.pallas.mosaic_gpu.interpret import shared_memory

  if getattr(callback.io_callback_impl, "numpy_arguments", False):
    return True  # installed already

  cpu = []  # the first CPU device, found at the first call (the backend is up by then)

  def io_callback_impl(*args, result_avals, callback, sharding, ordered):
    del result_avals, sharding, ordered
    # Copies: the arguments may view XLA's buffers, which live for this call only, and a
    # callback may keep what it is given (a stored value).
    args = tuple(np.array(a) for a in args)
    # As jax's: any jnp work inside the callback stays on the CPU, and a failure is logged
    # before it propagates.
    if not cpu:
      cpu.append(jax.local_devices(backend="cpu")[0])
    with config.default_device(cpu[0]):
      try:
        return jax.tree.map(np.asarray, callback(*args))
      except BaseException:
        _logger.exception("jax.io_callback failed")
        raise

  to_int = shared_memory._to_int

  def _to_int(x):
    if isinstance(x, (np.ndarray, np.generic)):
      return x.item()
    return to_int(x)

  io_callback_impl.numpy_arguments = True
  callback.io_callback_impl = io_callback_impl
  shared_memory._to_int = _to_int
  return True
