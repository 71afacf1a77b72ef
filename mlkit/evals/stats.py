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
  """Difference of two accuracies on the same items, with a paired normal interval.

  Paired items share their difficulty, so the interval depends only on the items
  where the two recipes disagree; it is far tighter than two independent intervals.

  Args:
    a, b: per-item correctness of two recipes on the same items (same length).

  Returns:
    (diff, low, high): mean(b) - mean(a) and its interval, in [-1, 1].

  Raises:
    ValueError: lengths differ.
  """
  if len(a) != len(b):
    raise ValueError(f"paired_difference_interval: {len(a)} vs {len(b)} items")
  n = len(a)
  if n == 0:
    return 0.0, -1.0, 1.0
  d = [int(y) - int(x) for x, y in zip(a, b)]
  mean = sum(d) / n
  var = sum((x - mean) ** 2 for x in d) / max(n - 1, 1)
  half = z * math.sqrt(var / n)
  return mean, max(-1.0, mean - half), min(1.0, mean + half)


def samples_for_halfwidth(halfwidth: float, p: float = 0.5, z: float = 1.96) -> int:
  """Independent samples whose normal-approximation interval is +-halfwidth at accuracy p."""
  if not 0 < halfwidth < 1:
    raise ValueError(f"samples_for_halfwidth: halfwidth must be in (0, 1), got {halfwidth}")
  return math.ceil(z * z * p * (1 - p) / (halfwidth * halfwidth))
