"""Orbax checkpoints of a params pytree plus its ``ModelConfig``.

Layout of one checkpoint directory (written by orbax, finalised atomically)::

  <path>/params   the params pytree (StandardCheckpointHandler, OCDBT/tensorstore)
  <path>/mlkit    JSON: {"format": "mlkit", "version": 1, "step": int | None, "config": {...}}

Orbax writes into ``<path>.orbax-checkpoint-tmp-*`` and renames it to ``<path>`` only
after every item is committed, so an interrupted save never leaves a directory that
:func:`load_checkpoint` accepts. With ``step=`` the checkpoint goes to ``<path>/<step>``
(orbax ``CheckpointManager``'s naming), and loading ``<path>`` picks the latest step.

Quantised weights: leaves may be ``flax.struct`` dataclasses (``Int4Weight`` etc.).
Orbax stores their array fields as nested dicts and drops static fields (e.g.
``group_size``), so restoring them needs ``target=``: a pytree of the caller's
structure (arrays or ``jax.ShapeDtypeStruct``; static fields come from it).
Without ``target`` the expected structure is the plain layout of ``param_specs(cfg)``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from mlkit.config import ModelConfig
from mlkit.model.params import param_specs

_FORMAT = "mlkit"
_VERSION = 1
_PARAMS = "params"
_META = "mlkit"


def _path_str(path) -> str:
  """Key path -> "layers.1.attn.wq_a" (dict keys, list indices and dataclass fields alike)."""
  parts = []
  for k in path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    elif isinstance(k, jax.tree_util.FlattenedIndexKey):
      parts.append(str(k.key))
    else:
      parts.append(str(k))
  return ".".join(parts)


def _flat(tree, is_leaf=None) -> dict[str, Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return {_path_str(p): leaf for p, leaf in leaves}


def _checkpointer() -> ocp.Checkpointer:
  # Handlers named up front so that metadata() can read items before any restore.
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**{
      _PARAMS: ocp.StandardCheckpointHandler(), _META: ocp.JsonCheckpointHandler()}))


def _is_complete_checkpoint(path: str) -> bool:
  return (os.path.isdir(path) and not ocp.utils.is_tmp_checkpoint(path)
          and ocp.utils.is_checkpoint_finalized(path)
          and os.path.isdir(os.path.join(path, _META)) and os.path.isdir(os.path.join(path, _PARAMS)))


def checkpoint_steps(path: str | os.PathLike) -> list[int]:
  """Steps of the complete checkpoints saved under ``path`` with ``step=``, ascending."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    return []
  return sorted(int(n) for n in os.listdir(path)
                if n.isdigit() and _is_complete_checkpoint(os.path.join(path, n)))


def save_checkpoint(path: str | os.PathLike, params, cfg: ModelConfig, *, step: int | None = None,
                    overwrite: bool = False) -> str:
  """Saves params and their config with orbax.

  Args:
    path: checkpoint directory (its parent is created if missing).
    params: the params pytree; leaves may be arrays or ``flax.struct`` weight dataclasses.
    cfg: the model config, stored as JSON beside the params.
    step: if given, the checkpoint is written to ``<path>/<step>`` and the step is recorded.
    overwrite: replace an existing checkpoint at the destination (otherwise an error).

  Returns:
    The directory the checkpoint was written to.

  Raises:
    FileExistsError: the destination exists and ``overwrite`` is False.
    ValueError: ``step`` is negative or ``cfg`` is not a ``ModelConfig``.
  """
  if not isinstance(cfg, ModelConfig):
    raise ValueError(f"save_checkpoint: cfg must be a ModelConfig, got {type(cfg).__name__}")
  path = os.path.abspath(os.fspath(path))
  if step is not None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise ValueError(f"save_checkpoint: step must be a non-negative int, got {step!r}")
    path = os.path.join(path, str(step))
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"save_checkpoint: {path} already exists (pass overwrite=True to replace it)")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  meta = {"format": _FORMAT, "version": _VERSION, "step": step, "config": cfg.to_dict()}
  # Synchronous Checkpointer: returns only after orbax has renamed the tmp dir into place.
  _checkpointer().save(path, ocp.args.Composite(**{
      _PARAMS: ocp.args.StandardSave(params), _META: ocp.args.JsonSave(meta)}), force=overwrite)
  return path


