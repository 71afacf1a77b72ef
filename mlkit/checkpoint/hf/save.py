"""Writing our params tree as a Hugging Face checkpoint (``config.json`` + safetensors).

The inverse of load.py, kept apart from it because it shares none of its
machinery (no reader, streaming or sharding): it walks the same name table
(:func:`~mlkit.checkpoint.hf.names.hf_layout`) and shards into files of roughly
equal bytes. Three formats:

- ``"dense"``: every tensor in the dtype config.json declares (quantised leaves
  dequantised into it), so that loading the export back converts nothing;
- ``"compressed-tensors"``: INT4 leaves as compressed-tensors ``pack-quantized``
  (``weight_packed`` / ``weight_scale`` / ``weight_shape``, the same integers and
  scales; :mod:`~mlkit.checkpoint.hf.quantized`), the rest dense, with the
  ``quantization_config`` that says so (one config group per group size, the
  dense ``nn.Linear`` modules in ``ignore``);
- ``"fp8-block"``: FP8 leaves with 128x128 block scales as ``weight`` (e4m3) and
  ``weight_scale_inv``, the rest dense, with DeepSeek-V3's ``quantization_config``
  (the dense ``nn.Linear`` modules in ``modules_to_not_convert``).

Either quantised export loads back bit for bit, here and in the engines that read
those formats.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from mlkit.checkpoint.hf.config import CONFIG_FILE, config_to_hf
from mlkit.checkpoint.hf.names import keypath_entry, dotted_path, hf_layout, is_linear, module_name
from mlkit.checkpoint.hf.quantized import (COMPRESSED_TENSORS, FP8, PACK_QUANTIZED,
                                           int4_to_packed)
from mlkit.checkpoint.hf.safetensors import INDEX_FILE, SINGLE_FILE
from mlkit.config import ModelConfig
from mlkit.model.params import check_params, mtp_parts
from mlkit.quant import Fp8Weight, Int4Weight, dequantize

FORMATS = ("dense", "compressed-tensors", "fp8-block")


def save_hf_checkpoint(path: str | os.PathLike, params, cfg: ModelConfig, *, shards: int = 1,
                       format: str = "dense") -> None:
  """Writes params in the DeepSeek-V3 HF layout (``config.json`` + safetensors).

  Args:
    path: output directory (created if missing; existing files of the same names are replaced).
    params: our params tree for ``cfg`` (with its ``mtp`` layers, if any, written as
      DeepSeek-V3 names them).
    cfg: an MLA ModelConfig.
    shards: number of safetensors files; more than one also writes ``model.safetensors.index.json``.
    format: "dense" (quantised leaves written dequantised), "compressed-tensors" (INT4
      leaves pack-quantized) or "fp8-block" (FP8 leaves with 128x128 block scales); see
      the module docstring.

  Raises:
    ValueError: ``shards`` or ``format`` out of range, a GQA/indexer config, params that
      do not match ``cfg`` (:func:`mlkit.model.check_params`: names the first leaf that
      differs), or, naming the leaf, a quantised leaf the format cannot hold (FP8 in
      compressed-tensors, INT4 or per-channel FP8 in fp8-block), or no leaf in the
      format at all.
  """
  if format not in FORMATS:
    raise ValueError(f"save_hf_checkpoint: format must be one of {FORMATS}, got {format!r}")
  hf_config = config_to_hf(cfg)
  check_params(params, cfg, where="save_hf_checkpoint")
  targets, _ = hf_layout(cfg, mtp=mtp_parts(params["mtp"]) if "mtp" in params else None)
  flat = {tuple(keypath_entry(k) for k in p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))[0]}
  tensors: dict[str, np.ndarray] = {}
  quantised: dict[str, int | None] = {}  # module -> int4 group size (None: fp8)
  for t in targets:
    leaf = flat[t.path]
    if format != "dense" and isinstance(leaf, (Int4Weight, Fp8Weight)):
      _check_format(leaf, format, dotted_path(t.path))
      for n, parts in zip(t.names, _quantised_tensors(leaf, t.kind, len(t.names))):
        m = module_name(n)
        quantised[m] = leaf.group_size if isinstance(leaf, Int4Weight) else None
        if isinstance(leaf, Int4Weight):
          packed, scale = parts
          tensors.update({m + ".weight_packed": packed, m + ".weight_scale": scale,
                          m + ".weight_shape": np.asarray(t.hf_shape, np.int32)})
        else:
          tensors[n], tensors[n + "_scale_inv"] = parts
      continue
    # Every dense tensor in the dtype config.json declares (quantised leaves dequantised into
    # it), so that loading the export back converts nothing.
    arr = np.asarray(dequantize(leaf, jnp.dtype(t.dtype or cfg.param_dtype)))
    if t.kind == "copy":
      tensors[t.names[0]] = np.ascontiguousarray(arr)
    elif t.kind == "T":
      tensors[t.names[0]] = np.ascontiguousarray(arr.T)
    else:
      for e, n in enumerate(t.names):
        tensors[n] = np.ascontiguousarray(arr[e].T)
  if format != "dense":
    if not quantised:
      want = "INT4" if format == COMPRESSED_TENSORS else "FP8 (128x128 blocks)"
      raise ValueError(f"save_hf_checkpoint: format {format!r} writes {want} weights, and params "
                       "hold none (quantise them first, e.g. with a recipe)")
    dense_linear = sorted({module_name(n) for t in targets for n in t.names
                           if is_linear(module_name(n)) and module_name(n) not in quantised})
    hf_config["quantization_config"] = (_compressed_tensors_config(quantised, dense_linear)
                                        if format == COMPRESSED_TENSORS else
                                        _fp8_config(dense_linear))
  if not isinstance(shards, int) or not 1 <= shards <= len(tensors):
    raise ValueError(f"save_hf_checkpoint: shards must be an int in [1, {len(tensors)}], got {shards!r}")

  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  names = list(tensors)
  if shards == 1:
    groups = [(SINGLE_FILE, names)]
  else:
    # Contiguous groups of roughly equal bytes, each non-empty.
    total = sum(tensors[n].nbytes for n in names)
    groups, cur, acc = [], [], 0
    for i, n in enumerate(names):
      cur.append(n)
      acc += tensors[n].nbytes
      left_names, left_groups = len(names) - i - 1, shards - len(groups) - 1
      if left_groups and (acc >= total * (len(groups) + 1) / shards or left_names == left_groups):
        groups.append(cur)
        cur = []
    groups.append(cur)
    groups = [(f"model-{i + 1:05d}-of-{shards:05d}.safetensors", g) for i, g in enumerate(groups)]
  for fname, group in groups:
    save_file({n: tensors[n] for n in group}, os.path.join(path, fname), metadata={"format": "pt"})
  if shards > 1:
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": {n: fname for fname, group in groups for n in group}}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)


def _check_format(leaf, format: str, name: str) -> None:
  if format == COMPRESSED_TENSORS and not isinstance(leaf, Int4Weight):
    raise ValueError(f"save_hf_checkpoint: {name} is {type(leaf).__name__}; format "
                     f"{COMPRESSED_TENSORS!r} writes INT4 ({PACK_QUANTIZED}) weights and dense "
                     "ones (write FP8 weights with format='fp8-block')")
  if format == "fp8-block" and (not isinstance(leaf, Fp8Weight) or leaf.block_size != 128):
    what = "per-channel FP8" if isinstance(leaf, Fp8Weight) else type(leaf).__name__
    raise ValueError(f"save_hf_checkpoint: {name} is {what}; format 'fp8-block' writes FP8 weights "
                     "with 128x128 block scales and dense ones (write INT4 weights with "
                     "format='compressed-tensors')")


def _quantised_tensors(leaf, kind: str, n: int):
  """Per HF tensor of a quantised leaf (one, or one per expert): (weight, scales) as the format
  stores them ([out, in] order)."""
  if isinstance(leaf, Int4Weight):
    w = leaf.to_layout("kn")
    a, s = np.asarray(w.packed), np.asarray(w.scales)
    conv = int4_to_packed
  else:
    a, s = np.asarray(leaf.values), np.asarray(leaf.scales)

    def conv(v, sc):
      return np.ascontiguousarray(v.T), np.ascontiguousarray(sc.T.astype(np.float32))
  if kind == "stack":
    return [conv(a[e], s[e]) for e in range(n)]
  return [conv(a, s)]


def _compressed_tensors_config(quantised: dict[str, int], dense_linear: list[str]) -> dict:
  """compressed-tensors' quantization_config: one INT4 group per group size, targeting its
  modules by name when there are several sizes, else every Linear less ``ignore``."""
  by_group: dict[int, list[str]] = {}
  for m, g in sorted(quantised.items()):
    by_group.setdefault(g, []).append(m)
  groups = {}
  for i, (g, modules) in enumerate(sorted(by_group.items())):
    groups[f"group_{i}"] = {
        "targets": ["Linear"] if len(by_group) == 1 else modules,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": g, "dynamic": False, "actorder": None, "observer": "minmax",
                    "observer_kwargs": {}, "block_structure": None},
        "input_activations": None, "output_activations": None, "format": PACK_QUANTIZED}
  return {"quant_method": COMPRESSED_TENSORS, "format": PACK_QUANTIZED,
          "quantization_status": "compressed", "config_groups": groups, "ignore": dense_linear,
          "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None}


def _fp8_config(dense_linear: list[str]) -> dict:
  """DeepSeek-V3's quantization_config, with the dense Linear modules named (transformers and
  vLLM read ``modules_to_not_convert``)."""
  return {"quant_method": FP8, "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128], "modules_to_not_convert": dense_linear}
