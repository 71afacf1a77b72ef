"""Loading a Hugging Face checkpoint into our params tree, streamed and sharded.

:func:`open_hf_checkpoint` checks everything the headers allow before the first
read; :class:`HFCheckpoint` then reads one parameter at a time, and
:class:`_LeafConverter` quantises it and places its shards, so that host memory
holds one parameter, never the whole tree (docs/checkpoints.md, "Streaming
import"). :func:`load_hf_checkpoint` is ``open_hf_checkpoint(...).load()``.

The default keeps what the publisher shipped: compressed-tensors INT4 weights load
as :class:`~mlkit.quant.Int4Weight` and fp8 weights with 128x128 block scales as
:class:`~mlkit.quant.Fp8Weight`, their integers, values and scales bit for bit
(:mod:`~mlkit.checkpoint.hf.quantized`). A recipe changes formats as
:func:`mlkit.quant.published_conversion` allows (fp8 to int4 dequantises per tensor
and quantises; int4 to fp8 is refused). Fp8 weights our formats cannot hold (other
block shapes, or parameters that stay dense) are dequantised to the parameter dtype.

The multi-token-prediction layers that config.json declares
(``num_nextn_predict_layers`` of them, after the last layer) are loaded into
``params["mtp"]`` when the checkpoint holds them; rotary ``inv_freq`` buffers are
skipped; any other tensor the config does not explain is an error.

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
from mlkit.checkpoint.hf.config import CONFIG_FILE, declared_dtype, config_from_hf
from mlkit.checkpoint.hf.names import (dotted_path, Target, hf_layout, module_name, mtp_layer_index)
from mlkit.checkpoint.hf.quantized import (COMPRESSED_TENSORS, REFUSED_SUFFIXES, PublishedQuant,
                                           int4_from_packed, parse_quantization_config)
from mlkit.checkpoint.hf.safetensors import (FP8_DTYPES, LOAD_OP, check_fp8_scales, Reader,
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
# INT4 scales are kept in their stored dtype; f16 ones are widened to f32 (exactly).
_INT4_SCALE_DTYPES = {"BF16": "bfloat16", "F32": "float32", "F16": "float32"}
_FP8_BLOCK = (128, 128)  # the block shape Fp8Weight holds


@dataclasses.dataclass(frozen=True)
class _Source:
  """How one parameter is stored: "dense" (fp8 read dequantised), "int4" (compressed-tensors)
  or "fp8" (128x128 block scales), with the stored tensors behind it."""

  kind: str
  stored: tuple[str, ...]  # every tensor read for it (weights, scales, shapes)
  group_size: int | None = None  # int4
  scale_dtype: str | None = None  # int4: the scales' dtype as loaded


def _resolve_dtype(path: str, cfg_file: str, chosen: str | None, explicit: bool, reader: Reader,
                   targets: list[Target]) -> str:
  """The parameter dtype to load into (see :func:`load_hf_checkpoint`, "Dtype").

  Args:
    path / cfg_file: the checkpoint directory and its config.json, for messages.
    chosen: the dtype ``dtype=`` or config.json names, or None if neither does.
    explicit: ``chosen`` comes from ``dtype=`` (narrowing is then allowed, and logged).
    reader / targets: the tensors and the leaves they fill (packed INT4 modules have no
      ``.weight`` tensor and do not count).
  """
  stored = {}  # safetensors dtype -> first tensor stored in it (tensors of the param dtype)
  for t in targets:
    for n in t.names:
      if not reader.has(n):
        continue
      st = reader.st_dtype(n)
      if st not in FP8_DTYPES and t.dtype is None:
        stored.setdefault(st, n)
  if chosen is None:
    if len(stored) != 1:
      found = ", ".join(f"{n} is {st}" for st, n in sorted(stored.items()))
      raise CheckpointError(LOAD_OP, cfg_file, f"declares no 'torch_dtype' and the tensors disagree "
                                             f"({found}); pass dtype= to choose one")
    (st, n), = stored.items()
    if st not in _ST_NAMES:
      raise CheckpointError(LOAD_OP, reader.file(n), f"config.json declares no 'torch_dtype' and the "
                                                   f"tensors are {st} (e.g. {n}); pass dtype='bfloat16' "
                                                   "or 'float32'")
    log.info("%s: %s declares no torch_dtype; using the tensors' own dtype %s", LOAD_OP, cfg_file,
             _ST_NAMES[st])
    return _ST_NAMES[st]
  narrowed = []
  for t in targets:
    want = t.dtype or chosen
    narrowed += [(n, reader.st_dtype(n), want) for n in t.names if reader.has(n)
                 and reader.st_dtype(n) not in FP8_DTYPES and (reader.st_dtype(n), want) not in _LOSSLESS]
  if narrowed and not explicit:
    n, st, want = narrowed[0]
    raise CheckpointError(LOAD_OP, reader.file(n), f"tensor {n} is {st} but config.json declares "
                                                 f"torch_dtype {want}; converting {len(narrowed)} "
                                                 f"tensor(s) to it loses precision: pass dtype='{want}' "
                                                 "to convert explicitly (or dtype='float32')")
  if narrowed:
    n, st, want = narrowed[0]
    log.warning("%s: %s: converting %d tensor(s) to the narrower dtype %s as dtype= asks (e.g. %s "
                "is %s)", LOAD_OP, path, len(narrowed), want, n, st)
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

  Published formats: without a recipe (or where the recipe keeps a parameter, or
  asks for the format it already has), compressed-tensors INT4 weights load as
  ``Int4Weight`` and fp8 weights with 128x128 block scales as ``Fp8Weight``, bit
  for bit. A recipe that asks for int4 where the checkpoint has fp8 dequantises
  each such tensor (f32) and quantises it (logged); one that asks for fp8 (or
  another group size) where it has int4 is refused (docs/checkpoints.md).

  Dtype: the dense parameters are stored in ``dtype`` if given, else in config.json's
  ``torch_dtype`` (or ``dtype``), else in the stored tensors' own dtype when they all
  agree (router weights and bias are always f32; fp8 weights that are not kept as
  fp8 are dequantised). A conversion that loses precision (an f32 tensor into bf16)
  is never silent: it must be asked for with ``dtype=``, and is logged.

  Layers: the checkpoint's layers must be those of ``num_hidden_layers``, plus the
  multi-token-prediction layers config.json declares (indices ``num_hidden_layers``
  to ``num_hidden_layers + num_nextn_predict_layers - 1``), which go to
  ``params["mtp"]`` when the checkpoint holds them (checked against their shapes
  like every other tensor; the model does not run them).

  Args:
    path: directory with ``config.json`` and ``*.safetensors`` (single or sharded with
      ``model.safetensors.index.json``).
    dtype: parameter dtype ("bfloat16"/"float32"); see "Dtype" above.
    recipe: a ``mlkit.quant.Recipe`` applied leaf by leaf as it is read (round to
      nearest; GPTQ needs calibration activations and is refused here), or None
      to keep the weights as stored.
    mesh: place every parameter's shards on this mesh as it is read (by
      ``mlkit.parallel.param_shardings`` with ``rules``), or None for the
      default device.
    rules: logical-axis rules with ``mesh`` (default ``mlkit.parallel.DEFAULT_RULES``).
    int4_layout: the int4 weights' layout: "kn" (packed, as checkpoints hold
      them) or "nk" (what the GPU kernels read, ``mlkit.quant.
      kernel_int4_layout()``), relaid after loading one leaf at a time, each
      packed copy freed before the next.

  Returns:
    (params, cfg): params laid out as ``init_params(cfg)`` (router weights/bias in f32)
    plus ``"mtp"`` when the checkpoint ships those layers, in the published formats or
    the recipe's, and placed on ``mesh`` when given.

  Raises:
    FileNotFoundError: the directory, ``config.json``, a shard or all safetensors are missing.
    CheckpointError: (a ValueError) naming the file: invalid JSON in config.json or the
      index, a bad config field, a quantisation scheme this loader does not read (names
      the scheme), a truncated or corrupt safetensors file, a missing tensor, a wrong
      shape (with expected and actual shapes), unexpected tensor names, tensors that
      disagree with ``quantization_config``, a layer beyond the config's layers and
      declared MTP layers, tensors whose dtypes disagree when no dtype is declared, a
      narrowing conversion not asked for, or a recipe that would convert a published
      int4 weight (names the tensor).
    ValueError: a recipe that does not fit the model or asks for GPTQ; rules without a
      mesh; an unknown int4_layout (before anything is read).
  """
  from mlkit.quant.formats import INT4_LAYOUTS, relaid_int4
  if int4_layout not in INT4_LAYOUTS:
    raise ValueError(f"{LOAD_OP}: int4_layout must be one of {INT4_LAYOUTS}, got {int4_layout!r}")
  params, cfg = open_hf_checkpoint(path, dtype=dtype, recipe=recipe, mesh=mesh,
                                   rules=rules).load()
  return relaid_int4(params, int4_layout, free_source=True), cfg


