"""Benchmark case for the page-tag check: the kernel against XLA's path.

``bench_case(dims, ...)`` builds a :class:`pallas_kernels.benchmark.Bench` for one
shape (batch, max_pages, num_pages, page_size). Block tables draw pages from the
whole pool (requests may share pages, as forked prefixes do); every request uses
all its pages except the last, which uses half. Request 0 has one corrupted tag
on a used page and the last request one past its length, so the right answer is
[False, True, ..., True] and both the check and the length mask are exercised.
The job is bytes only: per used page its id, its expected tag and the pool's tag.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from pallas_kernels import benchmark as bm
from pallas_kernels.tag_check.ops import tag_check


def _lengths(b, p, ps):
  lengths = np.full((b,), p * ps, np.int32)
  if b > 1:
    lengths[-1] = p * ps // 2
  return lengths


def _make(seed, lengths, *, b, p, n):
  """Pool tags [N], block tables [B, P], expected tags [B, P] (row 0 corrupted), lengths.

  Made on the host (a few MB at most): no compile before the kernel's own.
  """
  rng = np.random.default_rng(seed)
  tags = rng.integers(0, 2**31 - 1, (n,), dtype=np.int32)
  bt = rng.integers(0, n, (b, p), dtype=np.int32)
  expected = tags[bt]
  expected[0, 0] += 1
  if b > 1:
    expected[-1, p - 1] += 1  # past the last request's length: ignored
  return tuple(jnp.asarray(a) for a in (tags, bt, expected, lengths))


def job_cost(dims: dict) -> tuple[int, int]:
  """(bytes, 0 FLOPs) one tag check must at least move: per used page its block-table
  id, expected tag and pool tag (4 B each), per row its length in and its flag out.
  The rows are those of ``bench_case`` (all full but the last, at half length)."""
  b, p, ps = dims["batch"], dims["max_pages"], dims["page_size"]
  used = int(np.sum(-(-_lengths(b, p, ps) // ps)))
  return used * 12 + b * 5, 0


def bench_case(dims: dict, *, backend: str = "pallas", seed: int = 0) -> bm.Bench:
  """The Bench of one tag-check case.

  Args:
    dims: batch, max_pages, num_pages, page_size (pallas_kernels.targets).
    backend: "pallas" on a GPU, "interpret" on a CPU.
    seed: base seed of the random inputs.

  Returns:
    A Bench with impls "pallas" and "xla", each checked exactly against
    [False, True, ...] and the reference.
  """
  b, p, n, ps = dims["batch"], dims["max_pages"], dims["num_pages"], dims["page_size"]
  lengths = _lengths(b, p, ps)
  want = np.ones(b, bool)
  want[0] = False

  set_bytes = 4 * (n + 2 * b * p + b)
  sets = bm.once(lambda: [_make(seed * 1000 + i, lengths, b=b, p=p, n=n)
                          for i in range(bm.rotation_sets(set_bytes))])
  ref = bm.once(lambda: np.asarray(tag_check(*sets()[0], page_size=ps, backend="xla")))

  def check(out):
    out = np.asarray(out)
    return {"correct": bool(np.array_equal(out, want) and np.array_equal(out, ref())),
            "mismatches": int(np.sum(out != want))}

  impls = [bm.Impl("pallas", functools.partial(tag_check, page_size=ps, backend=backend),
                   sets, check=check, note="Triton kernel"),
           bm.Impl("xla", functools.partial(tag_check, page_size=ps, backend="xla"),
                   sets, check=check, note="jnp reference")]
  return bm.Bench(*job_cost(dims), 0.0, impls, {"input_sets": bm.rotation_sets(set_bytes)})