def _resolve(path: str, step: int | None) -> str:
  if not os.path.exists(path):
    raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path} (path does not exist)")
  if step is None and _is_complete_checkpoint(path):
    return path
  steps = checkpoint_steps(path)
  if step is not None:
    if step not in steps:
      raise FileNotFoundError(f"load_checkpoint: no complete checkpoint for step {step} under {path} "
                              f"(available steps: {steps})")
    return os.path.join(path, str(step))
  if steps:
    return os.path.join(path, str(steps[-1]))
  if ocp.utils.is_tmp_checkpoint(path) or (
      os.path.isdir(path) and not ocp.utils.is_checkpoint_finalized(path)):
    raise ValueError(f"load_checkpoint: {path} is an unfinished (interrupted) save, not a checkpoint")
  raise ValueError(f"load_checkpoint: {path} is not an mlkit checkpoint "
                   f"(expected '{_PARAMS}' and '{_META}' items written by save_checkpoint)")


def _abstract_target(target, stored: dict[str, Any]):
  """ShapeDtypeStructs with the target's structure and the stored dtypes (exact round trip)."""
  def leaf(p, x):
    m = stored[_path_str(p)]
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding)
  return jax.tree_util.tree_map_with_path(leaf, target)


def _check_structure(stored: dict[str, Any], expected: dict[str, tuple[int, ...]], source: str) -> None:
  missing = sorted(set(expected) - set(stored))
  extra = sorted(set(stored) - set(expected))
  # A stored "w.packed" where "w" is expected means a quantised weight restored without target=.
  nested = [m for m in missing if any(x.startswith(m + ".") for x in extra)]
  hint = (f"; {nested[0]} is stored as a structured (quantised?) weight: pass target= with that structure"
          if nested else "")
  def show(names):
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"
  if missing:
    raise ValueError(f"load_checkpoint: parameter(s) {show(missing)} expected by the {source} "
                     f"are not in the checkpoint{hint}")
  if extra:
    raise ValueError(f"load_checkpoint: checkpoint parameter(s) {show(extra)} are not in the {source}")
  for name, shape in expected.items():
    if tuple(stored[name].shape) != tuple(shape):
      raise ValueError(f"load_checkpoint: parameter {name} has shape {tuple(stored[name].shape)} in the "
                       f"checkpoint but the {source} expects {tuple(shape)}")


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig | None = None, *,
                    target=None, step: int | None = None):
  """Restores params and config saved by :func:`save_checkpoint`.

  Args:
    path: a checkpoint directory, or a directory of ``<step>`` checkpoints (latest is used).
    cfg: expected config. If given, the stored params must have exactly the shapes of
      ``param_specs(cfg)`` and ``cfg`` is returned instead of the stored config.
    target: optional pytree (arrays or ShapeDtypeStructs, possibly quantised-weight
      dataclasses) giving the structure to restore into; needed for quantised
      checkpoints. Shardings on its leaves are honoured.
    step: with a directory of steps, the step to load (default: the latest).

  Returns:
    (params, cfg): params with the stored dtypes; cfg as passed, else as stored.

  Raises:
    FileNotFoundError: ``path`` (or the requested step) does not exist.
    ValueError: ``path`` is not a (finished) mlkit checkpoint, or the stored params
      do not match ``cfg``/``target`` (the message names the parameter path).
  """
  path = _resolve(os.path.abspath(os.fspath(path)), step)
  ckptr = _checkpointer()
  try:
    meta = ckptr.restore(path, ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
  except Exception as e:  # orbax raises a variety of types for unreadable items
    raise ValueError(f"load_checkpoint: {path} is not an mlkit checkpoint ({e})") from e
  if not isinstance(meta, dict) or meta.get("format") != _FORMAT or "config" not in meta:
    raise ValueError(f"load_checkpoint: {path} is not an mlkit checkpoint (bad '{_META}' metadata)")
  if meta.get("version") != _VERSION:
    raise ValueError(f"load_checkpoint: {path} has format version {meta.get('version')}, "
                     f"this code reads version {_VERSION}")
  stored_cfg = ModelConfig.from_dict(meta["config"])
  out_cfg = stored_cfg if cfg is None else cfg

  tree_md = ckptr.metadata(path).item_metadata[_PARAMS]
  tree_md = getattr(tree_md, "tree", tree_md)
  stored = _flat(tree_md, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  if target is None:
    specs = param_specs(out_cfg)
    is_spec = lambda x: isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)
    expected = {k: v[0] for k, v in _flat(specs, is_leaf=is_spec).items()}
    _check_structure(stored, expected, "config")
    target = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s[0], "float32"), specs,
                                    is_leaf=is_spec)
  else:
    expected = {k: tuple(v.shape) for k, v in _flat(target).items()}
    _check_structure(stored, expected, "target")
  abstract = _abstract_target(target, stored)
  restored = ckptr.restore(path, ocp.args.Composite(**{_PARAMS: ocp.args.StandardRestore(abstract)}))
  return restored[_PARAMS], out_cfg
