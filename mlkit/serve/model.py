"""What one serving process serves: the model, its params and its Engine's shape.

A :class:`ServeConfig` names the model (a checkpoint directory, or a named
preset from ``configs.models`` with random params for demos and tests), the
weight recipe, and the KV pool. :func:`load_model` reads or draws the params;
:func:`build_engine` places them and the pool on the process's local devices.
"""

from __future__ import annotations

import dataclasses
import os

from mlkit.config import ModelConfig
from mlkit.engine import lockstep

ROLES = ("prefill", "decode", "colocated")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """One server process's model and pool.

  Raises:
    ValueError: naming the field: no model or two, an unknown role, preset,
      recipe or KV dtype, non-positive sizes.
  """

  role: str
  # A checkpoint directory (orbax, from mlkit.checkpoint.save_checkpoint, or Hugging Face:
  # config.json + *.safetensors) ...
  checkpoint: str | None = None
  # ... or a preset name from configs.models (random params drawn from ``seed``).
  model: str | None = None
  seed: int = 0
  # Presets only: keep the first n layers (small demos and tests compile faster).
  n_layers: int | None = None
  # Weight recipe (mlkit.quant.RECIPES) and KV storage dtype of this process's pool.
  recipe: str = "bf16"
  kv_dtype: str = "float32"
  page_size: int | None = None
  num_pages: int = 64
  max_running: int = 4
  max_pages_per_seq: int = 16
  prefill_chunk: int = 16
  # Host devices of this process, all on the tensor axis (a CPU process makes this many).
  devices: int = 1
  enable_fault_injection: bool = False
  # Top log-probabilities each step computes (a request may ask for up to this many; 0: none).
  max_logprobs: int = 20
  # Dispatch step N+1 before collecting step N (EngineConfig.overlap): the host's work, the
  # HTTP front door's included, runs while the device computes. Colocated role only.
  overlap: bool = False
  # Batch sizes a step may pad to, ascending (default: max_running only, the fewest
  # compiles). More buckets make a lone request's step as small as it is.
  batch_buckets: tuple[int, ...] | None = None
  # Speculative decoding: tokens the MTP layer drafts per request and step
  # (EngineConfig.speculative_tokens; 0: off). Both servers of a pair set the same.
  speculative_tokens: int = 0

  def __post_init__(self):
    from mlkit.quant import RECIPES
    if self.role not in ROLES:
      raise ValueError(f"ServeConfig.role must be one of {ROLES}, got {self.role!r}")
    if (self.checkpoint is None) == (self.model is None):
      raise ValueError("ServeConfig needs exactly one of checkpoint (a directory) and model "
                       f"(a preset name), got checkpoint={self.checkpoint!r}, model={self.model!r}")
    if self.model is not None:
      from configs.models import MODEL_PRESETS
      if self.model not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {self.model!r}; choose one of "
                         f"{sorted(MODEL_PRESETS)} or pass a checkpoint directory")
    if self.recipe not in RECIPES:
      raise ValueError(f"ServeConfig.recipe must be one of {sorted(RECIPES)}, got {self.recipe!r}")
    if self.kv_dtype not in ("float32", "bfloat16", "float8_e4m3fn"):
      raise ValueError(f"ServeConfig.kv_dtype must be float32, bfloat16 or float8_e4m3fn, "
                       f"got {self.kv_dtype!r}")
    for name in ("num_pages", "max_running", "max_pages_per_seq", "prefill_chunk", "devices"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"ServeConfig.{name} must be a positive int, got {v!r}")
    if self.overlap and self.role != "colocated":
      raise ValueError("ServeConfig.overlap is for the colocated role (a decode server lands "
                       "KV between steps; a prefill server hands requests over)")
    if self.n_layers is not None and (not isinstance(self.n_layers, int) or self.n_layers < 1):
      raise ValueError(f"ServeConfig.n_layers must be a positive int or None, got {self.n_layers!r}")
    k = self.speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
      raise ValueError(f"ServeConfig.speculative_tokens (--speculative-tokens) must be a "
                       f"non-negative int, got {k!r}")

  @property
  def model_name(self) -> str:
    return self.model if self.model is not None else os.path.basename(os.path.normpath(self.checkpoint))


def _is_hf_dir(path: str) -> bool:
  names = os.listdir(path)
  return "config.json" in names and any(n.endswith(".safetensors") for n in names)


def load_model(cfg: ServeConfig) -> tuple[dict, ModelConfig]:
  """The params (a quantised checkpoint in its stored formats) and the ModelConfig a
  ServeConfig names.

  Raises:
    FileNotFoundError: the checkpoint directory does not exist.
    ValueError: (``mlkit.checkpoint.CheckpointError`` among them) the directory
      is not a readable orbax or Hugging Face checkpoint.
  """
  if cfg.checkpoint is not None:
    path = os.path.abspath(cfg.checkpoint)
    if not os.path.isdir(path):
      raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    from mlkit import checkpoint
    from mlkit.quant import kernel_int4_layout
    # An already-quantised checkpoint (a published INT4 or FP8 one, or orbax) restores
    # straight into the layout the engine's int4 kernels read (its EngineConfig keeps the
    # platform's default backend), one leaf at a time; build_engine's apply_recipe then
    # keeps it as it is.
    if _is_hf_dir(path):
      return checkpoint.load_hf_checkpoint(path, int4_layout=kernel_int4_layout(None))
    return checkpoint.load_checkpoint(path, int4_layout=kernel_int4_layout(None))
  import jax
  from configs.models import MODEL_PRESETS
  from mlkit.model import init_params
  mcfg = MODEL_PRESETS[cfg.model]
  if cfg.n_layers is not None:
    mcfg = mcfg.first_layers(cfg.n_layers)
  # With speculation the preset's MTP layers are drawn too (the main weights are the same).
  return (init_params(mcfg, jax.random.PRNGKey(cfg.seed),
                      mtp=() if cfg.speculative_tokens else None), mcfg)


