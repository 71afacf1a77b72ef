"""Orbax checkpoints of a params pytree plus its ``ModelConfig``.

Layout of one checkpoint directory (written by orbax, finalised atomically)::

  <path>/params   the params pytree (StandardCheckpointHandler, OCDBT/tensorstore)
  <path>/mlkit    JSON: {"format": "mlkit", "version": 2, "step": int | None, "config": {...},
                         "checksums": {"layers.1.attn.wq_a": <CRC-32 of its bytes>, ...},
                         "recipe": <name in mlkit.quant.RECIPES> (optional),
                         "formats": {"layers.1.ffn.w_gate": "int4-g32", ...} (quantised leaves),
                         "mtp": [optional MTP parts] (when params hold "mtp" layers)}

Orbax writes into ``<path>.orbax-checkpoint-tmp-*`` and renames it to ``<path>`` only
after every item is committed, so an interrupted save never leaves a directory that
:func:`load_checkpoint` accepts. With ``step=`` the checkpoint goes to ``<path>/<step>``
(orbax ``CheckpointManager``'s naming), and loading ``<path>`` picks the latest step.

Quantised weights: leaves may be ``flax.struct`` dataclasses (``Int4Weight`` etc.).
Orbax stores their array fields as nested dicts and drops static fields (e.g.
``group_size``), so restoring them needs ``target=``: a pytree of the caller's
structure (arrays or ``jax.ShapeDtypeStruct``; static fields come from it).
Without ``target`` the expected structure is the plain layout of ``param_specs(cfg)``
(with the multi-token-prediction layers the save recorded), with every quantised
leaf in the format the save recorded (``formats``; a checkpoint of a published
INT4 or FP8 release has no recipe to name them); older checkpoints saved with
``recipe=`` get that layout as the named recipe quantises it. ``mesh=`` then places
every leaf's shards as ``mlkit.parallel.param_shardings`` does, each process
reading only its own.

Integrity: params are checked against the config (:func:`mlkit.model.check_params`)
before anything is written and again, from the stored shapes and dtypes, before
anything is read. The data files are zstd-compressed without checksums, so a flipped
bit can decode into wrong values silently; the CRC-32 of every leaf is therefore
recorded beside the config and compared after restoring. (Leaves that this process
cannot see whole, in a multi-process run, are not checksummed.) Version-1
checkpoints, written before checksums, still load. Every unreadable or corrupt
checkpoint is a :class:`~mlkit.checkpoint.errors.CheckpointError` naming the path,
the item, the parameter where known, and the cause in one line.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from mlkit.checkpoint.errors import CheckpointError
from mlkit.config import ModelConfig
from mlkit.model.params import check_params, param_specs
from mlkit.quant.formats import INT4_LAYOUTS, relaid_int4

_FORMAT = "mlkit"
_VERSION = 2  # 2 added "checksums"
_READABLE = (1, 2)
_PARAMS = "params"
_META = "mlkit"
_SAVE, LOAD_OP = "save_checkpoint", "load_checkpoint"


def dotted_path(path) -> str:
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
  return {dotted_path(p): leaf for p, leaf in leaves}


def _checksums(tree) -> dict[str, int | None]:
  """CRC-32 of every leaf's bytes, keyed like :func:`_flat`; None for a leaf not held whole here."""
  out = {}
  for name, leaf in _flat(tree).items():
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      out[name] = None
    else:
      out[name] = zlib.crc32(np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8))
  return out


def recipe_abstract(dense, recipe) -> tuple[Any, dict]:
  """A dense params tree (ShapeDtypeStructs) as ``recipe`` quantises it, from shapes only.

  Returns:
    (the tree with Int4Weight / Fp8Weight leaves of ShapeDtypeStructs, {path: format
    spec} in flatten order). GPTQ gives the shapes of round to nearest.

  Raises:
    ValueError: the recipe does not fit the tree (``assign_formats``).
  """
  from mlkit.quant.recipe import assign_formats, quantize_leaf
  from mlkit.quant.tree import flatten_params
  specs = assign_formats(dense, recipe)  # tree order
  flat, treedef = flatten_params(dense)
  leaves = [jax.eval_shape(lambda w, sp=sp: quantize_leaf(w, sp), x)
            for (_, x), sp in zip(flat, specs.values())]
  return jax.tree_util.tree_unflatten(treedef, leaves), specs