def open_hf_checkpoint(path: str | os.PathLike, *, dtype=None, recipe=None, mesh=None,
                       rules=None) -> "HFCheckpoint":
  """Opens and checks a checkpoint for :func:`load_hf_checkpoint`, reading no tensor yet.

  Everything that can be checked from config.json and the safetensors headers is
  checked here (names, shapes, dtypes, the published quantisation, the recipe's
  formats, the shardings), so that a conversion fails before its first read (only
  the 8-byte ``weight_shape`` tensors of packed INT4 modules are read here).
  Arguments, returns and errors are those of :func:`load_hf_checkpoint`; the
  parameters are then read one at a time with :meth:`HFCheckpoint.leaf` (what
  ``mlkit.convert`` does, skipping those already converted) or all together with
  :meth:`HFCheckpoint.load`.
  """
  if rules is not None and mesh is None:
    raise ValueError(f"{LOAD_OP}: rules= needs a mesh=")
  path = os.fspath(path)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"{LOAD_OP}: {path} is not a directory")
  cfg_file = os.path.join(path, CONFIG_FILE)
  if not os.path.exists(cfg_file):
    raise FileNotFoundError(f"{LOAD_OP}: {cfg_file} is missing")
  hf_config = read_json(LOAD_OP, cfg_file)
  declared = dtype is not None or declared_dtype(hf_config) is not None
  try:
    # The layout does not depend on the dtype; without a declared one it comes from the tensors.
    cfg = config_from_hf(hf_config, dtype=dtype if declared else "float32")
  except ValueError as e:
    raise CheckpointError(LOAD_OP, cfg_file, str(e)) from e
  quant = parse_quantization_config(hf_config, cfg_file)

  reader = Reader(path)
  present = reader.names()
  mtp = _mtp_parts(reader, cfg)
  targets, treedef = hf_layout(cfg, mtp=mtp)
  if quant.method == COMPRESSED_TENSORS:
    _check_ignore(quant, cfg, cfg_file)
  sources = [_source(t, reader, quant, path) for t in targets]
  expected = {n for s in sources for n in s.stored}
  unexpected = []
  for n in sorted(present - expected):
    m = _LAYER_RE.match(n)
    base, _, suffix = n.rpartition(".")
    if m and int(m.group(1)) >= cfg.n_layers + cfg.n_mtp_layers:
      raise CheckpointError(LOAD_OP, reader.file(n), f"tensor {n} belongs to layer {m.group(1)}, but "
                                                   f"config.json declares num_hidden_layers={cfg.n_layers} "
                                                   f"and num_nextn_predict_layers={cfg.n_mtp_layers}")
    elif n.endswith("rotary_emb.inv_freq"):
      continue  # a recomputable buffer some exporters include
    elif suffix in REFUSED_SUFFIXES:
      raise CheckpointError(LOAD_OP, reader.file(n), f"tensor {n} is {REFUSED_SUFFIXES[suffix]}, which "
                                                   f"this loader does not read (module {base})")
    elif n.endswith("_scale_inv") and n.removesuffix("_scale_inv") in expected:
      raise CheckpointError(LOAD_OP, reader.file(n), f"{n} given but {n.removesuffix('_scale_inv')} is "
                                                   f"{reader.st_dtype(n.removesuffix('_scale_inv'))}, "
                                                   "not fp8")
    else:
      unexpected.append(n)
  if unexpected:
    raise CheckpointError(LOAD_OP, reader.file(unexpected[0]),
                          f"unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
                          f"({len(unexpected)} in all) for this config")
  if cfg.n_mtp_layers and mtp is None:
    log.info("%s: config.json declares %d multi-token-prediction layer(s); the checkpoint holds "
             "none", LOAD_OP, cfg.n_mtp_layers)
  elif mtp is not None:
    log.info("%s: loading %d multi-token-prediction layer(s) into params['mtp'] (layers %d..%d)",
             LOAD_OP, cfg.n_mtp_layers, cfg.n_layers, cfg.n_layers + cfg.n_mtp_layers - 1)
  dt = _resolve_dtype(path, cfg_file, cfg.param_dtype if declared else None, dtype is not None,
                      reader, targets)
  cfg = dataclasses.replace(cfg, dtype=dt, param_dtype=dt)
  plans, specs, conversions = _plans(targets, treedef, sources, cfg, recipe, reader)
  return HFCheckpoint(path, cfg, reader, targets, treedef, quant.fp8_block, sources, plans,
                      conversions,
                      _LeafConverter(targets, treedef, cfg, recipe, mesh, rules, plans, sources, specs))


