"""Serving engine: continuous batching over the paged KV cache with page-integrity checks.

Layers: ``config`` (EngineConfig), ``request`` (lifecycle), ``scheduler``
(admission, chunked prefill, preemption over the page allocator), ``runner``
(the jitted prefill and decode steps), ``serving`` (the interface every engine
implements and the loop logic they share), ``engine`` (one pool's two-phase
step), ``disagg`` (a prefill pool and a decode pool composed), ``metrics`` and
``faults`` (test-only bookkeeping corruptions).
"""

from mlkit.engine.config import EngineConfig
from mlkit.engine.engine import Engine
from mlkit.engine.serving import EngineStalled, ServingEngine, ServingLoop
from mlkit.engine.faults import Fault, FaultKind, FaultRecord
from mlkit.engine.metrics import EngineMetrics, request_metrics
from mlkit.engine.disagg import (DisaggConfig, DisaggEngine, PoolConfig, build_serving_engine,
                                 default_disagg_config)
from mlkit.engine.request import (ABORT_CANCELLED, ABORT_ERROR, ABORT_INTEGRITY, ABORT_REASONS,
                                  ABORT_TOO_LONG, ABORT_TRANSFER,
                                  FINISH_LENGTH, FINISH_STOP, Request, RequestOutput,
                                  RequestRejected, RequestStatus)
from mlkit.engine.runner import TRACE_COUNTS, Runner, StepBatch
from mlkit.engine.scheduler import Scheduler

__all__ = [
    "ABORT_CANCELLED", "ABORT_ERROR", "ABORT_INTEGRITY", "ABORT_REASONS", "ABORT_TOO_LONG", "ABORT_TRANSFER",
    "DisaggConfig", "DisaggEngine", "PoolConfig", "build_serving_engine", "default_disagg_config",
    "Engine",
    "EngineConfig", "EngineMetrics", "EngineStalled", "FINISH_LENGTH", "FINISH_STOP", "Fault",
    "FaultKind", "FaultRecord", "Request", "RequestOutput", "RequestRejected", "RequestStatus",
    "Runner", "Scheduler", "ServingEngine", "ServingLoop", "StepBatch", "TRACE_COUNTS", "request_metrics",
]
