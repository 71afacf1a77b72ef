"""Multi-process start-up: the same program on one process or many.

After :func:`initialize_distributed`, ``jax.devices()`` lists every process's
devices, so ``make_mesh`` builds a global mesh and ``shard_params`` /
``shard_kv_state`` place global arrays; nothing else changes.
"""

from __future__ import annotations

import jax


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int, *,
                           cpu_collectives: str | None = "gloo",
                           initialization_timeout: int = 60) -> None:
  """Joins this process to a multi-process JAX run (call before any computation).

  Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: processes in the run.
    process_id: this process's index in [0, num_processes).
    cpu_collectives: CPU cross-process collectives implementation ("gloo" or
      "mpi"); None leaves the setting alone (GPU runs use NCCL regardless).
    initialization_timeout: seconds to wait for every process to join.

  Raises:
    ValueError: on a bad process count or id.
  """
  if not isinstance(num_processes, int) or num_processes <= 0:
    raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
  if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
  if cpu_collectives is not None:
    # Without this, CPU computations that span processes have no collectives to run on.
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=initialization_timeout)


def is_multiprocess() -> bool:
  """True when this program runs as one of several JAX processes."""
  return jax.process_count() > 1
