"""Binomial confidence intervals and the sample sizes they need."""

from __future__ import annotations

import math


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """Wilson score interval for a proportion k/n (default 95%).

  Args:
    k: successes, 0 <= k <= n.
    n: trials, n >= 0 (n == 0 gives the uninformative (0, 1)).
    z: normal quantile (1.96 for 95%).

  Returns:
    (low, high) in [0, 1].

  Raises:
    ValueError: k outside [0, n].
  """
  if not 0 <= k <= n:
    raise ValueError(f"wilson_interval: need 0 <= k <= n, got k={k}, n={n}")
  if n == 0:
    return 0.0, 1.0
  p = k / n
  denom = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / denom
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
  return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference_interval(a: list[bool], b: list[bool], z: float = 1.96
                               ) -> tuple[float, float, float]:
  """Difference of two accuracies on the same items, with a paired 95% interval.

  Paired items share their difficulty, so the interval depends only on the items
  where the two recipes disagree, and is far tighter than two independent
  intervals. Uses Agresti & Min (2005): add 0.5 to each cell of the 2x2
  agreement table before the Wald interval, so that zero disagreements on a few
  items still give an honest, non-zero width (about +-1.96 / n on n items).

  Args:
    a, b: per-item correctness of two recipes on the same items (same length).
    z: normal quantile.

  Returns:
    (diff, low, high): the observed mean(b) - mean(a) and the interval, in [-1, 1].

  Raises:
    ValueError: lengths differ.
  """
  if len(a) != len(b):
    raise ValueError(f"paired_difference_interval: {len(a)} vs {len(b)} items")
  n = len(a)
  if n == 0:
    return 0.0, -1.0, 1.0
  only_b = sum(1 for x, y in zip(a, b) if y and not x)
  only_a = sum(1 for x, y in zip(a, b) if x and not y)
  diff = (only_b - only_a) / n
  n2 = n + 2.0
  p_b, p_a = (only_b + 0.5) / n2, (only_a + 0.5) / n2
  d2 = p_b - p_a
  half = z * math.sqrt(max(p_b + p_a - d2 * d2, 0.0) / n2)
  return diff, max(-1.0, d2 - half), min(1.0, d2 + half)


def samples_for_halfwidth(halfwidth: float, p: float = 0.5, z: float = 1.96) -> int:
  """Independent samples whose normal-approximation interval is +-halfwidth at accuracy p."""
  if not 0 < halfwidth < 1:
    raise ValueError(f"samples_for_halfwidth: halfwidth must be in (0, 1), got {halfwidth}")
  return math.ceil(z * z * p * (1 - p) / (halfwidth * halfwidth))
