"""The producer warpgroup's loop of the Mosaic GPU decode kernels: a ring of slots.

A producer warpgroup (BlockSizes.loads / gqa_loads) issues step i's gathers into
staging slot i % slots once the compute warpgroups have let go of that slot,
which they say by arriving on the slot's own barrier (docs/paged_attention.md,
"A producer warpgroup issues the gathers"). One barrier per slot, not one for
all: the compute warpgroups can finish several steps before the producer waits
for the first of them, and an mbarrier wait tests only the phase's parity, so a
barrier that completed twice before its waiter looked would never be seen to
complete.
"""

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def issue_ring(steps, slots: int, free_bar, issue) -> None:
  """Issues steps 0..steps-1 into a ring of ``slots`` slots, then waits out the
  phases nobody else waits on, so every barrier ends the kernel consumed.

  Args:
    steps: the piece's step count (a traced int32).
    slots: staging slots (static).
    free_bar: a Barrier of ``slots`` barriers; step i's readers arrive on
      ``free_bar.at[i % slots]`` once they are done with its slot.
    issue: issue(step) issues that step's TMAs into slot step % slots.
  """
  @pl.loop(0, steps)
  def _(i):
    # Slot i % slots was last read by step i - slots.
    pl.when(i >= slots)(lambda: plgpu.barrier_wait(free_bar.at[lax.rem(i, slots)]))
    issue(i)

  for j in range(slots):
    pl.when(steps > j)(
        lambda j=j: plgpu.barrier_wait(free_bar.at[lax.rem(steps - 1 - j, slots)]))


def start_loads(producer: bool, steps, slots: int, free_bar, load_query, issue,
                prologue: int) -> None:
  """The loads of a kernel of one compute warpgroup (wg 0), with or without a
  producer warpgroup (wg 1).

  With a producer, warpgroup 1 loads the query and runs :func:`issue_ring`. Both
  warpgroups then get what the larger needs, without setmaxnreg: with a producer
  these kernels' shared memory holds them to one CTA per SM, so the register
  file has room. Without one, the compute warpgroup loads the query and issues
  the first ``prologue`` steps here; its loop issues the rest.
  """
  if producer:
    @pl.when(lax.axis_index("wg") == 1)
    def _():
      load_query()
      issue_ring(steps, slots, free_bar, issue)
  else:
    load_query()
    for j in range(prologue):
      pl.when(j < steps)(lambda j=j: issue(j))


def run_compute(producer: bool, compute) -> None:
  """Runs ``compute`` on the compute warpgroup (wg 0 beside a producer)."""
  if producer:
    pl.when(lax.axis_index("wg") == 0)(compute)
  else:
    compute()
