"""Engine and per-request metrics: TTFT, time per output token, throughput, host overhead."""

from __future__ import annotations

import collections
import dataclasses
import time

from mlkit.engine.request import Request


def request_metrics(req: Request) -> dict:
  """Per-request numbers (seconds; None where not yet defined).

  Returns:
    {status, prompt_tokens, output_tokens, ttft_s, tpot_s, latency_s, preemptions,
     finish_reason, abort_reason}. tpot_s is (last token - first token) / (tokens - 1).
  """
  ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
  tpot = None
  if req.first_token_time is not None and req.finish_time is not None and len(req.output) > 1:
    tpot = (req.finish_time - req.first_token_time) / (len(req.output) - 1)
  latency = None if req.finish_time is None else req.finish_time - req.arrival_time
  return {
      "status": req.status.value, "prompt_tokens": len(req.prompt),
      "output_tokens": len(req.output), "ttft_s": ttft, "tpot_s": tpot, "latency_s": latency,
      "preemptions": req.num_preemptions, "finish_reason": req.finish_reason,
      "abort_reason": req.abort_reason,
  }


@dataclasses.dataclass
class EngineMetrics:
  """Counters the engine updates every step (host-side, no device sync)."""

  steps: int = 0
  prefill_steps: int = 0
  decode_steps: int = 0
  generated_tokens: int = 0
  prefill_tokens: int = 0
  # Host time spent scheduling and bookkeeping, excluding the device steps.
  host_seconds: float = 0.0
  # Wall time from dispatching the device steps until their results were on the host.
  device_seconds: float = 0.0
  finished: int = 0
  preemptions: int = 0
  integrity_failures: int = 0
  # Page-conservation violations found (by the audit, or by the allocator at allocation).
  page_violations: int = 0
  # Host time spent while no step was in flight, so the device waited for it (part of
  # host_seconds; all of it without overlap).
  exposed_host_seconds: float = 0.0
  # Host time spent in the page-conservation audit (part of host_seconds).
  audit_seconds: float = 0.0
  # Page tags written to the device (a full sync counts the whole pool).
  tag_pages_synced: int = 0
  aborted: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first_step_time: float | None = None
  last_step_time: float | None = None
  last_host_seconds: float = 0.0
  last_device_seconds: float = 0.0
  # Speculative decoding: drafts offered to and accepted by verify rows, verify rows, and
  # verify rows by drafts accepted (index n: n accepted, so n + 1 tokens from the row).
  drafts_proposed: int = 0
  drafts_accepted: int = 0
  verify_rows: int = 0
  accepted_histogram: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)

  def record_speculation(self, offered: int, accepted: int) -> None:
    """One verify row: ``offered`` drafts, ``accepted`` of them kept."""
    self.drafts_proposed += offered
    self.drafts_accepted += accepted
    self.verify_rows += 1
    self.accepted_histogram[accepted] += 1

  def record_step(self, *, host_s: float, device_s: float, prefill: bool, decode: bool,
                  generated: int, prefilled: int, start: float,
                  exposed_host_s: float | None = None) -> None:
    """Adds one step's timings and counts (exposed_host_s None: all of host_s was exposed)."""
    if self.first_step_time is None:
      self.first_step_time = start
    self.last_step_time = time.perf_counter()
    self.steps += 1
    self.prefill_steps += int(prefill)
    self.decode_steps += int(decode)
    self.generated_tokens += generated
    self.prefill_tokens += prefilled
    self.host_seconds += host_s
    self.exposed_host_seconds += host_s if exposed_host_s is None else exposed_host_s
    self.device_seconds += device_s
    self.last_host_seconds, self.last_device_seconds = host_s, device_s

  def as_dict(self) -> dict:
    """Counters plus derived rates: throughput_tok_s, host_overhead_fraction, per-step means."""
    elapsed = ((self.last_step_time - self.first_step_time)
               if self.first_step_time is not None else 0.0)
    busy = self.exposed_host_seconds + self.device_seconds
    return {
        "steps": self.steps, "prefill_steps": self.prefill_steps,
        "decode_steps": self.decode_steps, "generated_tokens": self.generated_tokens,
        "prefill_tokens": self.prefill_tokens, "elapsed_s": elapsed,
        "throughput_tok_s": self.generated_tokens / elapsed if elapsed > 0 else 0.0,
        "host_seconds": self.host_seconds, "device_seconds": self.device_seconds,
        "host_overhead_s_per_step": self.host_seconds / self.steps if self.steps else 0.0,
        "device_s_per_step": self.device_seconds / self.steps if self.steps else 0.0,
        # The share of busy time in which the device waited for the host.
        "host_overhead_fraction": self.exposed_host_seconds / busy if busy > 0 else 0.0,
        "exposed_host_s_per_step": self.exposed_host_seconds / self.steps if self.steps else 0.0,
        "last_host_overhead_s": self.last_host_seconds,
        "last_device_s": self.last_device_seconds,
        "finished": self.finished, "preemptions": self.preemptions,
        "integrity_failures": self.integrity_failures,
        "page_violations": self.page_violations,
        "audit_s_per_step": self.audit_seconds / self.steps if self.steps else 0.0,
        "aborted": dict(self.aborted), "rejected": dict(self.rejected),
        **self._speculation(),
    }

  def _speculation(self) -> dict:
    if not self.verify_rows:
      return {}
    hist = [self.accepted_histogram.get(n, 0) for n in range(max(self.accepted_histogram) + 1)]
    return {"speculative": {
        "drafts_proposed": self.drafts_proposed, "drafts_accepted": self.drafts_accepted,
        "verify_rows": self.verify_rows,
        # Tokens a verify row emits: its accepted drafts plus one.
        "acceptance_length": 1 + self.drafts_accepted / self.verify_rows,
        "acceptance_rate": (self.drafts_accepted / self.drafts_proposed
                            if self.drafts_proposed else 0.0),
        "accepted_histogram": hist,
        "tokens_per_decode_step": (self.generated_tokens / self.decode_steps
                                   if self.decode_steps else 0.0)}}