def with_param_shardings(abstract, mesh, rules, cfg: ModelConfig):
  """``abstract`` (ShapeDtypeStructs) carrying ``mlkit.parallel.param_shardings``' shardings."""
  from mlkit.parallel import DEFAULT_RULES, param_shardings
  shardings = param_shardings(abstract, mesh, rules or DEFAULT_RULES, cfg)
  return jax.tree_util.tree_map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                abstract, shardings)


def _dense_abstract(cfg: ModelConfig, mtp=None):
  return jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(s[0], s[2] if len(s) == 3 else cfg.param_dtype),
      param_specs(cfg, mtp=mtp), is_leaf=_is_spec)


def _format_name(leaf) -> str | None:
  """"int4-g32", "fp8-block128", "fp8-channel" for a quantised leaf, else None."""
  from mlkit.quant import Fp8Weight, Int4Weight
  if isinstance(leaf, Int4Weight):
    return f"int4-g{leaf.group_size}"
  if isinstance(leaf, Fp8Weight):
    return "fp8-channel" if leaf.block_size is None else f"fp8-block{leaf.block_size}"
  return None


def _formats(params) -> dict[str, str]:
  """{leaf name: format name} for every quantised leaf (what restores them without target=)."""
  from mlkit.quant.tree import is_quantised
  return {name: _format_name(leaf) for name, leaf in _flat(params, is_leaf=is_quantised).items()
          if _format_name(leaf) is not None}


