"""Backend selection shared by every kernel package.

Each op takes ``backend="pallas" | "interpret" | "xla"``:

* ``pallas``: the compiled Pallas kernel (needs an NVIDIA GPU);
* ``interpret``: the same kernel run by the Pallas interpreter on any backend
  (used by CPU tests; slow);
* ``xla``: the pure-jnp reference, compiled by XLA (CPU runs, and the baseline
  the GPU check compares against).

``None`` means :func:`default_backend`: pallas on a GPU, xla elsewhere, so
callers (mlkit) run the kernels on a GPU with no code change.
"""

import jax

BACKENDS = ("pallas", "interpret", "xla")


def default_backend() -> str:
  """Returns "pallas" when JAX's default backend is a GPU, else "xla"."""
  return "pallas" if jax.default_backend() == "gpu" else "xla"


def resolve_backend(backend: str | None) -> str:
  """Validates ``backend`` and replaces None with :func:`default_backend`.

  Args:
    backend: one of BACKENDS, or None.

  Returns:
    The backend string to use.

  Raises:
    ValueError: if ``backend`` is not None and not one of BACKENDS.
  """
  if backend is None:
    return default_backend()
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
  return backend