def _mtp_parts(reader: Reader, cfg: ModelConfig):
  """The optional parts of the multi-token-prediction layers the checkpoint holds, or None
  for none (``mlkit.model.params.mtp_specs``)."""
  if not any(mtp_layer_index(n, cfg) is not None for n in reader.names()):
    return None
  pre = f"model.layers.{cfg.n_layers}."
  def has(module):
    return reader.has(module + ".weight") or reader.has(module + ".weight_packed")
  parts = set()
  if has(pre + "embed_tokens"):
    parts.add("embed")
  if has(pre + "shared_head.head"):
    parts.add("lm_head")
  if any(n.startswith(pre + "self_attn.indexer.") for n in reader.names()):
    parts.add("indexer")
  return frozenset(parts)


def _check_ignore(quant: PublishedQuant, cfg: ModelConfig, cfg_file: str) -> None:
  """Every ``ignore`` entry must name a module the config declares (a stale or misspelt entry
  would leave the modules it was meant for quantised)."""
  declared_mtp = None
  if cfg.n_mtp_layers:
    declared_mtp = {"embed", "lm_head"} | ({"indexer"} if cfg.sparse_attention else set())
  declared, _ = hf_layout(cfg, mtp=declared_mtp)
  modules = {module_name(n) for t in declared for n in t.names} | {"lm_head"}
  bad = quant.unmatched_ignore(modules)
  if bad:
    raise CheckpointError(LOAD_OP, cfg_file, f"quantization_config ignore entry {bad[0]!r} matches no "
                                           "module this config declares (a misspelt or stale entry "
                                           "would leave the modules it means quantised)")


