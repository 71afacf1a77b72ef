"""The training loop: AdamW with warm-up + cosine, clipping, bf16 compute over f32
master weights, MoE load balancing, orbax checkpoints with resume, and a loss plot.

The train state is a plain pytree ``{"params", "opt_state", "step"}``. One
optimizer step is one jitted call (:func:`train_step`). The data for step ``s``
comes from ``batch_fn(s)``, so a resumed run sees exactly the batches an
uninterrupted one would, and its next step is the same.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from mlkit.config import ModelConfig
from mlkit.model import apply, init_params, mtp_forward_all, segment_positions
from mlkit.model.params import init_mtp_params
from mlkit.train.config import TrainConfig
from mlkit.train.experts import dropped_fraction, wrap_experts

# step -> (tokens [B, T], weights [B, T]) or (tokens, weights, segment_ids [B, T]).
BatchFn = Callable[[int], tuple[np.ndarray, ...]]


def compute_config(cfg: ModelConfig, tcfg: TrainConfig) -> ModelConfig:
  """The model config training runs: ``tcfg.compute_dtype`` activations, f32 parameters."""
  return dataclasses.replace(cfg, dtype=tcfg.compute_dtype, param_dtype="float32")


def lr_schedule(tcfg: TrainConfig) -> optax.Schedule:
  """Linear warm-up to the peak, then cosine decay to ``min_lr_ratio * peak`` at ``steps``."""
  warm = min(tcfg.warmup_steps, tcfg.steps - 1) if tcfg.steps > 1 else 0
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tcfg.learning_rate, warmup_steps=warm,
      decay_steps=max(tcfg.steps, warm + 1), end_value=tcfg.learning_rate * tcfg.min_lr_ratio)


def _decay_mask(params):
  # Decay matrices only: norms and the router bias are 1-D and must not shrink to 0.
  return jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping followed by AdamW on the schedule of :func:`lr_schedule`."""
  return optax.chain(
      optax.clip_by_global_norm(tcfg.clip_norm),
      optax.adamw(lr_schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, weight_decay=tcfg.weight_decay,
                  mask=_decay_mask))


def trains_mtp(cfg: ModelConfig, tcfg: TrainConfig) -> bool:
  """Whether training adds the multi-token-prediction loss (and holds the MTP layers)."""
  return bool(cfg.n_mtp_layers and tcfg.mtp_loss_weight > 0)


def init_train_state(cfg: ModelConfig, tcfg: TrainConfig, params=None) -> dict:
  """A fresh train state: f32 params (from ``init_params`` unless given), optimizer state, step 0.

  When training runs the MTP loss (:func:`trains_mtp`) the params get ``cfg.n_mtp_layers``
  fresh MTP layers (sharing the main embedding and head) unless they hold some; the main
  model's params are the same either way.
  """
  ccfg = compute_config(cfg, tcfg)
  key = jax.random.key(tcfg.seed)
  mtp = trains_mtp(cfg, tcfg)
  if params is None:
    params = init_params(ccfg, key, mtp=() if mtp else None)
  elif mtp and "mtp" not in params:
    params = dict(params, mtp=init_mtp_params(ccfg, key))
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
  return {"params": params, "opt_state": make_optimizer(tcfg).init(params),
          "step": jnp.zeros((), jnp.int32)}


def _is_router_bias(path) -> bool:
  return any(isinstance(k, jax.tree_util.DictKey) and k.key == "router_bias" for k in path)


