"""The front door's arrival window: how long a server's turn takes new requests before it
steps. Apart from ``mlkit.serve.decode`` so that the command line checks its flags
without importing jax."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ArrivalWindow:
  """How long a server's turn goes on taking new requests before it steps.

  Clients in a closed loop send their next request as their last one ends, so the
  requests that ended in one step come back as a burst, a fraction of a millisecond
  to a few milliseconds apart (an HTTP client's reaction, then the server's parse).
  A turn that stepped at the first of them would prefill it alone, and the rest
  would wait out that step: the burst splits into groups that stay split, because
  each group now ends in a different step. So after a message that queued new
  requests, the turn keeps taking messages while each comes within ``gap_s`` of the
  last, until ``max_s`` after the window opened, or until the engine has no room
  for more (running and waiting requests at ``max_running``). A request that comes
  alone waits ``gap_s`` more for its first token. docs/http.md, "Bursts of arrivals",
  has the measurements.

  Attributes:
    gap_s: the longest wait for the next message (0 turns the window off).
    max_s: the longest the window stays open.
  """

  gap_s: float = 0.001
  max_s: float = 0.03

  def __post_init__(self):
    if not (self.gap_s >= 0 and self.max_s >= 0):
      raise ValueError(f"ArrivalWindow: gap_s and max_s must be >= 0 seconds, got "
                       f"gap_s={self.gap_s}, max_s={self.max_s}")
    if self.max_s < self.gap_s:
      raise ValueError(f"ArrivalWindow: max_s ({self.max_s}) must be at least gap_s "
                       f"({self.gap_s})")
