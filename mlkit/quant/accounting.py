"""Weight-memory accounting per recipe, in total and per device.

Works on real params, on quantised trees, and on shape-only trees
(``jax.ShapeDtypeStruct`` leaves), so the 1T-parameter presets are counted
without instantiating a weight: the recipe's quantiser is run under
``jax.eval_shape`` to get each quantised leaf's exact shapes (packed values and
scales).

**Conventions that reproduce the report (checked in tests/test_quant_accounting.py).**

* What a checkpoint holds (:func:`checkpoint_specs`): the serving model's
  params, plus the ``n_mtp_layers`` multi-token-prediction layers a checkpoint
  ships (GLM 5.2 ships one: a full MoE block plus ``eh_proj`` [2D, D] and three
  norms; the GLM_5_2 preset sets n_mtp_layers=1), plus GLM's
  sparse-attention indexer weights (``indexer_*`` in each attention block). Both
  extras stay bf16 in every preset recipe, as do ``embed``, ``lm_head``, norms and
  routers (routers are f32 in this model).
* Recipes: ``FP8_ALL`` (block-128 f32 scales) for GLM's fp8 checkpoint and
  ``INT4_EXPERTS`` (group 32, bf16 scales, the rest bf16) for the int4 ones.
* Units: the report's GLM figures (705 / 421, and 88 / 52 per GPU at TP 8) are
  binary GiB (2**30 bytes, what loaded-memory readings show): fp8 gives 704 GiB
  and int4 experts 421 GiB. Its Kimi K2.6 figure (594) is decimal GB (10**9, the
  published checkpoint size): int4 experts at group 32 give 594 GB. Reading GLM's
  fp8 figure as decimal GB fails (756 GB, +7%), and so does Kimi's as GiB
  (553 GiB, -7%), which is how these conventions were pinned down.

**Per-device layout** (``tp`` x ``ep`` devices, mesh axes tensor x expert): every
routed-expert tensor (3-D) is split over all ``tp * ep`` devices (experts over
``ep``, the FFN width over ``tp``); every other >= 2-D weight, embeddings and
head included (vocab-parallel), is split ``tp`` ways and replicated across the
expert axis; 1-D params are replicated everywhere. So at ``tp=8, ep=1`` a device
holds about an eighth of the total (705 / 8 = 88, 421 / 8 = 52.6).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from mlkit.quant.formats import Fp8Weight, Int4Weight, stored_nbytes
from mlkit.quant.recipe import FormatSpec, Keep, Recipe, assign_formats, quantize_leaf
from mlkit.quant.tree import flatten_params, is_quantised

GB = 10**9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class WeightBytes:
  """Weight memory of one params tree under one recipe and layout."""

  # Bytes of all weights (one copy).
  total: int
  # Bytes on the most loaded device.
  per_device: int
  # Devices in the layout (tp * ep).
  n_devices: int
  # Total bytes by storage kind: "int4" (packed), "int4_scales", "fp8", "fp8_scales",
  # and dense dtype names ("bfloat16", "float32").
  by_kind: dict[str, int]

  def total_in(self, unit: int) -> float:
    """Total in ``unit`` (GB or GIB)."""
    return self.total / unit

  def per_device_in(self, unit: int) -> float:
    """Per-device bytes in ``unit`` (GB or GIB)."""
    return self.per_device / unit


def _is_spec_tuple(x) -> bool:
  return isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)


def checkpoint_specs(cfg, specs: Any = None) -> dict:
  """Shape-only tree (``jax.ShapeDtypeStruct`` leaves) of what a checkpoint of ``cfg`` holds.

  Args:
    cfg: a ``ModelConfig``; ``n_mtp_layers`` extra layers and, when
      ``index_n_heads > 0``, the sparse-attention indexer weights are added.
    specs: the serving model's spec tree (``mlkit.model.param_specs(cfg)``: leaves
      ``(shape, kind[, dtype])``); computed when omitted.

  Returns:
    {embed, final_norm, [lm_head], layers: [...]} with MTP layers appended to
    ``layers`` (each with extra ``eh_proj`` [2D, D], ``enorm``, ``hnorm``,
    ``head_norm`` [D]) and ``attn/indexer_{wq_b,wk,k_norm,weights_proj}``.
    Leaves default to ``cfg.param_dtype``.
  """
  if specs is None:
    from mlkit.model.params import param_specs  # lazy: quant sits below model
    specs = param_specs(cfg)
  dtype = jnp.dtype(cfg.param_dtype)

  def to_sds(s):
    return jax.ShapeDtypeStruct(s[0], jnp.dtype(s[2]) if len(s) == 3 else dtype)

  tree = jax.tree_util.tree_map(to_sds, specs, is_leaf=_is_spec_tuple)
  tree = dict(tree)
  layers = list(tree["layers"])
  D = cfg.d_model
  for _ in range(cfg.n_mtp_layers):
    mtp = jax.tree_util.tree_map(lambda x: x, layers[-1])  # a MoE block like the last layer
    mtp = dict(mtp)
    mtp["eh_proj"] = jax.ShapeDtypeStruct((2 * D, D), dtype)
    for n in ("enorm", "hnorm", "head_norm"):
      mtp[n] = jax.ShapeDtypeStruct((D,), dtype)
    layers.append(mtp)
  if cfg.index_n_heads and not cfg.sparse_attention:  # declared only: add what GLM 5 ships
    nh, hd = cfg.index_n_heads, cfg.index_head_dim
    q_in = cfg.q_lora_rank or D
    indexer = {"indexer_wq_b": jax.ShapeDtypeStruct((q_in, nh * hd), dtype),
               "indexer_wk": jax.ShapeDtypeStruct((D, hd), dtype),
               "indexer_k_norm": jax.ShapeDtypeStruct((2 * hd,), dtype),  # LayerNorm weight + bias
               "indexer_weights_proj": jax.ShapeDtypeStruct((D, nh), dtype)}
    layers = [dict(lp, attn={**lp["attn"], **indexer}) for lp in layers]
  tree["layers"] = layers
  return tree


@functools.lru_cache(maxsize=None)
def _quantised_leaf_bytes(shape: tuple[int, ...], dtype: str, spec: FormatSpec) -> dict[str, int]:
  out = jax.eval_shape(lambda w: quantize_leaf(w, spec, name="(shape)"),
                       jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
  return _leaf_bytes(out)


def _nbytes(x) -> int:
  return stored_nbytes(x.shape, x.dtype)


def _leaf_bytes(leaf) -> dict[str, int]:
  if isinstance(leaf, Int4Weight):
    return {"int4": _nbytes(leaf.packed), "int4_scales": _nbytes(leaf.scales)}
  if isinstance(leaf, Fp8Weight):
    return {"fp8": _nbytes(leaf.values), "fp8_scales": _nbytes(leaf.scales)}
  return {jnp.dtype(leaf.dtype).name: _nbytes(leaf)}


def weight_bytes(tree, recipe: Recipe | None = None, *, tp: int = 1, ep: int = 1) -> WeightBytes:
  """Weight bytes of ``tree`` under ``recipe``, in total and per device.

  Args:
    tree: params (arrays or already-quantised formats) or a shape-only tree
      (``jax.ShapeDtypeStruct`` leaves, e.g. :func:`checkpoint_specs`).
    recipe: formats to count the weights in; None counts the tree as it is.
    tp: tensor-parallel degree.
    ep: expert-parallel degree (devices = tp * ep; see the module docstring).

  Returns:
    A :class:`WeightBytes`.

  Raises:
    ValueError: for tp/ep < 1, and for recipe mismatches (see ``assign_formats``).
  """
  for name, v in (("tp", tp), ("ep", ep)):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"weight_bytes: {name} must be a positive int, got {v!r}")
  flat, _ = flatten_params(tree)
  specs = assign_formats(tree, recipe) if recipe is not None else {}
  total, per_device, by_kind = 0, 0, {}
  for path, leaf in flat:
    spec = specs.get(path, Keep())
    if isinstance(spec, Keep) or is_quantised(leaf):
      if isinstance(spec, Keep) and spec.dtype is not None and not is_quantised(leaf):
        leaf = jax.ShapeDtypeStruct(leaf.shape, jnp.dtype(spec.dtype))
      parts = _leaf_bytes(leaf)
    else:
      parts = _quantised_leaf_bytes(tuple(leaf.shape), jnp.dtype(leaf.dtype).name, spec)
    ndim = len(leaf.shape)
    factor = 1 if ndim == 1 else (tp * ep if ndim == 3 else tp)
    for kind, b in parts.items():
      by_kind[kind] = by_kind.get(kind, 0) + b
      total += b
      per_device += -(-b // factor)
  return WeightBytes(total=total, per_device=per_device, n_devices=tp * ep, by_kind=by_kind)
