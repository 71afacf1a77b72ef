"""Prometheus metrics of a serving process, in vLLM's names with the ``mlkit:`` prefix.

Histograms are observed by the engine thread when a request ends (TTFT, time
per output token, end to end). Gauges and counters of the engine (running and
waiting requests, KV pages, prefix-cache hits, KV transfers) are read from a
snapshot the engine thread refreshes every half second, so that a scrape never
touches engine state from the HTTP thread. Exported through ``prometheus_client``
at ``GET /metrics``.
"""

from __future__ import annotations

import collections
import threading

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Bucket edges (seconds), as vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)

# snapshot key -> (metric name, help, "gauge" | "counter")
_FROM_SNAPSHOT = {
    "running": ("mlkit:num_requests_running", "Requests holding KV pages and running.", "gauge"),
    "waiting": ("mlkit:num_requests_waiting", "Requests queued, not yet running.", "gauge"),
    "pages_used": ("mlkit:kv_pages_used", "KV pages held by requests and the prefix cache.",
                   "gauge"),
    "pages_free": ("mlkit:kv_pages_free", "KV pages on the free list.", "gauge"),
    "pages_cached": ("mlkit:kv_pages_cached", "KV pages the prefix cache holds.", "gauge"),
    "pages_quarantined": ("mlkit:kv_pages_quarantined",
                          "KV pages out of circulation after an integrity fault.", "gauge"),
    "prefix_cache_hit_rate": ("mlkit:prefix_cache_hit_rate",
                              "Prompt tokens the prefix cache served / prompt tokens looked up.",
                              "gauge"),
    "prefix_cache_queries": ("mlkit:prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache.", "counter"),
    "prefix_cache_hits": ("mlkit:prefix_cache_hits", "Prompt tokens the prefix cache served.",
                          "counter"),
    "generated_tokens": ("mlkit:generation_tokens", "Tokens generated.", "counter"),
    "prompt_tokens": ("mlkit:prompt_tokens", "Prompt tokens prefilled.", "counter"),
    "kv_transfers": ("mlkit:kv_transfers", "KV payloads landed from the prefill server.",
                     "counter"),
    "kv_transfer_retries": ("mlkit:kv_transfer_retries",
                            "KV transfers asked again after a checksum mismatch.", "counter"),
    "kv_transfer_failures": ("mlkit:kv_transfer_failures",
                             "Requests aborted because their KV never arrived intact.", "counter"),
    # Speculative decoding (vLLM's spec_decode_* counters): 0 when it is off.
    "spec_verify_rows": ("mlkit:spec_decode_num_drafts",
                         "Verify rows: a request's drafts checked by one target pass.", "counter"),
    "spec_draft_tokens": ("mlkit:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                          "counter"),
    "spec_accepted_tokens": ("mlkit:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                             "counter"),
}


class ServeMetrics:
  """The process's Prometheus registry and what the engine thread feeds it.

  Args:
    model_name: the ``model_name`` label of every metric.
  """

  def __init__(self, model_name: str):
    self.model_name = model_name
    self.registry = CollectorRegistry()
    labels = ["model_name"]
    self.ttft = Histogram("mlkit:time_to_first_token_seconds",
                          "Time from arrival to the first token.", labels,
                          buckets=TTFT_BUCKETS, registry=self.registry)
    self.tpot = Histogram("mlkit:time_per_output_token_seconds",
                          "Mean time between output tokens of a request.", labels,
                          buckets=TPOT_BUCKETS, registry=self.registry)
    self.e2e = Histogram("mlkit:e2e_request_latency_seconds",
                         "Time from arrival to the request's end.", labels,
                         buckets=E2E_BUCKETS, registry=self.registry)
    self._lock = threading.Lock()
    self._snapshot: dict = {}
    self._ended: collections.Counter = collections.Counter()  # "finished:stop", "aborted:..."
    self.registry.register(_SnapshotCollector(self))

  def observe_end(self, req) -> None:
    """Records an ended request (an ``mlkit.engine.Request``; engine thread)."""
    if req.first_token_time is not None:
      self.ttft.labels(self.model_name).observe(req.first_token_time - req.arrival_time)
      if req.finish_time is not None and len(req.output) > 1:
        self.tpot.labels(self.model_name).observe(
            (req.finish_time - req.first_token_time) / (len(req.output) - 1))
    if req.finish_time is not None:
      self.e2e.labels(self.model_name).observe(req.finish_time - req.arrival_time)
    key = (f"aborted:{req.abort_reason}" if req.abort_reason is not None
           else f"finished:{req.finish_reason}")
    with self._lock:
      self._ended[key] += 1

  def update(self, snapshot: dict) -> None:
    """Replaces the engine snapshot the gauges and counters read (engine thread)."""
    with self._lock:
      self._snapshot = dict(snapshot)

  def render(self) -> bytes:
    """The Prometheus text exposition of every metric."""
    return generate_latest(self.registry)


class _SnapshotCollector:
  """Yields the snapshot's gauges and counters, and the ended requests by reason, at scrape time."""

  def __init__(self, metrics: ServeMetrics):
    self.metrics = metrics

  def collect(self):
    m = self.metrics
    with m._lock:  # noqa: SLF001 - the collector is part of ServeMetrics
      snap, ended = dict(m._snapshot), dict(m._ended)  # noqa: SLF001
    for key, (name, help_text, kind) in _FROM_SNAPSHOT.items():
      if key not in snap:
        continue
      fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
          name, help_text, labels=["model_name"])
      fam.add_metric([m.model_name], float(snap[key]))
      yield fam
    fin = CounterMetricFamily("mlkit:request_success", "Requests that finished, by reason.",
                              labels=["model_name", "finished_reason"])
    ab = CounterMetricFamily("mlkit:request_aborts", "Requests that were aborted, by reason.",
                             labels=["model_name", "reason"])
    for key, n in sorted(ended.items()):
      what, reason = key.split(":", 1)
      (fin if what == "finished" else ab).add_metric([m.model_name, reason], n)
    yield fin
    yield ab
