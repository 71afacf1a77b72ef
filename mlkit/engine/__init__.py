"""Serving engine: continuous batching over the paged KV cache with page-integrity checks.

Layers: ``config`` (EngineConfig), ``request`` (lifecycle), ``scheduler``
(admission, chunked prefill, preemption over the page allocator), ``runner``
(the jitted prefill and decode steps), ``engine`` (the loop), ``metrics`` and
``faults`` (test-only bookkeeping corruptions).
"""

from mlkit.engine.config import EngineConfig
from mlkit.engine.engine import Engine, EngineStalled
from mlkit.engine.faults import Fault, FaultKind, FaultRecord
from mlkit.engine.metrics import EngineMetrics, request_metrics
from mlkit.engine.disagg import (DisaggConfig, DisaggEngine, PoolConfig, default_disagg_config,
                                 make_sharded_engine)
from mlkit.engine.request import (ABORT_CANCELLED, ABORT_ERROR, ABORT_INTEGRITY, ABORT_REASONS,
                                  ABORT_TOO_LONG, ABORT_TRANSFER,
                                  FINISH_LENGTH, FINISH_STOP, Request, RequestOutput,
                                  RequestRejected, RequestStatus)
from mlkit.engine.runner import TRACE_COUNTS, Runner, StepBatch
from mlkit.engine.scheduler import Scheduler

__all__ = [
    "ABORT_CANCELLED", "ABORT_ERROR", "ABORT_INTEGRITY", "ABORT_REASONS", "ABORT_TOO_LONG", "ABORT_TRANSFER",
    "DisaggConfig", "DisaggEngine", "PoolConfig", "default_disagg_config", "make_sharded_engine",
    "Engine",
    "EngineConfig", "EngineMetrics", "EngineStalled", "FINISH_LENGTH", "FINISH_STOP", "Fault",
    "FaultKind", "FaultRecord", "Request", "RequestOutput", "RequestRejected", "RequestStatus",
    "Runner", "Scheduler", "StepBatch", "TRACE_COUNTS", "request_metrics",
]
