"""Loading a Hugging Face checkpoint into our params tree, streamed and sharded.

:func:`open_hf_checkpoint` checks everything the headers allow before the first
read; :class:`HFCheckpoint` then reads one parameter at a time, and
:class:`_LeafConverter` quantises it and places its shards, so that host memory
holds one parameter, never the whole tree (docs/checkpoints.md, "Streaming
import"). :func:`load_hf_checkpoint` is ``open_hf_checkpoint(...).load()``.

The multi-token-prediction layers that config.json declares
(``num_nextn_predict_layers`` of them, after the last layer) and rotary
``inv_freq`` buffers are skipped; any other tensor the config does not explain
is an error. Weights stored as fp8 with a block scale are dequantised on import.

The loader refuses to guess: the parameter dtype is the one asked for or declared,
else the tensors' own (when they agree); narrowing conversions must be asked for; and
every unreadable or inconsistent file is a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.checkpoint.errors import CheckpointError, read_json
from mlkit.checkpoint.hf.config import CONFIG_FILE, _declared_dtype, config_from_hf
from mlkit.checkpoint.hf.names import _path_str, _Target, hf_layout
from mlkit.checkpoint.hf.safetensors import (_FP8_DTYPES, _LOAD, _check_fp8_scales, _Reader,
                                             dequantize_fp8_blocks)
from mlkit.config import ModelConfig

# The package's name, not this module's: callers (and tests) filter on
# "mlkit.checkpoint.hf", as when the package was one module.
log = logging.getLogger("mlkit.checkpoint.hf")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")

# Stored dtypes whose conversion to a parameter dtype loses nothing (fp8 weights are
# dequantised through f32, so they are never a silent narrowing either).
_LOSSLESS = {("BF16", "bfloat16"), ("BF16", "float32"), ("F16", "float32"), ("F32", "float32")}
_ST_NAMES = {"BF16": "bfloat16", "F32": "float32"}


def _resolve_dtype(path: str, cfg_file: str, chosen: str | None, explicit: bool, reader: _Reader,
                   targets: list[_Target]) -> str:
  """The parameter dtype to load into (see :func:`load_hf_checkpoint`, "Dtype").

  Args:
    path / cfg_file: the checkpoint directory and its config.json, for messages.
    chosen: the dtype ``dtype=`` or config.json names, or None if neither does.
    explicit: ``chosen`` comes from ``dtype=`` (narrowing is then allowed, and logged).
    reader / targets: the tensors and the leaves they fill.
  """
  stored = {}  # safetensors dtype -> first tensor stored in it (tensors of the param dtype)
  for t in targets:
    for n in t.names:
      st = reader.st_dtype(n)
      if st not in _FP8_DTYPES and t.dtype is None:
        stored.setdefault(st, n)
  if chosen is None:
    if len(stored) != 1:
      found = ", ".join(f"{n} is {st}" for st, n in sorted(stored.items()))
      raise CheckpointError(_LOAD, cfg_file, f"declares no 'torch_dtype' and the tensors disagree "
                                             f"({found}); pass dtype= to choose one")
    (st, n), = stored.items()
    if st not in _ST_NAMES:
      raise CheckpointError(_LOAD, reader.file(n), f"config.json declares no 'torch_dtype' and the "
                                                   f"tensors are {st} (e.g. {n}); pass dtype='bfloat16' "
                                                   "or 'float32'")
    log.info("%s: %s declares no torch_dtype; using the tensors' own dtype %s", _LOAD, cfg_file,
             _ST_NAMES[st])
    return _ST_NAMES[st]
  narrowed = []
  for t in targets:
    want = t.dtype or chosen
    narrowed += [(n, reader.st_dtype(n), want) for n in t.names
                 if reader.st_dtype(n) not in _FP8_DTYPES and (reader.st_dtype(n), want) not in _LOSSLESS]
  if narrowed and not explicit:
    n, st, want = narrowed[0]
    raise CheckpointError(_LOAD, reader.file(n), f"tensor {n} is {st} but config.json declares "
                                                 f"torch_dtype {want}; converting {len(narrowed)} "
                                                 f"tensor(s) to it loses precision: pass dtype='{want}' "
                                                 "to convert explicitly (or dtype='float32')")
  if narrowed:
    n, st, want = narrowed[0]
    log.warning("%s: %s: converting %d tensor(s) to the narrower dtype %s as dtype= asks (e.g. %s "
                "is %s)", _LOAD, path, len(narrowed), want, n, st)
  return chosen


def load_hf_checkpoint(path: str | os.PathLike, *, dtype=None, recipe=None, mesh=None,
                       rules=None, int4_layout: str = "kn"):
  """Loads a DeepSeek-V3 / Kimi-K2 Hugging Face checkpoint into our params tree.

  Streaming: the checkpoint is read one parameter at a time (an expert stack is
  one parameter). Each is quantised as it is read (``recipe``), and with a
  ``mesh`` its shards go straight onto their devices, so host memory holds the
  parameter being read and converted, never the whole tree. Progress (bytes
  read, rate) is logged every few seconds. In a multi-process run each process
  reads only the parts of each parameter that its own devices hold (the whole
  of a replicated one; docs/checkpoints.md, "Multi-process loading").

  Dtype: the parameters are stored in ``dtype`` if given, else in config.json's
  ``torch_dtype`` (or ``dtype``), else in the stored tensors' own dtype when they all
  agree (router weights and bias are always f32; fp8 weights are dequantised). A
  conversion that loses precision (an f32 tensor into bf16) is never silent: it must
  be asked for with ``dtype=``, and is logged.

  Layers: the checkpoint's layers must be those of ``num_hidden_layers``; only the
  multi-token-prediction layers config.json declares (indices ``num_hidden_layers``
  to ``num_hidden_layers + num_nextn_predict_layers - 1``) are skipped.

  Args:
    path: directory with ``config.json`` and ``*.safetensors`` (single or sharded with
      ``model.safetensors.index.json``).
    dtype: parameter dtype ("bfloat16"/"float32"); see "Dtype" above.
    recipe: a ``mlkit.quant.Recipe`` applied leaf by leaf as it is read (round to
      nearest; GPTQ needs calibration activations and is refused here), or None
      to keep the weights dense.
    mesh: place every parameter's shards on this mesh as it is read (by
      ``mlkit.parallel.param_shardings`` with ``rules``), or None for the
      default device.
    rules: logical-axis rules with ``mesh`` (default ``mlkit.parallel.DEFAULT_RULES``).
    int4_layout: the recipe's int4 weights' layout: "kn" (packed, as checkpoints
      hold them) or "nk" (what the GPU kernels read, ``mlkit.quant.
      kernel_int4_layout()``), relaid after loading one leaf at a time, each
      packed copy freed before the next.

  Returns:
    (params, cfg): params laid out as ``init_params(cfg)`` (router weights/bias in f32),
    quantised by ``recipe`` and placed on ``mesh`` when given.

  Raises:
    FileNotFoundError: the directory, ``config.json``, a shard or all safetensors are missing.
    CheckpointError: (a ValueError) naming the file: invalid JSON in config.json or the
      index, a bad config field, a truncated or corrupt safetensors file, a missing
      tensor, a wrong shape (with expected and actual shapes), unexpected tensor names,
      a layer beyond the config's layers and declared MTP layers, tensors whose dtypes
      disagree when no dtype is declared, or a narrowing conversion not asked for.
    ValueError: a recipe that does not fit the model or asks for GPTQ; rules without a
      mesh; an unknown int4_layout (before anything is read).
  """
  from mlkit.quant.formats import INT4_LAYOUTS, relaid_int4
  if int4_layout not in INT4_LAYOUTS:
    raise ValueError(f"{_LOAD}: int4_layout must be one of {INT4_LAYOUTS}, got {int4_layout!r}")
  params, cfg = open_hf_checkpoint(path, dtype=dtype, recipe=recipe, mesh=mesh,
                                   rules=rules).load()
  return relaid_int4(params, int4_layout, free_source=True), cfg


def open_hf_checkpoint(path: str | os.PathLike, *, dtype=None, recipe=None, mesh=None,
                       rules=None) -> "HFCheckpoint":
  """Opens and checks a checkpoint for :func:`load_hf_checkpoint`, reading no tensor yet.

  Everything that can be checked from config.json and the safetensors headers is
  checked here (names, shapes, dtypes, the recipe's formats, the shardings), so
  that a conversion fails before its first read. Arguments, returns and errors
  are those of :func:`load_hf_checkpoint`; the parameters are then read one at
  a time with :meth:`HFCheckpoint.leaf` (what ``mlkit.convert`` does, skipping
  those already converted) or all together with :meth:`HFCheckpoint.load`.
  """
  if rules is not None and mesh is None:
    raise ValueError(f"{_LOAD}: rules= needs a mesh=")
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{_LOAD}: {path} is not a directory")
  cfg_file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"{_LOAD}: {cfg_file} is missing")
  hf_config = read_json(_LOAD, cfg_file)
  declared = dtype is not None or _declared_dtype(hf_config) is not None
  try:
    # The layout does not depend on the dtype; without a declared one it comes from the tensors.
    cfg = config_from_hf(hf_config, dtype=dtype if declared else "float32")
  except ValueError as e:
    raise CheckpointError(_LOAD, cfg_file, str(e)) from e
  qcfg = hf_config.get("quantization_config") or {}
  block = qcfg.get("weight_block_size", (128, 128)) if isinstance(qcfg, dict) else None
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise CheckpointError(_LOAD, cfg_file, "quantization_config must be an object whose "
                                           f"weight_block_size is two positive ints, got {qcfg!r}")
  block = tuple(block)

  reader = _Reader(path)
  targets, treedef = hf_layout(cfg)
  expected = {n for t in targets for n in t.names}
  present = reader.names()
  mtp = range(cfg.n_layers, cfg.n_layers + cfg.n_mtp_layers)
  skipped_mtp, unexpected = [], []
  for n in sorted(present - expected):
    base = n.removesuffix("_scale_inv")
    m = _LAYER_RE.match(n)
    if m and int(m.group(1)) in mtp:
      skipped_mtp.append(n)  # multi-token-prediction layers are not part of the serving model
    elif m and int(m.group(1)) >= cfg.n_layers:
      raise CheckpointError(_LOAD, reader.file(n), f"tensor {n} belongs to layer {m.group(1)}, but "
                                                   f"config.json declares num_hidden_layers={cfg.n_layers} "
                                                   f"and num_nextn_predict_layers={cfg.n_mtp_layers}")
    elif n.endswith("rotary_emb.inv_freq"):
      continue  # a recomputable buffer some exporters include
    elif n.endswith("_scale_inv") and base in expected:
      continue  # consumed with its weight below
    else:
      unexpected.append(n)
  if unexpected:
    raise CheckpointError(_LOAD, reader.file(unexpected[0]),
                          f"unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                          f"({len(unexpected)} in all) for this config")
  if skipped_mtp:
    log.info("%s: skipped %d multi-token-prediction tensors (layers %d..%d)", _LOAD,
             len(skipped_mtp), mtp.start, mtp.stop - 1)
  for t in targets:
    for n in t.names:
      if n not in present:
        raise CheckpointError(_LOAD, path, f"missing tensor {n} (for {_path_str(t.path)})")
      shape = reader.shape(n)
      if shape != t.hf_shape:
        raise CheckpointError(_LOAD, reader.file(n), f"tensor {n} has shape {shape}, expected {t.hf_shape}")
  dt = _resolve_dtype(path, cfg_file, cfg.param_dtype if declared else None, dtype is not None,
                      reader, targets)
  cfg = dataclasses.replace(cfg, dtype=dt, param_dtype=dt)
  return HFCheckpoint(path, cfg, reader, targets, treedef, block,
                      _LeafConverter(targets, treedef, cfg, recipe, mesh, rules))


class HFCheckpoint:
  """A checked Hugging Face checkpoint whose parameters are read one at a time.

  Made by :func:`open_hf_checkpoint`. Leaf ``i`` is the ``i``-th leaf of the params
  tree in flatten order (``names[i]``, e.g. ``"layers.1.ffn.w_gate"``).

  Attributes:
    path: the checkpoint directory.
    cfg: the ModelConfig (with the dtype the parameters are loaded in).
    names: every leaf's dotted path, in flatten order.
    abstract: the params tree (quantised by the recipe) as ShapeDtypeStructs, with
      their shardings when a mesh was given.
    bytes_read: {leaf name: tensor bytes this process read for it} for the leaves
      read so far (in a multi-process run, only what its devices hold).
  """

  def __init__(self, path: str, cfg: ModelConfig, reader: _Reader, targets: list[_Target], treedef,
               block: tuple[int, int], convert: "_LeafConverter"):
    self.path, self.cfg = path, cfg
    self._reader, self._targets, self._treedef, self._block = reader, targets, treedef, block
    self._convert = convert
    self.names = [_path_str(t.path) for t in targets]
    self.abstract = jax.tree_util.tree_unflatten(treedef, convert.abstract)
    self.bytes_read: dict[str, int] = {}

  def __len__(self) -> int:
    return len(self._targets)

  def nbytes(self, i: int) -> int:
    """Stored bytes of the tensors behind leaf ``i`` (all of them, wherever its shards go)."""
    return sum(self._reader.nbytes(n) for n in self._targets[i].names)

  def leaf(self, i: int):
    """Reads, converts, quantises and places leaf ``i`` (only this process's part of it)."""
    t = self._targets[i]
    box = self._convert.box(i)
    out_dtype = jnp.dtype(t.dtype or self.cfg.param_dtype)
    before = self._reader.bytes_read
    if t.kind == "stack":
      (e0, e1), hf_box = box[0], box[1:][::-1]
      arr = np.stack([self._read(n, hf_box).astype(out_dtype).T for n in t.names[e0:e1]])
    else:
      arr = self._read(t.names[0], box if t.kind == "copy" else box[::-1]).astype(out_dtype)
      if t.kind == "T":
        arr = arr.T
    out = self._convert(i, arr, box)
    self.bytes_read[self.names[i]] = self._reader.bytes_read - before
    return out

  def load(self):
    """Every leaf, in order, with progress logged: ``(params, cfg)``."""
    meter = _Progress(sum(self.nbytes(i) for i in range(len(self))))
    leaves = []
    for i in range(len(self)):
      before = self._reader.bytes_read
      leaves.append(self.leaf(i))  # the host copy goes before the next parameter is read
      meter.add(self._reader.bytes_read - before)
    meter.done()
    return jax.tree_util.tree_unflatten(self._treedef, leaves), self.cfg

  def _read(self, n: str, box) -> np.ndarray:
    """Tensor ``n`` (its ``box`` of HF coordinates), fp8 dequantised."""
    reader = self._reader
    if reader.st_dtype(n) in _FP8_DTYPES:
      if not reader.has(n + "_scale_inv"):
        raise CheckpointError(_LOAD, reader.file(n), f"fp8 tensor {n} has no {n}_scale_inv block scale")
      shape = reader.shape(n)
      try:  # the whole tensor's scales, whatever part of it is read
        _check_fp8_scales(shape, reader.shape(n + "_scale_inv"), self._block, n)
      except ValueError as e:
        raise CheckpointError(_LOAD, reader.file(n + "_scale_inv"), str(e)) from e
      # Whole scale blocks: the box grows to block edges, and is cut back after.
      grown = tuple((a // b * b, min(-(-c // b) * b, d))
                    for (a, c), b, d in zip(box, self._block, shape))
      scale_box = tuple((a // b, -(-c // b)) for (a, c), b in zip(grown, self._block))
      try:
        w = dequantize_fp8_blocks(reader.get(n, grown), reader.get(n + "_scale_inv", scale_box),
                                  self._block, name=n)
      except CheckpointError:
        raise
      except ValueError as e:
        raise CheckpointError(_LOAD, reader.file(n + "_scale_inv"), str(e)) from e
      return w[tuple(slice(a - g, c - g) for (a, c), (g, _) in zip(box, grown))]
    if reader.has(n + "_scale_inv"):
      raise CheckpointError(_LOAD, reader.file(n), f"{n}_scale_inv given but {n} is "
                                                   f"{reader.st_dtype(n)}, not fp8")
    return reader.get(n, box)


def _our_shape(t: _Target) -> tuple[int, ...]:
  if t.kind == "copy":
    return t.hf_shape
  if t.kind == "T":
    return t.hf_shape[::-1]
  return (len(t.names),) + t.hf_shape[::-1]


class _LeafConverter:
  """Quantises one parameter as it is read and places its shards on the mesh.

  The formats and shardings of every leaf are worked out once, from shapes only
  (``assign_formats`` and ``param_shardings`` over ShapeDtypeStructs), so a
  recipe or rules that do not fit the model fail before anything is read.
  Quantisation runs on the host's CPU device (a device-side copy of a whole
  parameter would defeat the point of sharding it).

  With a mesh, :meth:`box` is the part of the dense parameter that this process's
  devices hold (all of it in a single-process run), grown to whole quantisation
  groups; only that part is read and quantised, and each device copies its shard
  out of it.
  """

  def __init__(self, targets, treedef, cfg: ModelConfig, recipe, mesh, rules):
    from mlkit.checkpoint.orbax_io import recipe_abstract, with_param_shardings
    from mlkit.quant.recipe import Int4Spec, quantize_leaf
    from mlkit.quant.tree import is_quantised
    self._quantize_leaf = quantize_leaf
    tree = jax.tree_util.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(_our_shape(t), jnp.dtype(t.dtype or cfg.param_dtype)) for t in targets])
    self.names = [_path_str(t.path) for t in targets]
    self.specs = [None] * len(targets)
    if recipe is not None:
      tree, specs = recipe_abstract(tree, recipe)
      self.specs = list(specs.values())  # tree order, the targets' order
      gptq = [p for p, sp in specs.items() if isinstance(sp, Int4Spec) and sp.method == "gptq"]
      if gptq:
        raise ValueError(f"{_LOAD}: recipe {recipe.name!r} uses GPTQ for {gptq[0]!r}, which needs "
                         "calibration activations; quantise after loading (mlkit.quant.gptq)")
    self.sharded = mesh is not None
    if self.sharded:
      tree = with_param_shardings(tree, mesh, rules, cfg)
    # Every leaf as the recipe leaves it (an Int4Weight / Fp8Weight of ShapeDtypeStructs).
    self.abstract = jax.tree_util.tree_leaves(tree, is_leaf=is_quantised)
    self._cpu = jax.local_devices(backend="cpu")[0]  # this process's, in a multi-process run

  def box(self, i: int) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` per axis of dense leaf ``i`` that this process needs."""
    a = self.abstract[i]
    shape = tuple(a.shape)  # the dense shape for quantised leaves too
    full = tuple((0, d) for d in shape)
    if not self.sharded:
      return full
    lo, hi = [d for d in shape], [0] * len(shape)
    for field, geo in zip(jax.tree_util.tree_leaves(a), _field_geometry(a)):
      for idx in field.sharding.addressable_devices_indices_map(tuple(field.shape)).values():
        for ax, (s, e) in enumerate(_dense_range(idx, field.shape, shape, geo)):
          lo[ax], hi[ax] = min(lo[ax], s), max(hi[ax], e)
    if any(l >= h for l, h in zip(lo, hi)):
      return full  # no device of this process holds any of it (or a 0-size leaf)
    units = _quant_units(a)
    return tuple((l // u * u, min(-(-h // u) * u, d)) for l, h, u, d in zip(lo, hi, units, shape))

  def __call__(self, i: int, arr: np.ndarray, box: tuple[tuple[int, int], ...]):
    """Leaf ``i`` from ``arr``, the dense values in ``box`` (see :meth:`box`)."""
    spec = self.specs[i]
    if spec is None and not self.sharded:
      return jnp.asarray(arr)
    if spec is not None:
      with jax.default_device(self._cpu):
        leaf = self._quantize_leaf(jnp.asarray(arr), spec, name=self.names[i])
      if not self.sharded:
        return jax.device_put(leaf, jax.local_devices()[0])  # the default device
      host = jax.tree_util.tree_map(np.asarray, leaf)
    else:
      host = arr
    a = self.abstract[i]
    fields = []
    # Every device copies out only its own shard of the part read; a field's index is
    # global, so it is shifted by where the part starts in that field.
    for x, field, geo in zip(jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(a),
                             _field_geometry(a)):
      off = _field_offset(box, geo, len(field.shape))
      fields.append(jax.make_array_from_callback(
          tuple(field.shape), field.sharding, lambda idx, x=x, off=off, shape=tuple(field.shape): x[tuple(
              slice(s.indices(d)[0] - o, s.indices(d)[1] - o) for s, d, o in zip(idx, shape, off))]))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(host), fields)


def _field_geometry(leaf) -> list[tuple[tuple[int, ...], bool]]:
  """For each array of a (quantised) leaf, in flatten order: dense elements per element
  along each dense axis, and whether the array lacks the K axis (per-channel fp8 scales)."""
  from mlkit.quant import Fp8Weight, Int4Weight
  nd = len(leaf.shape)
  ones = (1,) * nd
  def at_k(f, n=1):  # factor f on K (axis -2), and on N too when n == 2
    return ones[:-2] + (f, f if n == 2 else 1)
  if isinstance(leaf, Int4Weight):
    return [(at_k(2), False), (at_k(leaf.group_size), False)]  # packed, scales
  if isinstance(leaf, Fp8Weight):
    if leaf.block_size is None:
      return [(ones, False), (ones, True)]  # values, per-channel scales [..., N]
    return [(ones, False), (at_k(leaf.block_size, 2), False)]
  return [(ones, False)]


def _quant_units(leaf) -> tuple[int, ...]:
  """Per dense axis, the run of elements quantised together (what a part read must keep whole)."""
  from mlkit.quant import Fp8Weight, Int4Weight
  shape = tuple(leaf.shape)
  units = [1] * len(shape)
  if isinstance(leaf, Int4Weight):
    units[-2] = leaf.group_size
  elif isinstance(leaf, Fp8Weight) and leaf.block_size is not None:
    units[-2] = units[-1] = leaf.block_size
  elif isinstance(leaf, Fp8Weight):
    units[-2] = shape[-2]  # one scale per output channel over all of K
  return tuple(units)


def _dense_range(idx, field_shape, dense_shape, geo) -> list[tuple[int, int]]:
  """The dense ``(start, stop)`` per axis that a field's index (slices) stands for."""
  factors, no_k = geo
  nd = len(dense_shape)
  ranges = [s.indices(d)[:2] for s, d in zip(idx, field_shape)]
  if no_k:
    ranges.insert(nd - 2, (0, dense_shape[nd - 2]))
  return [(s * f, min(e * f, d)) for (s, e), f, d in zip(ranges, factors, dense_shape)]


def _field_offset(box, geo, field_ndim: int) -> tuple[int, ...]:
  """Where ``box`` (dense, aligned to the quantisation units) starts in a field's elements."""
  factors, no_k = geo
  off = [s // f for (s, _), f in zip(box, factors)]
  if no_k:
    del off[len(box) - 2]
  assert len(off) == field_ndim
  return tuple(off)


class _Progress:
  """Logs bytes read and the rate every few seconds, and once at the end."""

  EVERY_S = 5.0

  def __init__(self, total: int):
    self.total, self.done_bytes = total, 0
    self.t0 = self.last = time.perf_counter()

  def add(self, n: int) -> None:
    self.done_bytes += n
    now = time.perf_counter()
    if now - self.last >= self.EVERY_S:
      self.last = now
      log.info("%s: %.2f of %.2f GB read (%.0f MB/s)", _LOAD, self.done_bytes / 1e9,
               self.total / 1e9, self.done_bytes / 1e6 / max(now - self.t0, 1e-9))

  def done(self) -> None:
    dt = time.perf_counter() - self.t0
    log.info("%s: %.2f GB read in %.1f s (%.0f MB/s)", _LOAD, self.done_bytes / 1e9, dt,
             self.done_bytes / 1e6 / max(dt, 1e-9))