def loss_fn(params, tokens: jax.Array, weights: jax.Array, segment_ids: jax.Array | None = None, *,
            cfg: ModelConfig, tcfg: TrainConfig):
  """Weighted next-token cross entropy plus (for balance="aux") the balance loss, plus the
  multi-token-prediction loss.

  The MTP loss (when ``tcfg.mtp_loss_weight`` > 0 and ``params`` hold ``mtp`` layers):
  depth k at input position i predicts t_{i+k+1}; its cross entropy is averaged over the
  positions whose target exists, has weight and lies in the same segment, then over the
  depths, and added times ``mtp_loss_weight`` (DeepSeek-V3's lambda). The balance loss
  counts the main model's MoE layers only.

  Args:
    params: f32 params.
    tokens: [B, T] int32 rows; the model reads tokens[:, :-1] and predicts tokens[:, 1:].
    weights: [B, T] f32 loss weight of predicting each token (0 for PAD and BOS).
    segment_ids: optional [B, T] int: rows packed from independent sequences; each token
      attends only within its segment, at positions counted from the segment's start, as
      each sequence would be served alone.
    cfg: the compute config (see :func:`compute_config`).
    tcfg: the train config.

  Returns:
    (total loss, metrics dict of scalars and ``expert_load`` [n_moe_layers, E]; with the
    MTP loss also ``mtp_loss`` and ``mtp_expert_load`` [n_mtp_layers, E]).
  """
  inputs, targets, w = tokens[:, :-1], tokens[:, 1:], weights[:, 1:]
  segs = None if segment_ids is None else segment_ids[:, :-1]
  positions = (jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
               if segs is None else segment_positions(segs))
  if tcfg.capacity_factor is not None:
    params = wrap_experts(params, tcfg.capacity_factor)
  run_mtp = tcfg.mtp_loss_weight > 0 and bool(params.get("mtp"))
  if run_mtp:
    logits, _, aux, pre_norm = apply(params, inputs, positions, None, cfg=cfg, return_aux=True,
                                     segment_ids=segs, return_pre_norm=True)  # [B, T-1, V]
  else:
    logits, _, aux = apply(params, inputs, positions, None, cfg=cfg, return_aux=True,
                           segment_ids=segs)  # [B, T-1, V]
  ce = _weighted_ce(logits, targets, w)
  load, prob = aux["expert_load"], aux["router_prob"]  # [L, E] each
  if cfg.n_moe_layers:
    E = cfg.n_routed_experts
    # Switch/DeepSeek balance loss: E * sum_i f_i * P_i, 1 when perfectly balanced.
    balance = jnp.mean(E * jnp.sum(load * prob, axis=-1))
  else:
    balance = jnp.zeros(())
  total = ce + (tcfg.aux_loss_weight * balance if tcfg.balance == "aux" else 0.0)
  metrics = {"loss": ce, "balance_loss": balance, "expert_load": load}
  if run_mtp:
    mtp_logits, mtp_aux = mtp_forward_all(params, pre_norm, inputs, cfg=cfg, positions=positions,
                                          segment_ids=segs, return_aux=True)  # [K, B, T-1, V]
    T = inputs.shape[1]
    losses = []
    for k in range(1, mtp_logits.shape[0] + 1):
      # Depth k at position i predicts tokens[:, i + k + 1] = targets[:, i + k].
      tk = jnp.pad(targets[:, k:], ((0, 0), (0, min(k, T))))  # [B, T-1]
      wk = jnp.pad(w[:, k:], ((0, 0), (0, min(k, T))))
      if segs is not None:  # the target must belong to the position's own sequence
        seg_t = jnp.pad(segment_ids[:, 1:][:, k:], ((0, 0), (0, min(k, T))), constant_values=-1)
        wk = wk * (seg_t == segs)
      losses.append(_weighted_ce(mtp_logits[k - 1], tk, wk))
    mtp_loss = jnp.mean(jnp.stack(losses))
    total = total + tcfg.mtp_loss_weight * mtp_loss
    metrics.update(mtp_loss=mtp_loss, mtp_expert_load=mtp_aux["expert_load"])
  return total, metrics