def _source(t: Target, reader: Reader, quant: PublishedQuant, path: str) -> _Source:
  """How the tensors behind leaf ``t`` are stored, checked against config.json's
  quantization_config and the leaf's shape."""
  kinds, stored, groups, scale_dtypes = [], [], set(), set()
  for n in t.names:
    m = module_name(n)
    group = quant.int4_group_size(m) if n.endswith(".weight") else None
    if reader.has(m + ".weight_packed"):
      kinds.append("int4")
      stored += _int4_tensors(m, n, t.hf_shape, group, reader, quant)
      groups.add(group)
      scale_dtypes.add(_INT4_SCALE_DTYPES[reader.st_dtype(m + ".weight_scale")])
      continue
    if not reader.has(n):
      raise CheckpointError(LOAD_OP, path, f"missing tensor {n} (for {dotted_path(t.path)})")
    if group is not None:
      raise CheckpointError(LOAD_OP, reader.file(n), f"tensor {n} is stored dense ({reader.st_dtype(n)}), "
                                                   f"but quantization_config quantises {m} (INT4 group "
                                                   f"{group}): expected {m}.weight_packed")
    shape = reader.shape(n)
    if shape != t.hf_shape:
      raise CheckpointError(LOAD_OP, reader.file(n), f"tensor {n} has shape {shape}, expected {t.hf_shape}")
    stored.append(n)
    if reader.st_dtype(n) in FP8_DTYPES:
      if not reader.has(n + "_scale_inv"):
        raise CheckpointError(LOAD_OP, reader.file(n), f"fp8 tensor {n} has no {n}_scale_inv block scale")
      try:  # the whole tensor's scales, whatever part of it is read later
        check_fp8_scales(shape, reader.shape(n + "_scale_inv"), quant.fp8_block, n)
      except ValueError as e:
        raise CheckpointError(LOAD_OP, reader.file(n + "_scale_inv"), str(e)) from e
      stored.append(n + "_scale_inv")
      kinds.append("fp8" if reader.st_dtype(n) == "F8_E4M3" else "dense")
    else:
      kinds.append("dense")
  quantisable = len(_our_shape(t)) in (2, 3) and t.dtype is None and t.path[-1] != "embed"
  if "int4" in kinds:
    if set(kinds) != {"int4"}:
      n = t.names[kinds.index("dense" if "dense" in kinds else "fp8")]
      raise CheckpointError(LOAD_OP, reader.file(n), f"tensor {n} is not packed INT4 like the other "
                                                   f"tensors of {dotted_path(t.path)}")
    if not quantisable:
      m = module_name(t.names[0])
      raise CheckpointError(LOAD_OP, reader.file(m + ".weight_packed"),
                            f"tensor {m}.weight_packed is INT4, but {dotted_path(t.path)} stays dense "
                            "in this model (the embedding is gathered by row; routers and norms are "
                            "precision sensitive)")
    if len(groups) != 1 or len(scale_dtypes) != 1:
      raise CheckpointError(LOAD_OP, reader.file(stored[0]), f"the INT4 tensors of {dotted_path(t.path)} "
                                                           f"differ in group size or scale dtype")
    return _Source("int4", tuple(stored), groups.pop(), scale_dtypes.pop())
  # Fp8Weight holds 128x128 blocks of a projection's whole stack; anything else is
  # dequantised into the parameter dtype as it is read.
  if set(kinds) == {"fp8"} and quant.fp8_block == _FP8_BLOCK and quantisable:
    return _Source("fp8", tuple(stored))
  return _Source("dense", tuple(stored))


