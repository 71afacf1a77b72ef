"""Engine configuration: model, KV pool, batch buckets, prefill budget, integrity switch."""

from __future__ import annotations

import dataclasses

from mlkit.config import ModelConfig
from mlkit.kvcache import KVCacheConfig
from pallas_kernels import dispatch


def _pos_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x > 0


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How one serving engine is shaped. Every device shape derives from these fields.

  Raises:
    ValueError: naming the offending field (non-positive sizes, unsorted or
      duplicated buckets, a max_running no bucket can hold, chunk/budget/prefill
      buckets that disagree, an unknown backend).
  """

  # The model served (its dtype decides the compute precision).
  model: ModelConfig
  # The paged KV pool (page count, page size, storage dtype).
  kv: KVCacheConfig
  # Requests that may hold pages at once (prefilling plus decoding).
  max_running: int = 8
  # Allowed batch sizes of a device step, ascending; a step pads its rows up to the next one.
  batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
  # Allowed prefill chunk lengths, ascending; the largest is the longest chunk one request gets per step.
  prefill_buckets: tuple[int, ...] = (8, 16, 32)
  # Prompt tokens prefilled per engine step, summed over requests (at least the largest chunk).
  prefill_token_budget: int = 64
  # Static block-table width: the most pages one sequence may hold.
  max_pages_per_seq: int = 16
  # Run the batched page-tag check before every step reads the cache (off only for overhead ablations).
  integrity_check: bool = True
  # Audit page conservation (free + held + quarantined = all, refcounts = table entries) around
  # every step; violating pages are quarantined and their holders aborted (off only for ablations).
  page_audit: bool = True
  # Kernel backend of every kernel the engine's steps run (attention, the int4
  # matmuls, the tag check): "pallas" | "interpret" | "xla" | None (platform
  # default). The serving paths also quantise into the int4 layout it reads
  # (mlkit.quant.kernel_int4_layout).
  backend: str | None = None
  # Free pages that must remain after admitting a request, so running requests can still grow.
  admission_reserve: int = 1
  # Ended requests the engine keeps for get() after their results were handed out (the most
  # recent ones); older ones leave, so memory follows what is live, not what was served.
  retain_finished: int = 1024
  # Engine steps a quarantined page stays out after its last holder is gone before it heals
  # back onto the free list with a fresh tag (None: never; docs/integrity.md).
  quarantine_grace_steps: int | None = 64
  # Let tests corrupt the allocator through mlkit.engine.faults (off in serving).
  enable_fault_injection: bool = False
  # Also return each step's sampled-position logits (host copy per step; for accuracy tests only).
  record_logits: bool = False
  # Top log-probabilities each step computes per row (0: none; a request may ask for up to
  # this many through SamplingParams.logprobs). Computed from the raw logits on device.
  logprobs: int = 0
  # Dispatch step N+1 before collecting step N, so host scheduling and bookkeeping overlap
  # the device (same tokens; a stop is seen one step late and its extra row dropped).
  overlap: bool = False
  # Keep the KV pages of finished prompts and sequences in a radix prefix cache and start a
  # request's prefill after the longest cached prefix (docs/prefix_cache.md).
  prefix_cache: bool = False
  # Write engine metrics to the log every this many steps (0: never).
  log_every: int = 0
  # Speculative decoding: tokens the model's first multi-token-prediction layer drafts per
  # request and step, verified by one target pass over k + 1 positions (0: off;
  # docs/speculative.md). Each sequence keeps 2k - 1 positions of look-ahead room.
  speculative_tokens: int = 0

  def __post_init__(self):
    if not isinstance(self.model, ModelConfig):
      raise ValueError(f"EngineConfig.model must be a ModelConfig, got {type(self.model).__name__}")
    if not isinstance(self.kv, KVCacheConfig):
      raise ValueError(f"EngineConfig.kv must be a KVCacheConfig, got {type(self.kv).__name__}")
    for name in ("max_running", "prefill_token_budget", "max_pages_per_seq"):
      if not _pos_int(getattr(self, name)):
        raise ValueError(f"EngineConfig.{name} must be a positive int, got {getattr(self, name)!r}")
    for name in ("batch_buckets", "prefill_buckets"):
      b = tuple(getattr(self, name))
      if not b or not all(_pos_int(x) for x in b) or list(b) != sorted(set(b)):
        raise ValueError(f"EngineConfig.{name} must be strictly ascending positive ints, got {b!r}")
      object.__setattr__(self, name, b)
    if self.max_running > self.batch_buckets[-1]:
      raise ValueError(f"EngineConfig.max_running ({self.max_running}) exceeds the largest "
                       f"batch bucket ({self.batch_buckets[-1]})")
    if self.prefill_token_budget < self.prefill_buckets[-1]:
      raise ValueError(f"EngineConfig.prefill_token_budget ({self.prefill_token_budget}) must be at "
                       f"least the largest prefill bucket ({self.prefill_buckets[-1]})")
    for name in ("integrity_check", "page_audit", "enable_fault_injection", "record_logits",
                 "overlap", "prefix_cache"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
    if self.backend is not None and self.backend not in dispatch.BACKENDS:
      raise ValueError(f"EngineConfig.backend must be one of {dispatch.BACKENDS} or None, "
                       f"got {self.backend!r}")
    if not isinstance(self.admission_reserve, int) or self.admission_reserve < 0:
      raise ValueError(f"EngineConfig.admission_reserve must be a non-negative int, "
                       f"got {self.admission_reserve!r}")
    from mlkit.sampling import MAX_LOGPROBS
    if (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
        or not 0 <= self.logprobs <= MAX_LOGPROBS):
      raise ValueError(f"EngineConfig.logprobs must be an int in [0, {MAX_LOGPROBS}], "
                       f"got {self.logprobs!r}")
    if not isinstance(self.retain_finished, int) or self.retain_finished < 0:
      raise ValueError(f"EngineConfig.retain_finished must be a non-negative int, "
                       f"got {self.retain_finished!r}")
    g = self.quarantine_grace_steps
    if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 0):
      raise ValueError(f"EngineConfig.quarantine_grace_steps must be a non-negative int or None, "
                       f"got {g!r}")
    if not isinstance(self.log_every, int) or self.log_every < 0:
      raise ValueError(f"EngineConfig.log_every must be a non-negative int, got {self.log_every!r}")
    k = self.speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
      raise ValueError(f"EngineConfig.speculative_tokens must be a non-negative int, got {k!r}")
    if k:
      if self.model.n_mtp_layers < 1:
        raise ValueError(f"EngineConfig.speculative_tokens={k} needs a model with "
                         f"multi-token-prediction layers; {self.model.name!r} has none "
                         "(ModelConfig.n_mtp_layers=0)")
      if self.model.sparse_attention:
        raise ValueError("EngineConfig.speculative_tokens: speculative decoding on a "
                         "sparse-attention model is not built yet")
    # Resolve the page size now so every shape below is concrete.
    object.__setattr__(self, "kv", self.kv.resolve(self.model))

  @property
  def page_size(self) -> int:
    """Tokens per KV page."""
    return self.kv.page_size

  @property
  def lookahead(self) -> int:
    """Positions past a sequence's tokens that its pages must hold for a step: a verify
    step writes k drafts, and the drafter k - 1 positions past the last accepted one."""
    k = self.speculative_tokens
    return 2 * k - 1 if k else 0

  @property
  def max_seq_tokens(self) -> int:
    """The longest sequence (prompt + output) one request may reach."""
    return min(self.model.max_seq_len, self.max_pages_per_seq * self.page_size,
               self.kv.num_pages * self.page_size) - self.lookahead

  def batch_bucket(self, n: int) -> int:
    """The smallest batch bucket >= n (n <= the largest bucket)."""
    for b in self.batch_buckets:
      if b >= n:
        return b
    raise ValueError(f"batch of {n} exceeds the largest bucket {self.batch_buckets[-1]}")

  def prefill_bucket(self, n: int) -> int:
    """The smallest prefill chunk bucket >= n (n <= the largest bucket)."""
    for b in self.prefill_buckets:
      if b >= n:
        return b
    raise ValueError(f"chunk of {n} exceeds the largest prefill bucket {self.prefill_buckets[-1]}")