def _weighted_ce(logits: jax.Array, targets: jax.Array, w: jax.Array) -> jax.Array:
  """Cross entropy of logits [B, T, V] against targets [B, T], weighted by w [B, T]."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [B, T]
  return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1e-6)


def update_router_bias(params, expert_load: jax.Array, cfg: ModelConfig, rate: float):
  """DeepSeek-V3's auxiliary-loss-free update: b_i += rate * sign(mean load - load_i).

  Overloaded experts become less likely to be chosen and underloaded ones more;
  the combine weights never see the bias, so the model's function is unchanged
  except through which experts are selected.

  Args:
    params: the params tree (sigmoid-router MoE layers hold ``ffn/router_bias`` [E]).
    expert_load: [n_moe_layers, E] assignment fractions of this batch.
    cfg: the model config.
    rate: the bias step.

  Returns:
    The params with updated biases (other leaves untouched).
  """
  if cfg.router != "sigmoid" or not cfg.n_moe_layers:
    return params
  layers = list(params["layers"])
  j = 0
  for i in range(cfg.n_layers):
    if not cfg.is_moe_layer(i):
      continue
    load = expert_load[j]
    j += 1
    ffn = dict(layers[i]["ffn"])
    ffn["router_bias"] = ffn["router_bias"] + rate * jnp.sign(jnp.mean(load) - load)
    layers[i] = dict(layers[i], ffn=ffn)
  return dict(params, layers=layers)


def _update_mtp_router_bias(params, expert_load: jax.Array, cfg: ModelConfig, rate: float):
  """:func:`update_router_bias` for the MTP layers (expert_load [n_mtp_layers, E])."""
  if cfg.router != "sigmoid" or not expert_load.size:
    return params
  mtp = []
  for j, lp in enumerate(params["mtp"]):
    load = expert_load[j]
    ffn = dict(lp["ffn"], router_bias=lp["ffn"]["router_bias"] + rate * jnp.sign(jnp.mean(load) - load))
    mtp.append(dict(lp, ffn=ffn))
  return dict(params, mtp=mtp)


@functools.partial(jax.jit, static_argnames=("cfg", "tcfg"), donate_argnames=("state",))
def train_step(state: dict, tokens: jax.Array, weights: jax.Array,
               segment_ids: jax.Array | None = None, *, cfg: ModelConfig, tcfg: TrainConfig):
  """One optimizer step.

  Args:
    state: {"params", "opt_state", "step"} (donated).
    tokens: [B, T] int32.
    weights: [B, T] f32.
    segment_ids: optional [B, T] int32 (see :func:`loss_fn`).
    cfg: the compute config; tcfg: the train config.

  Returns:
    (new state, metrics): loss, balance_loss, grad_norm, lr, max_load (max over
    experts of load * E, averaged over layers; 1 is perfect balance), dropped
    (fraction of expert assignments over slab capacity), and mtp_loss when the
    multi-token-prediction loss runs (see :func:`loss_fn`).
  """
  params = state["params"]
  (_, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, weights, segment_ids,
                                                            cfg=cfg, tcfg=tcfg)
  # The router bias only picks experts (through top-k): it is updated by the bias rule, never by
  # the optimizer. Its gradient is zero anyway; zeroing it makes that explicit.
  grads = jax.tree_util.tree_map_with_path(
      lambda p, g: jnp.zeros_like(g) if _is_router_bias(p) else g, grads)
  grad_norm = optax.tree.norm(grads)
  updates, opt_state = make_optimizer(tcfg).update(grads, state["opt_state"], params)
  params = optax.apply_updates(params, updates)
  load = m["expert_load"]
  if tcfg.balance == "bias":
    params = update_router_bias(params, load, cfg, tcfg.bias_update_rate)
    if "mtp_expert_load" in m:
      params = _update_mtp_router_bias(params, m["mtp_expert_load"], cfg, tcfg.bias_update_rate)
  n_tok = tokens.shape[0] * (tokens.shape[1] - 1)
  metrics = {
      "loss": m["loss"], "balance_loss": m["balance_loss"], "grad_norm": grad_norm,
      "lr": lr_schedule(tcfg)(state["step"]),
      "max_load": (jnp.mean(jnp.max(load, axis=-1)) * load.shape[-1]) if load.size else jnp.ones(()),
      "dropped": (dropped_fraction(load, cfg.top_k, n_tok, tcfg.capacity_factor)
                  if load.size and tcfg.capacity_factor is not None else jnp.zeros(())),
  }
  if "mtp_loss" in m:
    metrics["mtp_loss"] = m["mtp_loss"]
  return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_manager(directory: str) -> ocp.CheckpointManager:
  """An orbax manager for train states under ``directory`` (keeps the 2 latest steps)."""
  return ocp.CheckpointManager(
      os.path.abspath(directory), item_names=("state", "meta"),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def save_train_state(mgr: ocp.CheckpointManager, state: dict, history: list[dict]) -> None:
  """Saves the state and the metrics history at ``state["step"]`` and waits for it to commit."""
  step = int(state["step"])
  mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         meta=ocp.args.JsonSave({"history": history})))
  mgr.wait_until_finished()


def restore_train_state(mgr: ocp.CheckpointManager, template: dict, step: int | None = None
                        ) -> tuple[dict, list[dict]] | None:
  """The (state, history) of ``step`` (default the latest), or None when there is none.

  Args:
    mgr: the manager.
    template: a train state of the same structure (e.g. :func:`init_train_state`).
    step: which step to restore.
  """
  step = mgr.latest_step() if step is None else step
  if step is None:
    return None
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template)
  out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                  meta=ocp.args.JsonRestore()))
  return out["state"], list(out["meta"]["history"])


# ----------------------------------------------------------------------------- the loop

@dataclasses.dataclass
class TrainResult:
  """What :func:`train` returns.

  Attributes:
    params: the final f32 params.
    state: the final train state.
    history: one dict per logged step (step, loss, lr, grad_norm, max_load, dropped, seconds).
    resumed_from: the step a checkpoint resumed from (None for a fresh run).
    seconds: wall time of this call's steps (excluding compilation of the first).
  """

  params: dict
  state: dict
  history: list
  resumed_from: int | None
  seconds: float


def train(cfg: ModelConfig, tcfg: TrainConfig, batch_fn: BatchFn, *,
          checkpoint_dir: str | None = None, progress: Callable[[str], None] | None = print,
          stop_at: int | None = None, init=None,
          on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
  """Trains ``cfg`` for ``tcfg.steps`` steps, resuming from ``checkpoint_dir`` if it holds one.

  Args:
    cfg: the model config (its dtypes are replaced, see :func:`compute_config`).
    tcfg: the train config.
    batch_fn: step -> (tokens [B, T] int32, weights [B, T] f32), optionally with
      segment_ids [B, T] int32 third (packed independent sequences, see :func:`loss_fn`);
      must be a pure function of the step so that resumes are exact.
    checkpoint_dir: where orbax checkpoints go (None: no checkpoints).
    progress: called with a progress line every ``tcfg.log_every`` steps (None: silent).
    stop_at: stop after this step (as if interrupted), keeping the schedule of ``tcfg.steps``.
    init: optional initial params (default: ``init_params`` with ``tcfg.seed``).
    on_step: called as ``on_step(step, params)`` after every step (e.g. to evaluate
      mid-run); it must finish with ``params`` before returning (the next step donates them).

  Returns:
    A TrainResult.

  Raises:
    ValueError: a batch of the wrong shape.
  """
  ccfg = compute_config(cfg, tcfg)
  state = init_train_state(cfg, tcfg, init)
  history: list[dict] = []
  resumed = None
  mgr = checkpoint_manager(checkpoint_dir) if checkpoint_dir else None
  if mgr is not None:
    got = restore_train_state(mgr, state)
    if got is not None:
      state, history = got
      resumed = int(state["step"])
      if progress:
        progress(f"train: resumed from step {resumed} in {checkpoint_dir}")
  # One placement for a fresh and a restored state: orbax restores committed arrays where
  # init_train_state leaves them uncommitted, and jit compiles the step once per placement.
  state = jax.device_put(state, jax.devices()[0])
  last = tcfg.steps if stop_at is None else min(stop_at, tcfg.steps)
  t_start, t_first = time.perf_counter(), None
  step = int(state["step"])
  while step < last:
    batch = batch_fn(step)
    if len(batch) not in (2, 3):
      raise ValueError(f"train: batch_fn({step}) gave {len(batch)} arrays; expected (tokens, "
                       f"weights) or (tokens, weights, segment_ids)")
    tokens, weights, segs = (*batch, None)[:3]
    shapes = [tokens.shape, weights.shape] + ([] if segs is None else [segs.shape])
    if any(s != (tcfg.batch_size, tcfg.seq_len) for s in shapes):
      raise ValueError(f"train: batch_fn({step}) gave shapes {shapes}; expected "
                       f"({tcfg.batch_size}, {tcfg.seq_len}) for each")
    state, m = train_step(state, jnp.asarray(tokens), jnp.asarray(weights),
                          None if segs is None else jnp.asarray(segs, jnp.int32), cfg=ccfg,
                          tcfg=tcfg)
    step += 1
    if on_step is not None:
      on_step(step, state["params"])
    log_now = tcfg.log_every and (step % tcfg.log_every == 0 or step == last or step == 1)
    if log_now:
      m = {k: float(v) for k, v in jax.device_get(m).items()}
      now = time.perf_counter()
      if t_first is None:
        t_first = now  # the first logged step includes compilation
      m.update(step=step, seconds=now - t_start)
      history.append(m)
      if progress:
        mtp = f" mtp {m['mtp_loss']:.4f}" if "mtp_loss" in m else ""
        progress(f"train: step {step}/{tcfg.steps} loss {m['loss']:.4f}{mtp} lr {m['lr']:.2e} "
                 f"|g| {m['grad_norm']:.2f} max-load {m['max_load']:.2f} "
                 f"dropped {100 * m['dropped']:.2f}% ({m['seconds']:.0f} s)")
    if mgr is not None and tcfg.checkpoint_every and step % tcfg.checkpoint_every == 0:
      save_train_state(mgr, state, history)
  if mgr is not None and (mgr.latest_step() or 0) < step:
    save_train_state(mgr, state, history)
  if mgr is not None:
    mgr.close()
  jax.block_until_ready(state)
  seconds = time.perf_counter() - (t_first or t_start)
  return TrainResult(params=state["params"], state=state, history=history, resumed_from=resumed,
                     seconds=seconds)


def plot_loss(history: list[dict], path: str, title: str = "training loss") -> str:
  """Writes the loss curve (log-scale loss and the learning rate vs step) to a PNG at ``path``."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  steps = [h["step"] for h in history]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(steps, [h["loss"] for h in history], "-o", ms=2, label="loss (weighted CE)")
  if history and all("mtp_loss" in h for h in history):
    ax.plot(steps, [h["mtp_loss"] for h in history], "-", lw=1, label="MTP loss")
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax2 = ax.twinx()
  ax2.plot(steps, [h["lr"] for h in history], color="gray", lw=1, alpha=0.6, label="lr")
  ax2.set_ylabel("learning rate")
  ax.set_title(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