def _with_formats(dense, formats: dict[str, str]):
  """The dense abstract tree with the recorded leaves in their formats (shapes from the
  dense ones; the stored dtypes are filled in by _abstract_target)."""
  from mlkit.quant import Fp8Weight, Int4Weight

  def leaf(path, x):
    fmt = formats.get(dotted_path(path))
    if fmt is None:
      return x
    *lead, k, n = x.shape
    sds = jax.ShapeDtypeStruct
    if fmt.startswith("int4-g"):
      g = int(fmt.removeprefix("int4-g"))
      return Int4Weight(packed=sds((*lead, k // 2, n), np.uint8),
                        scales=sds((*lead, k // g, n), x.dtype), group_size=g)
    if fmt == "fp8-channel":
      return Fp8Weight(values=sds(x.shape, jnp.float8_e4m3fn), scales=sds((*lead, n), np.float32),
                       block_size=None)
    b = int(fmt.removeprefix("fp8-block"))
    return Fp8Weight(values=sds(x.shape, jnp.float8_e4m3fn),
                     scales=sds((*lead, -(-k // b), -(-n // b)), np.float32), block_size=b)
  return jax.tree_util.tree_map_with_path(leaf, dense)


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)


# ----------------------------------------------------------------------------- restore failures

# orbax reads every array concurrently in a private event loop, closed as soon as one read
# fails; the reads still in flight then report "Event loop is closed" (and their own
# failures) as unraisable exceptions and asyncio "never retrieved" log lines, long after
# the real error has been raised. These are that noise, and nothing else is dropped.
_ORBAX_READ_FAILED = "Encountered error while reading array index"


def _is_restore_noise(exc) -> bool:
  return ((type(exc) is RuntimeError and str(exc) == "Event loop is closed")
          or (type(exc) is Exception and str(exc).startswith(_ORBAX_READ_FAILED)))


class _DropRestoreNoise(logging.Filter):
  """Drops asyncio's "exception was never retrieved" records for abandoned orbax reads."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not (exc is not None and _is_restore_noise(exc))


def _quiet_abandoned_reads() -> None:
  """Installs (once, on top of whatever is there) the filters for the noise described above."""
  if not getattr(sys.unraisablehook, "_drops_orbax_restore_noise", False):
    previous = sys.unraisablehook

    def hook(unraisable):
      if not _is_restore_noise(unraisable.exc_value):
        previous(unraisable)
    hook._drops_orbax_restore_noise = True
    sys.unraisablehook = hook
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _DropRestoreNoise) for f in asyncio_log.filters):
    asyncio_log.addFilter(_DropRestoreNoise())


def _one_line_cause(e: BaseException) -> str:
  """The innermost cause of ``e`` (orbax wraps TensorStore's error), first line, with its type."""
  while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
    e = e.__cause__ if e.__cause__ is not None else e.__context__
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"


def _checkpointer() -> ocp.Checkpointer:
  # Handlers named up front so that metadata() can read items before any restore.
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**{
      _PARAMS: ocp.StandardCheckpointHandler(), _META: ocp.JsonCheckpointHandler()}))


def is_complete_checkpoint(path: str) -> bool:
  """True when ``path`` is a finished orbax checkpoint (not one still being written)."""
  return (os.path.isdir(path) and not ocp.utils.is_tmp_checkpoint(path)
          and ocp.utils.is_checkpoint_finalized(path)
          and os.path.isdir(os.path.join(path, _META)) and os.path.isdir(os.path.join(path, _PARAMS)))


def checkpoint_steps(path: str | os.PathLike) -> list[int]:
  """Steps of the complete checkpoints saved under ``path`` with ``step=``, ascending."""
  path = os.fspath(path)
  if not os.path.isdir(path):
    return []
  return sorted(int(n) for n in os.listdir(path)
                if n.isdigit() and is_complete_checkpoint(os.path.join(path, n)))


def save_checkpoint(path: str | os.PathLike, params, cfg: ModelConfig, *, step: int | None = None,
                    overwrite: bool = False, recipe=None) -> str:
  """Saves params and their config with orbax, with a CRC-32 of every leaf (one host copy each).

  Args:
    path: checkpoint directory (its parent is created if missing).
    params: the params pytree; leaves may be arrays or ``flax.struct`` weight dataclasses.
      Int4 weights are stored in layout "kn"; ones in layout "nk" are relaid into a
      copy for the save.
    cfg: the model config, stored as JSON beside the params.
    step: if given, the checkpoint is written to ``<path>/<step>`` and the step is recorded.
    overwrite: replace an existing checkpoint at the destination (otherwise an error).
    recipe: the ``mlkit.quant.Recipe`` (or its name in ``mlkit.quant.RECIPES``) that
      quantised ``params``; recorded, so that :func:`load_checkpoint` can restore the
      quantised structure without ``target=``.

  Returns:
    The directory the checkpoint was written to.

  Raises:
    FileExistsError: the destination exists and ``overwrite`` is False.
    ValueError: ``step`` is negative, ``cfg`` is not a ``ModelConfig``, or ``params`` do
      differs), or ``recipe`` is not one of ``mlkit.quant.RECIPES``; nothing is
      written then.
  """
  if not isinstance(cfg, ModelConfig):
    raise ValueError(f"save_checkpoint: cfg must be a ModelConfig, got {type(cfg).__name__}")
  recipe_name = None if recipe is None else _known_recipe(_SAVE, getattr(recipe, "name", recipe)).name
  check_params(params, cfg, where=_SAVE)
  path = os.path.abspath(os.fspath(path))
  if step is not None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise ValueError(f"save_checkpoint: step must be a non-negative int, got {step!r}")
    path = os.path.join(path, str(step))
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"save_checkpoint: {path} already exists (pass overwrite=True to replace it)")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  # Checkpoints hold int4 weights in layout "kn" (load_checkpoint(int4_layout=)
  # relays them on restore): a tree quantised for the GPU kernels is saved through
  # a "kn" copy of its "nk" weights.
  params = relaid_int4(params, "kn")
  meta = {"format": _FORMAT, "version": _VERSION, "step": step, "config": cfg.to_dict(),
          "checksums": _checksums(params)}
  formats = _formats(params)
  if formats is not None:
    meta["formats"] = formats
  if recipe_name is not None:
    meta["recipe"] = recipe_name
  if "mtp" in params:
    from mlkit.model.params import mtp_parts
    meta["mtp"] = sorted(mtp_parts(params["mtp"]))
  # Synchronous Checkpointer: returns only after orbax has renamed the tmp dir into place.
  _checkpointer().save(path, ocp.args.Composite(**{
      _PARAMS: ocp.args.StandardSave(params), _META: ocp.args.JsonSave(meta)}), force=overwrite)
  return path


def _known_recipe(func: str, name):
  from mlkit.quant import RECIPES
  if name not in RECIPES:
    raise ValueError(f"{func}: recipe {name!r} is not one of mlkit.quant.RECIPES ({sorted(RECIPES)})")
  return RECIPES[name]


def _resolve(path: str, step: int | None) -> str:
  if not os.path.exists(path):
    raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path} (path does not exist)")
  if step is None and is_complete_checkpoint(path):
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
    raise CheckpointError(LOAD_OP, path, "an unfinished (interrupted) save, not a checkpoint")
  raise CheckpointError(LOAD_OP, path, f"not an mlkit checkpoint (expected '{_PARAMS}' and '{_META}' "
                                     "items written by save_checkpoint)")


def _abstract_target(target, stored: dict[str, Any]):
  """ShapeDtypeStructs with the target's structure and the stored dtypes (exact round trip)."""
  def leaf(p, x):
    m = stored[dotted_path(p)]
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding)
  return jax.tree_util.tree_map_with_path(leaf, target)


def _check_structure(path: str, stored: dict[str, Any], expected: dict[str, tuple[int, ...]],
                     source: str) -> None:
  missing = sorted(set(expected) - set(stored))
  extra = sorted(set(stored) - set(expected))
  # A stored "w.packed" where "w" is expected means a quantised weight restored without target=.
  nested = [m for m in missing if any(x.startswith(m + ".") for x in extra)]
  hint = (f"; {nested[0]} is stored as a structured (quantised?) weight: pass target= with that structure"
          if nested else "")
  def show(names):
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"
  if missing:
    raise CheckpointError(LOAD_OP, path, f"parameter(s) {show(missing)} expected by the {source} "
                                       f"are not in the checkpoint{hint}")
  if extra:
    raise CheckpointError(LOAD_OP, path, f"checkpoint parameter(s) {show(extra)} are not in the {source}")
  for name, shape in expected.items():
    if tuple(stored[name].shape) != tuple(shape):
      raise CheckpointError(LOAD_OP, path, f"parameter {name} has shape {tuple(stored[name].shape)} in "
                                         f"the checkpoint but the {source} expects {tuple(shape)}")


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig | None = None, *,
                    target=None, step: int | None = None, verify: bool = True, mesh=None,
                    rules=None, int4_layout: str = "kn"):
  """Restores params and config saved by :func:`save_checkpoint`.

  Args:
    path: a checkpoint directory, or a directory of ``<step>`` checkpoints (latest is used).
    cfg: expected config. If given, the stored params must have exactly the shapes of
      ``param_specs(cfg)`` and ``cfg`` is returned instead of the stored config.
    target: optional pytree (arrays or ShapeDtypeStructs, possibly quantised-weight
      dataclasses) giving the structure to restore into; needed for quantised
      checkpoints. Shardings on its leaves are honoured.
    step: with a directory of steps, the step to load (default: the latest).
    verify: compare every restored leaf with the checksum recorded at save (one host
      copy of each leaf); without it a corrupt data file can load as wrong values.
    mesh: without ``target``: restore every leaf sharded on this mesh
      (``mlkit.parallel.param_shardings``), each device reading its own shard.
    rules: logical-axis rules with ``mesh`` (default ``mlkit.parallel.DEFAULT_RULES``).
    int4_layout: the int4 weights' layout in the result: "kn" as stored, or "nk",
      what the GPU kernels read (``mlkit.quant.kernel_int4_layout()``). Each
      weight is relaid after its checksum is verified and its stored copy freed
      before the next, so one leaf at most is held in both layouts, and shardings
      carry over (K and N swapped).

  Returns:
    (params, cfg): params with the stored dtypes; cfg as passed, else as stored.

  Raises:
    FileNotFoundError: ``path`` (or the requested step) does not exist.
    ValueError: ``cfg`` is not a ModelConfig, ``mesh`` comes with ``target`` or ``rules``
      without ``mesh``, ``int4_layout`` is unknown, or ``path`` is not a (finished)
      mlkit checkpoint.
    CheckpointError: (a ValueError) naming the path: the stored params do not match
      ``cfg``/``target`` (names the parameter), an item cannot be read (truncated or
      corrupt files: names the item, the parameter where known and the cause), or a
      leaf differs from its recorded checksum.
  """
  if cfg is not None and not isinstance(cfg, ModelConfig):
    raise ValueError(f"load_checkpoint: cfg must be a ModelConfig or None (e.g. configs.models.TINY_MLA), "
                     f"got {type(cfg).__name__} {cfg!r:.60}")
  if mesh is not None and target is not None:
    raise ValueError("load_checkpoint: pass mesh= or a target= with shardings, not both")
  if rules is not None and mesh is None:
    raise ValueError("load_checkpoint: rules= needs a mesh=")
  if int4_layout not in INT4_LAYOUTS:
    raise ValueError(f"load_checkpoint: int4_layout must be one of {INT4_LAYOUTS}, "
                     f"got {int4_layout!r}")
  path = _resolve(os.path.abspath(os.fspath(path)), step)
  ckptr = _checkpointer()
  try:
    meta = ckptr.restore(path, ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
  except Exception as e:  # orbax raises a variety of types for unreadable items
    raise CheckpointError(LOAD_OP, path, f"not an mlkit checkpoint: item '{_META}' cannot be read "
                                       f"({_one_line_cause(e)})") from None
  if not isinstance(meta, dict) or meta.get("format") != _FORMAT or "config" not in meta:
    raise CheckpointError(LOAD_OP, path, f"not an mlkit checkpoint (bad '{_META}' metadata)")
  version = meta.get("version")
  if version not in _READABLE:
    raise CheckpointError(LOAD_OP, path, f"format version {version}; this code reads versions {_READABLE}")
  checksums = meta.get("checksums")
  if version >= 2 and not isinstance(checksums, dict):
    raise CheckpointError(LOAD_OP, path, f"item '{_META}' has no 'checksums' object")
  try:
    stored_cfg = ModelConfig.from_dict(meta["config"])
  except (TypeError, ValueError) as e:
    raise CheckpointError(LOAD_OP, path, f"item '{_META}' holds an invalid config ({e})") from None
  out_cfg = stored_cfg if cfg is None else cfg

  try:
    tree_md = ckptr.metadata(path).item_metadata[_PARAMS]
  except Exception as e:  # a damaged _METADATA / _sharding / manifest: JSON, key or tensorstore errors
    raise CheckpointError(LOAD_OP, path, f"item '{_PARAMS}': its metadata cannot be read "
                                       f"({_one_line_cause(e)})") from None
  tree_md = getattr(tree_md, "tree", tree_md)
  stored = _flat(tree_md, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  if target is None:
    mtp = meta.get("mtp")
    if mtp is not None and (not isinstance(mtp, list) or not all(isinstance(p, str) for p in mtp)):
      raise CheckpointError(LOAD_OP, path, f"item '{_META}' has a bad 'mtp' entry {mtp!r}")
    try:
      target = _dense_abstract(out_cfg, mtp)
    except ValueError as e:
      raise CheckpointError(LOAD_OP, path, f"item '{_META}': {e}") from None
    formats = meta.get("formats")
    if formats is not None:
      if not isinstance(formats, dict) or not all(
          isinstance(v, str) and re.fullmatch(r"int4-g\d+|fp8-block\d+|fp8-channel", v)
          for v in formats.values()):
        raise CheckpointError(LOAD_OP, path, f"item '{_META}' has a bad 'formats' entry")
      try:
        target = _with_formats(target, formats)
      except ValueError as e:
        raise CheckpointError(LOAD_OP, path, f"recorded formats cannot be applied ({e}); pass "
                                           "target=") from None
    elif meta.get("recipe") is not None:
      try:
        target, _ = recipe_abstract(target, _known_recipe(LOAD_OP, meta["recipe"]))
      except ValueError as e:
        raise CheckpointError(LOAD_OP, path, f"recorded recipe {meta['recipe']!r} cannot be applied "
                                           f"({e}); pass target=") from None
    if mesh is not None:
      target = with_param_shardings(target, mesh, rules, out_cfg)
    expected = {k: tuple(v.shape) for k, v in _flat(target).items()}
    _check_structure(path, stored, expected,
                     "config" if meta.get("recipe") is None else f"config and recipe {meta['recipe']!r}")
  else:
    expected = {k: tuple(v.shape) for k, v in _flat(target).items()}
    _check_structure(path, stored, expected, "target")
  abstract = _abstract_target(target, stored)
  check_params(abstract, out_cfg, where=f"{LOAD_OP}: {path}")  # the stored dtypes, before any read
  _quiet_abandoned_reads()
  try:
    restored = ckptr.restore(path, ocp.args.Composite(**{_PARAMS: ocp.args.StandardRestore(abstract)}))
  except Exception as e:  # TensorStore's errors arrive wrapped in a bare Exception
    cause = _one_line_cause(e)
    leaf = re.search(r'Error reading "([^"/]+)/', cause)
    where = f", parameter {leaf.group(1)}" if leaf else ""
    raise CheckpointError(LOAD_OP, path, f"item '{_PARAMS}'{where} cannot be read (truncated or corrupt "
                                       f"files?): {cause}") from None
  params = restored[_PARAMS]
  if verify and checksums:
    for name, got in _checksums(params).items():
      want = checksums.get(name)
      if want is not None and got is not None and got != want:
        raise CheckpointError(LOAD_OP, path, f"item '{_PARAMS}', parameter {name}: restored bytes do not "
                                           f"match the checksum recorded at save (CRC-32 {got:#010x}, "
                                           f"expected {want:#010x}): the data files are corrupt")
  return relaid_int4(params, int4_layout, free_source=True), out_cfg