def engine_config(cfg: ServeConfig, mcfg: ModelConfig):
  """The EngineConfig of one process's pool (one batch bucket and one prefill bucket: few compiles)."""
  from mlkit.engine import EngineConfig
  from mlkit.kvcache import KVCacheConfig
  return EngineConfig(model=mcfg, kv=KVCacheConfig(cfg.num_pages, cfg.page_size, cfg.kv_dtype),
                      max_running=cfg.max_running,
                      batch_buckets=cfg.batch_buckets or (cfg.max_running,),
                      prefill_buckets=(cfg.prefill_chunk,),
                      prefill_token_budget=cfg.prefill_chunk * cfg.max_running,
                      max_pages_per_seq=cfg.max_pages_per_seq,
                      enable_fault_injection=cfg.enable_fault_injection,
                      logprobs=cfg.max_logprobs, overlap=cfg.overlap,
                      speculative_tokens=cfg.speculative_tokens)


def build_engine(cfg: ServeConfig, params, mcfg: ModelConfig):
  """The process's Engine on its local devices, or on every process's devices when the pool
  spans processes (``jax.distributed`` initialised); role "prefill" for a prefill server."""
  import jax
  from mlkit.engine import Engine
  from mlkit.parallel import MeshConfig, split_mesh
  from mlkit.quant import RECIPES, apply_recipe, kernel_int4_layout
  if jax.process_count() > 1:  # one pool over every process's devices (docs/serving_processes.md)
    (mesh,) = split_mesh([MeshConfig(tensor=len(jax.devices()))], list(jax.devices()))
  else:
    (mesh,) = split_mesh([MeshConfig(tensor=cfg.devices)], list(jax.devices())[:cfg.devices])
  ecfg = engine_config(cfg, mcfg)
  # int4 weights in the layout the engine's kernels read (docs/int4_matmul.md). A checkpoint
  # loaded in its published formats keeps them unless the recipe converts (FP8 -> INT4
  # experts) or refuses (INT4 -> FP8); docs/checkpoints.md.
  qparams = apply_recipe(params, RECIPES[cfg.recipe],
                         int4_layout=kernel_int4_layout(ecfg.backend))
  return Engine(qparams, ecfg, mesh=mesh,
                role="prefill" if cfg.role == "prefill" else "serve")


def warm_up_colocated(engine) -> float:
  """Compiles a colocated engine's steps at every batch bucket; returns seconds.

  One dummy batch per bucket: its prefill step and its decode steps run at that
  bucket's size, so no request later waits for a compile, whatever the batch it
  lands in. Nothing stays behind: the dummy requests end, their pages are free.
  """
  import time

  from mlkit.sampling import SamplingParams
  t0 = time.perf_counter()
  n = min(engine.config.prefill_buckets[-1], engine.config.max_seq_tokens - 3)
  for b in engine.config.batch_buckets:
    engine.generate([[0] * n] * b, SamplingParams(max_new_tokens=3))
  return time.perf_counter() - t0


def warm_up(engine) -> float:
  """Compiles the process's steps and transfer halves on one dummy request; returns seconds.

  Without it the first requests pay every compile, which a decode server's
  prefill timeout would count against its peer. The dummy request's pages are
  free again afterwards.
  """
  import time

  from mlkit.engine.request import Request
  from mlkit.sampling import SamplingParams
  t0 = time.perf_counter()
  n = min(engine.config.prefill_buckets[-1], engine.config.max_seq_tokens - 2)
  prompt = [0] * n
  sampling = SamplingParams(max_new_tokens=2)
  if engine.role == "prefill":
    rid = engine.submit(prompt, sampling)
    while not engine.prefilled() and engine.has_unfinished():
      engine.step()
    engine.extract(engine.kv_pages(rid), n)
    engine.hand_over(rid)
    return time.perf_counter() - t0

  # Lands the pool's own (zero) KV: the decode-side halves compile.
  fill = lockstep.Fill(_warm_up_fill, (n,))
  req = Request(request_id=-1, prompt=tuple(prompt), sampling=sampling,
                arrival_time=time.perf_counter(), prefill_tokens=tuple(prompt))
  req.emit(0, time.perf_counter())
  if engine.adopt(req, n, fill):
    while engine.has_unfinished():
      engine.step()
  engine.forget(-1)  # not a request anyone sent
  return time.perf_counter() - t0


def _warm_up_fill_args(lim):
  from mlkit.wire.schema import Tuple
  return Tuple((lim.pages(), lim.tokens(), lim.tokens()))


@lockstep.pool_call(_warm_up_fill_args)
def _warm_up_fill(state, pages, start, n):
  """The warm-up's adopt fill: extracts the pool's own pages and lands them back (a
  registered pool call, so that the processes of a pool spread over processes run it)."""
  from mlkit.engine.transfer import extract_payload, land_payload
  ex = extract_payload(state, pages, n)
  state, res = land_payload(state, pages, ex.payload, ex.checksum, n, start=start)
  return state, (res.ok, res.reason or "")
