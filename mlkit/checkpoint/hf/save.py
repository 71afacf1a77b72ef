"""Writing our params tree as a Hugging Face checkpoint (``config.json`` + safetensors).

The inverse of load.py, kept apart from it because it shares none of its
machinery (no reader, streaming or sharding): it walks the same name table
(:func:`~mlkit.checkpoint.hf.names.hf_layout`), writes each tensor in the dtype
config.json declares (quantised leaves dequantised into it) so that loading the
export back converts nothing, and shards into files of roughly equal bytes.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from mlkit.checkpoint.hf.config import CONFIG_FILE, config_to_hf
from mlkit.checkpoint.hf.names import _key, hf_layout
from mlkit.checkpoint.hf.safetensors import INDEX_FILE, SINGLE_FILE
from mlkit.config import ModelConfig
from mlkit.model.params import check_params
from mlkit.quant import dequantize


def save_hf_checkpoint(path: str | os.PathLike, params, cfg: ModelConfig, *, shards: int = 1) -> None:
  """Writes params in the DeepSeek-V3 HF layout (``config.json`` + safetensors).

  Args:
    path: output directory (created if missing; existing files of the same names are replaced).
    params: our params tree for ``cfg``; quantised leaves are written dequantised.
    cfg: an MLA ModelConfig.
    shards: number of safetensors files; more than one also writes ``model.safetensors.index.json``.

  Raises:
    ValueError: ``shards`` out of range, a GQA/indexer config, or params that do not
      match ``cfg`` (:func:`mlkit.model.check_params`: names the first leaf that differs).
  """
  hf_config = config_to_hf(cfg)
  check_params(params, cfg, where="save_hf_checkpoint")
  targets, _ = hf_layout(cfg)
  flat = {tuple(_key(k) for k in p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))[0]}
  tensors: dict[str, np.ndarray] = {}
  for t in targets:
    # Every tensor in the dtype config.json declares (quantised leaves dequantised into it),
    # so that loading the export back converts nothing.
    arr = np.asarray(dequantize(flat[t.path], jnp.dtype(t.dtype or cfg.param_dtype)))
    if t.kind == "copy":
      tensors[t.names[0]] = np.ascontiguousarray(arr)
    elif t.kind == "T":
      tensors[t.names[0]] = np.ascontiguousarray(arr.T)
    else:
      for e, n in enumerate(t.names):
        tensors[n] = np.ascontiguousarray(arr[e].T)
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