def _int4_tensors(m: str, n: str, hf_shape, group: int | None, reader: Reader,
                  quant: PublishedQuant) -> list[str]:
  """Checks one packed INT4 module's tensors (config, dtypes, shapes); returns their names."""
  packed = m + ".weight_packed"
  where = reader.file(packed)
  if quant.method != COMPRESSED_TENSORS:
    raise CheckpointError(LOAD_OP, where, f"tensor {packed} is packed INT4, but config.json's "
                                        "quantization_config is not compressed-tensors")
  if group is None:
    raise CheckpointError(LOAD_OP, where, f"tensor {packed} is packed INT4, but quantization_config "
                                        f"leaves {m} dense (its ignore list or config_groups targets)")
  if reader.has(n):
    raise CheckpointError(LOAD_OP, reader.file(n), f"module {m} has both {n} and {packed}")
  for suffix in ("weight_scale", "weight_shape"):
    if not reader.has(f"{m}.{suffix}"):
      raise CheckpointError(LOAD_OP, where, f"missing tensor {m}.{suffix} (packed INT4 {packed} needs "
                                          "its scales and shape)")
  out, k = hf_shape
  checks = [(packed, ("I32",), (out, k // 8)),
            (m + ".weight_scale", tuple(_INT4_SCALE_DTYPES), (out, k // group)),
            (m + ".weight_shape", ("I32", "I64"), (2,))]
  if k % group:
    raise CheckpointError(LOAD_OP, where, f"tensor {packed}: group_size {group} does not divide the "
                                        f"input dim {k} of {m}")
  for name, dtypes, shape in checks:
    st, got = reader.st_dtype(name), reader.shape(name)
    if st not in dtypes:
      raise CheckpointError(LOAD_OP, reader.file(name), f"tensor {name} is {st}, expected one of {dtypes}")
    if got != shape:
      hint = ""
      if name.endswith("weight_scale") and len(got) == 2 and got[1] and k % got[1] == 0:
        hint = (f" for group_size {group} (quantization_config); its shape fits group_size "
                f"{k // got[1]}")
      raise CheckpointError(LOAD_OP, reader.file(name), f"tensor {name} has shape {got}, expected "
                                                      f"{shape}{hint}")
  declared = tuple(int(v) for v in reader.get(m + ".weight_shape"))
  if declared != (out, k):
    raise CheckpointError(LOAD_OP, reader.file(m + ".weight_shape"),
                          f"tensor {m}.weight_shape says {list(declared)}, expected {[out, k]}")
  return [packed, m + ".weight_scale", m + ".weight_shape"]


def _plans(targets, treedef, sources, cfg: ModelConfig, recipe, reader: Reader):
  """Per leaf: "dense" (read, then quantised by the recipe if it says so), "int4" / "fp8"
  (the published format, kept) or "convert" (published fp8, dequantised in f32, quantised by
  the recipe); also the recipe's spec per leaf and {leaf: conversion} for those converted.

  Raises:
    CheckpointError: naming the first tensor and its file, for a conversion the recipe asks
      for that :func:`mlkit.quant.published_conversion` refuses.
  """
  from mlkit.quant.recipe import assign_formats, published_conversion
  specs = [None] * len(targets)
  if recipe is not None:
    dense = jax.tree_util.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(_our_shape(t), jnp.dtype(t.dtype or cfg.param_dtype)) for t in targets])
    specs = list(assign_formats(dense, recipe).values())
  plans, conversions = [], {}
  for t, src, spec in zip(targets, sources, specs):
    if src.kind == "dense":
      plans.append("dense")
      continue
    try:
      how = published_conversion(_published_abstract(t, src), spec, name=dotted_path(t.path))
    except ValueError as e:
      raise CheckpointError(LOAD_OP, reader.file(src.stored[0]),
                            f"tensor {src.stored[0]}: recipe {recipe.name!r}: {e}") from None
    if how is None:
      plans.append(src.kind)
    else:
      plans.append("convert")
      conversions[dotted_path(t.path)] = how
  if conversions:
    first = next(iter(conversions.items()))
    log.info("%s: recipe %r converts %d published weight(s), dequantising each tensor and "
             "quantising it (e.g. %s: %s)", LOAD_OP, recipe.name, len(conversions), *first)
  kept = [f"{sum(p == k for p in plans)} {k}" for k in ("int4", "fp8") if k in plans]
  if kept:
    log.info("%s: keeping the published formats of %s weight(s)", LOAD_OP, " and ".join(kept))
  return plans, specs, conversions


def _published_abstract(t: Target, src: _Source):
  """The Int4Weight / Fp8Weight (of ShapeDtypeStructs) a published leaf loads as."""
  from mlkit.quant import Fp8Weight, Int4Weight
  *lead, k, n = _our_shape(t)
  if src.kind == "int4":
    g = src.group_size
    return Int4Weight(packed=jax.ShapeDtypeStruct((*lead, k // 2, n), jnp.uint8),
                      scales=jax.ShapeDtypeStruct((*lead, k // g, n), jnp.dtype(src.scale_dtype)),
                      group_size=g)
  b = _FP8_BLOCK[0]
  return Fp8Weight(values=jax.ShapeDtypeStruct((*lead, k, n), jnp.float8_e4m3fn),
                   scales=jax.ShapeDtypeStruct((*lead, -(-k // b), -(-n // b)), jnp.float32),
                   block_size=b)


class HFCheckpoint:
  """A checked Hugging Face checkpoint whose parameters are read one at a time.

  Made by :func:`open_hf_checkpoint`. Leaf ``i`` is the ``i``-th leaf of the params
  tree in flatten order (``names[i]``, e.g. ``"layers.1.ffn.w_gate"``).

  Attributes:
    path: the checkpoint directory.
    cfg: the ModelConfig (with the dtype the parameters are loaded in).
    names: every leaf's dotted path, in flatten order.
    abstract: the params tree (in the published formats, or the recipe's) as
      ShapeDtypeStructs, with their shardings when a mesh was given.
    conversions: {leaf name: "fp8 e4m3 block 128 -> int4 g32"} for the published
      weights the recipe converts.
    bytes_read: {leaf name: tensor bytes this process read for it} for the leaves
      read so far (in a multi-process run, only what its devices hold).
  """

  def __init__(self, path: str, cfg: ModelConfig, reader: Reader, targets: list[Target], treedef,
               block: tuple[int, int], sources: list[_Source], plans: list[str],
               conversions: dict[str, str], convert: "_LeafConverter"):
    self.path, self.cfg = path, cfg
    self._reader, self._targets, self._treedef, self._block = reader, targets, treedef, block
    self._sources, self._plans = sources, plans
    self._convert = convert
    self.names = [dotted_path(t.path) for t in targets]
    self.abstract = jax.tree_util.tree_unflatten(treedef, convert.abstract)
    self.conversions = dict(conversions)
    self.bytes_read: dict[str, int] = {}

  def __len__(self) -> int:
    return len(self._targets)

  def nbytes(self, i: int) -> int:
    """Stored bytes of the tensors behind leaf ``i`` (all of them, wherever its shards go)."""
    return sum(self._reader.nbytes(n) for n in self._sources[i].stored)

  def leaf(self, i: int):
    """Reads, converts, quantises and places leaf ``i`` (only this process's part of it)."""
    t, plan = self._targets[i], self._plans[i]
    box = self._convert.box(i)
    before = self._reader.bytes_read
    if plan in ("int4", "fp8"):
      out = self._convert.place(i, self._read_published(t, self._sources[i], box), box)
    else:
      # A conversion quantises the f32 values the fp8 tensors stand for, not a rounding of them.
      out_dtype = jnp.dtype(jnp.float32 if plan == "convert" else t.dtype or self.cfg.param_dtype)
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

  def _read_published(self, t: Target, src: _Source, box):
    """The box (our [E,] K, N coordinates, whole groups or blocks) of a published int4 or fp8
    leaf, as an Int4Weight / Fp8Weight of host arrays: the stored bits, transposed."""
    from mlkit.quant import Fp8Weight, Int4Weight
    reader = self._reader
    names = t.names
    if t.kind == "stack":
      (e0, e1), box = box[0], box[1:]
      names = names[e0:e1]
    (k0, k1), (n0, n1) = box
    parts = []
    for n in names:
      m = module_name(n)
      if src.kind == "int4":
        g = src.group_size
        packed = reader.get(m + ".weight_packed", ((n0, n1), (k0 // 8, k1 // 8)))
        scale = reader.get(m + ".weight_scale", ((n0, n1), (k0 // g, -(-k1 // g))))
        parts.append(int4_from_packed(packed, scale.astype(jnp.dtype(src.scale_dtype))))
      else:
        b = _FP8_BLOCK[0]
        values = reader.get(n, ((n0, n1), (k0, k1)))
        scale = reader.get(n + "_scale_inv", ((n0 // b, -(-n1 // b)), (k0 // b, -(-k1 // b))))
        parts.append((np.ascontiguousarray(values.T), np.ascontiguousarray(scale.astype(np.float32).T)))
    a, s = ((np.stack([p[j] for p in parts]) for j in (0, 1)) if t.kind == "stack" else parts[0])
    if src.kind == "int4":
      return Int4Weight(packed=a, scales=s, group_size=src.group_size)
    return Fp8Weight(values=a, scales=s, block_size=_FP8_BLOCK[0])

  def _read(self, n: str, box) -> np.ndarray:
    """Tensor ``n`` (its ``box`` of HF coordinates), fp8 dequantised."""
    reader = self._reader
    if reader.st_dtype(n) in FP8_DTYPES:
      if not reader.has(n + "_scale_inv"):
        raise CheckpointError(LOAD_OP, reader.file(n), f"fp8 tensor {n} has no {n}_scale_inv block scale")
      shape = reader.shape(n)
      try:  # the whole tensor's scales, whatever part of it is read
        check_fp8_scales(shape, reader.shape(n + "_scale_inv"), self._block, n)
      except ValueError as e:
        raise CheckpointError(LOAD_OP, reader.file(n + "_scale_inv"), str(e)) from e
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
        raise CheckpointError(LOAD_OP, reader.file(n + "_scale_inv"), str(e)) from e
      return w[tuple(slice(a - g, c - g) for (a, c), (g, _) in zip(box, grown))]
    if reader.has(n + "_scale_inv"):
      raise CheckpointError(LOAD_OP, reader.file(n), f"{n}_scale_inv given but {n} is "
                                                   f"{reader.st_dtype(n)}, not fp8")
    return reader.get(n, box)


def _our_shape(t: Target) -> tuple[int, ...]:
  if t.kind == "copy":
    return t.hf_shape
  if t.kind == "T":
    return t.hf_shape[::-1]
  return (len(t.names),) + t.hf_shape[::-1]


class _LeafConverter:
  """Quantises one parameter as it is read and places its shards on the mesh.

  The formats and shardings of every leaf are worked out once, from shapes only
  (the published format where it is kept, else the recipe's spec, and
  ``param_shardings`` over ShapeDtypeStructs), so a recipe or rules that do not
  fit the model fail before anything is read.
  Quantisation runs on the host's CPU device (a device-side copy of a whole
  parameter would defeat the point of sharding it).

  With a mesh, :meth:`box` is the part of the dense parameter that this process's
  devices hold (all of it in a single-process run), grown to whole quantisation
  groups; only that part is read and quantised, and each device copies its shard
  out of it.
  """

  def __init__(self, targets, treedef, cfg: ModelConfig, recipe, mesh, rules, plans, sources,
               specs):
    from mlkit.checkpoint.orbax_io import with_param_shardings
    from mlkit.quant.recipe import Int4Spec, quantize_leaf
    from mlkit.quant.tree import is_quantised
    self._quantize_leaf = quantize_leaf
    self.names = [dotted_path(t.path) for t in targets]
    leaves = []
    self.specs = []
    for t, plan, src, spec in zip(targets, plans, sources, specs):
      if plan in ("int4", "fp8"):  # the published format, kept: nothing to quantise
        leaves.append(_published_abstract(t, src))
        self.specs.append(None)
        continue
      dense = jax.ShapeDtypeStruct(_our_shape(t), jnp.dtype(t.dtype or cfg.param_dtype))
      leaves.append(dense if spec is None else
                    jax.eval_shape(lambda w, sp=spec: quantize_leaf(w, sp), dense))
      self.specs.append(spec)
    gptq = [n for n, sp in zip(self.names, self.specs)
            if isinstance(sp, Int4Spec) and sp.method == "gptq"]
    if gptq:
      raise ValueError(f"{LOAD_OP}: recipe {recipe.name!r} uses GPTQ for {gptq[0]!r}, which needs "
                       "calibration activations; quantise after loading (mlkit.quant.gptq)")
    tree = jax.tree_util.tree_unflatten(treedef, leaves)
    self.sharded = mesh is not None
    if self.sharded:
      tree = with_param_shardings(tree, mesh, rules, cfg)
    # Every leaf as it loads (an Int4Weight / Fp8Weight of ShapeDtypeStructs where quantised).
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
    # device_put, not jnp.asarray: the same uncommitted array on the default device, without
    # the copy program jnp.asarray compiles for every leaf shape.
    if spec is None and not self.sharded:
      return jax.device_put(arr)
    if spec is not None:
      with jax.default_device(self._cpu):
        leaf = self._quantize_leaf(jax.device_put(arr), spec, name=self.names[i])
      if not self.sharded:
        return jax.device_put(leaf, jax.local_devices()[0])  # the default device
      host = jax.tree_util.tree_map(np.asarray, leaf)
    else:
      host = arr
    return self.place(i, host, box)

  def place(self, i: int, host, box: tuple[tuple[int, int], ...]):
    """Leaf ``i`` from ``host`` (its final format, host arrays covering ``box``) on its devices."""
    if not self.sharded:
      return jax.device_put(host, jax.local_devices()[0])  # the default device
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
      log.info("%s: %.2f of %.2f GB read (%.0f MB/s)", LOAD_OP, self.done_bytes / 1e9,
               self.total / 1e9, self.done_bytes / 1e6 / max(now - self.t0, 1e-9))

  def done(self) -> None:
    dt = time.perf_counter() - self.t0
    log.info("%s: %.2f GB read in %.1f s (%.0f MB/s)", LOAD_OP, self.done_bytes / 1e9, dt,
             self.done_bytes / 1e6 / max(dt, 1e-9))
