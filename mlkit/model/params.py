"""Parameter layout, initialisation, counting and checking (:func:`check_params`).

Params are a plain nested dict (a pytree). Every projection is stored 2-D as
[in, out] (experts 3-D as [E, in, out]) so that one ``matmul(x, w)`` serves all
weight formats. Layout::

  embed [V, D], final_norm [D], lm_head [D, V] (absent when tied)
  layers[i]:
    attn_norm [D], ffn_norm [D]
    attn (MLA): wq [D, H*(nope+rope)] or wq_a [D, q_lora], q_norm [q_lora], wq_b [q_lora, H*(nope+rope)];
                wkv_a [D, kv_lora+rope], kv_norm [kv_lora], wkv_b [kv_lora, H*(nope+v)], wo [H*v, D]
                plus, on a layer that runs the sparse-attention indexer (cfg.indexer_types "full"):
                indexer_wq_b [q_lora, Hi*Di], indexer_wk [D, Di], indexer_k_norm [Di],
                indexer_k_bias [Di], indexer_weights_proj [D, Hi] (f32)
    attn (GQA): wq [D, H*hd], wk [D, KV*hd], wv [D, KV*hd], wo [H*hd, D]
    ffn (dense): w_gate [D, F], w_up [D, F], w_down [F, D]
    ffn (MoE):   router [D, E] (f32), router_bias [E] (f32, sigmoid routers only),
                 w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D],
                 shared: {w_gate [D, S*F], w_up [D, S*F], w_down [S*F, D]} (when S > 0)
  mtp[j] (optional; only when a checkpoint ships its multi-token-prediction layers):
    a MoE layer as above (attn_norm, ffn_norm, attn, ffn), plus eh_proj [2D, D],
    enorm [D], hnorm [D], head_norm [D], and where the checkpoint has them its own
    embed [V, D], lm_head [D, V] and (sparse attention) indexer weights in attn.

The serving forward (``mlkit.model.apply``) does not run the ``mtp`` layers;
``mlkit.model.mtp`` does (training's MTP loss, later speculative decoding).
:func:`param_specs` and :func:`init_params` leave them out unless asked (``mtp=``),
and :func:`check_params` accepts a tree with or without them.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from mlkit.config import ModelConfig
from mlkit.quant.formats import FP8_BLOCK, INT4_GROUP_SIZES, Fp8Weight, Int4Weight
from mlkit.quant.tree import path_str

# (shape, kind) leaves; kind is "ones", "zeros" or "normal" (fan-in scaled), plus an optional dtype.
Spec = tuple[tuple[int, ...], str]


def _indexer_specs(cfg: ModelConfig) -> dict[str, Spec]:
  """A full sparse-attention layer's indexer (mlkit.model.sparse_attention)."""
  D, Hi, Di = cfg.d_model, cfg.index_n_heads, cfg.index_head_dim
  return {
      "indexer_wq_b": ((cfg.q_lora_rank, Hi * Di), "normal"),
      "indexer_wk": ((D, Di), "normal"),
      "indexer_k_norm": ((Di,), "ones"),
      "indexer_k_bias": ((Di,), "zeros"),
      # f32 like the router: its head weights scale every score (transformers keeps it f32).
      "indexer_weights_proj": ((D, Hi), "normal", "float32"),
  }


def _attn_specs(cfg: ModelConfig, layer: int = 0, *, indexer: bool | None = None) -> dict[str, Spec]:
  """A layer's attention weights; ``indexer`` overrides whether the layer runs the indexer."""
  D, H = cfg.d_model, cfg.n_heads
  if cfg.attention == "gqa":
    return {
        "wq": ((D, H * cfg.head_dim), "normal"),
        "wk": ((D, cfg.n_kv_heads * cfg.head_dim), "normal"),
        "wv": ((D, cfg.n_kv_heads * cfg.head_dim), "normal"),
        "wo": ((H * cfg.head_dim, D), "normal"),
    }
  qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
  specs: dict[str, Spec] = {}
  if cfg.q_lora_rank:
    specs["wq_a"] = ((D, cfg.q_lora_rank), "normal")
    specs["q_norm"] = ((cfg.q_lora_rank,), "ones")
    specs["wq_b"] = ((cfg.q_lora_rank, H * qk), "normal")
  else:
    specs["wq"] = ((D, H * qk), "normal")
  specs["wkv_a"] = ((D, cfg.kv_lora_rank + cfg.qk_rope_head_dim), "normal")
  specs["kv_norm"] = ((cfg.kv_lora_rank,), "ones")
  specs["wkv_b"] = ((cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim)), "normal")
  specs["wo"] = ((H * cfg.v_head_dim, D), "normal")
  if cfg.runs_indexer(layer) if indexer is None else indexer:
    specs.update(_indexer_specs(cfg))
  return specs


def _ffn_specs(cfg: ModelConfig, layer: int) -> dict[str, Any]:
  D = cfg.d_model
  if not cfg.is_moe_layer(layer):
    F = cfg.dense_ffn_dim
    return {"w_gate": ((D, F), "normal"), "w_up": ((D, F), "normal"), "w_down": ((F, D), "normal")}
  E, F = cfg.n_routed_experts, cfg.moe_ffn_dim
  specs: dict[str, Any] = {
      "router": ((D, E), "normal", "float32"),
      "w_gate": ((E, D, F), "normal"),
      "w_up": ((E, D, F), "normal"),
      "w_down": ((E, F, D), "normal"),
  }
  if cfg.router == "sigmoid":
    specs["router_bias"] = ((E,), "zeros", "float32")
  if cfg.n_shared_experts:
    S = cfg.n_shared_experts * F
    specs["shared"] = {"w_gate": ((D, S), "normal"), "w_up": ((D, S), "normal"),
                       "w_down": ((S, D), "normal")}
  return specs


# Parts of a multi-token-prediction layer that some checkpoints ship and others share
# with the main model: its own embedding, its own output head, and (sparse attention)
# its attention's indexer weights.
MTP_OPTIONAL = ("embed", "lm_head", "indexer")


def mtp_specs(cfg: ModelConfig, optional: Iterable[str] = ()) -> list[dict[str, Any]]:
  """The ``cfg.n_mtp_layers`` multi-token-prediction layers' (shape, kind[, dtype]) leaves.

  Each is a MoE decoder layer (the layout of ``param_specs(cfg)["layers"][i]`` for a
  MoE layer) plus DeepSeek-V3's MTP parts: ``eh_proj`` [2D, D] (the projection of
  the concatenated normed embedding and hidden state), ``enorm``, ``hnorm`` and
  ``head_norm`` [D], and the ``optional`` parts present (see :data:`MTP_OPTIONAL`):
  ``embed`` [V, D], ``lm_head`` [D, V], the indexer weights in ``attn``.

  Raises:
    ValueError: an unknown optional part.
  """
  optional = frozenset(optional)
  unknown = sorted(optional - set(MTP_OPTIONAL))
  if unknown:
    raise ValueError(f"mtp_specs: unknown optional parts {unknown} (known: {MTP_OPTIONAL})")
  D, V = cfg.d_model, cfg.vocab_size
  layers = []
  for j in range(cfg.n_mtp_layers):
    layer: dict[str, Any] = {
        "attn_norm": ((D,), "ones"), "ffn_norm": ((D,), "ones"),
        "attn": _attn_specs(cfg, indexer="indexer" in optional),
        "ffn": _ffn_specs(cfg, cfg.n_layers + j),  # past the dense prefix: a MoE layer
        "eh_proj": ((2 * D, D), "normal"),
        "enorm": ((D,), "ones"), "hnorm": ((D,), "ones"), "head_norm": ((D,), "ones")}
    if "embed" in optional:
      layer["embed"] = ((V, D), "embed")
    if "lm_head" in optional:
      layer["lm_head"] = ((D, V), "normal")
    layers.append(layer)
  return layers


def mtp_parts(mtp_layers) -> frozenset[str]:
  """The optional parts (:data:`MTP_OPTIONAL`) that a tree's ``mtp`` layers hold (from the first)."""
  if not mtp_layers or not isinstance(mtp_layers[0], dict):
    return frozenset()  # check_params then names what is wrong with the tree
  first = mtp_layers[0]
  parts = {p for p in ("embed", "lm_head") if p in first}
  if any(str(k).startswith("indexer_") for k in first.get("attn", {})):
    parts.add("indexer")
  return frozenset(parts)


def param_specs(cfg: ModelConfig, *, mtp: Iterable[str] | None = None) -> dict[str, Any]:
  """The nested dict of (shape, init kind[, dtype]) leaves that ``init_params`` fills.

  Args:
    cfg: the model config.
    mtp: None (the default): the serving model only. Otherwise the optional MTP parts
      present, and ``cfg.n_mtp_layers`` layers of :func:`mtp_specs` are added as
      ``"mtp"`` (what a checkpoint that ships them loads into).
  """
  D, V = cfg.d_model, cfg.vocab_size
  specs: dict[str, Any] = {"embed": ((V, D), "embed"), "final_norm": ((D,), "ones")}
  if not cfg.tie_embeddings:
    specs["lm_head"] = ((D, V), "normal")
  specs["layers"] = [
      {"attn_norm": ((D,), "ones"), "ffn_norm": ((D,), "ones"),
       "attn": _attn_specs(cfg, i), "ffn": _ffn_specs(cfg, i)}
      for i in range(cfg.n_layers)
  ]
  if mtp is not None and cfg.n_mtp_layers:
    specs["mtp"] = mtp_specs(cfg, mtp)
  return specs


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) in (2, 3) and isinstance(x[0], tuple)


def init_params(cfg: ModelConfig, key: jax.Array, *, mtp: Iterable[str] | None = None) -> dict:
  """Random params for ``cfg`` (see :func:`_init_params`); compiled once per config.

  Args:
    cfg: the model config.
    key: a PRNG key.
    mtp: None (the default): the serving model only. Otherwise the optional MTP parts
      (:data:`MTP_OPTIONAL`) to create, and ``params["mtp"]`` holds ``cfg.n_mtp_layers``
      layers of :func:`mtp_specs` (``()``: layers that share the main model's
      embedding and head, as training builds them). The main model's params are the
      same with or without them: the MTP layers are drawn from their own key.
  """
  return _init_params_jit(cfg, key, None if mtp is None else frozenset(mtp))


def _draw(specs, cfg: ModelConfig, key: jax.Array):
  """Fills a (shape, kind[, dtype]) spec tree: N(0, 1/fan_in) matrices, unit norms, zeros."""
  leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(key, len(leaves))
  dtype = jnp.dtype(cfg.param_dtype)
  stds, by_size = {}, {}
  for i, (shape, kind, *_) in enumerate(leaves):
    if kind in ("ones", "zeros"):
      continue
    # Tied embeddings double as the output projection, so keep logits O(1).
    stds[i] = ((cfg.d_model ** -0.5 if cfg.tie_embeddings else 1.0) if kind == "embed"
               else shape[-2] ** -0.5)  # else 1/sqrt(fan_in)
    by_size.setdefault(math.prod(shape), []).append(i)
  # Leaves of one size are drawn together, vmapped over their keys: XLA compiles one random
  # program per distinct size instead of one per leaf (init compiles ~2x faster), and each
  # leaf holds exactly jax.random.normal(its key, its shape) * std (the draws are per element).
  drawn = {}
  for n, idx in by_size.items():
    rows = jax.vmap(lambda k, s, n=n: jax.random.normal(k, (n,), jnp.float32) * s)(
        keys[jnp.asarray(idx)], jnp.asarray([stds[i] for i in idx], jnp.float32))  # [len(idx), n]
    drawn.update(zip(idx, rows))
  out = []
  for i, spec in enumerate(leaves):
    shape, kind = spec[0], spec[1]
    dt = jnp.dtype(spec[2]) if len(spec) == 3 else dtype
    if kind in ("ones", "zeros"):
      out.append((jnp.ones if kind == "ones" else jnp.zeros)(shape, dt))
    else:
      out.append(drawn[i].reshape(shape).astype(dt))
  return jax.tree_util.tree_unflatten(treedef, out)


def _init_params(cfg: ModelConfig, key: jax.Array, mtp: frozenset[str] | None = None) -> dict:
  """Random params for ``cfg``: N(0, 1/fan_in) matrices, unit norms, zero router bias.

  Args:
    cfg: the model config.
    key: a PRNG key.
    mtp: None, or the optional MTP parts of the ``mtp`` layers to add (see :func:`init_params`).

  Returns:
    The params pytree described in this module's docstring, in ``cfg.param_dtype``
    (router weights and bias in f32, because routing decisions are precision sensitive).
  """
  params = _draw(param_specs(cfg), cfg, key)
  if mtp is not None and cfg.n_mtp_layers:
    params["mtp"] = _init_mtp_params(cfg, key, mtp)
  return params


def _init_mtp_params(cfg: ModelConfig, key: jax.Array, parts: frozenset[str]) -> list:
  # Their own key, so that asking for them leaves every main-model weight as it was.
  return _draw(mtp_specs(cfg, parts), cfg, jax.random.fold_in(key, 1))


_init_params_jit = jax.jit(_init_params, static_argnums=(0, 2))
_init_mtp_params_jit = jax.jit(_init_mtp_params, static_argnums=(0, 2))


def init_mtp_params(cfg: ModelConfig, key: jax.Array, parts: Iterable[str] = ()) -> list:
  """Only the ``params["mtp"]`` layers that ``init_params(cfg, key, mtp=parts)`` creates.

  For adding MTP layers to an existing main model (training from a model trained
  without them) without compiling the main model's initialiser.
  """
  return _init_mtp_params_jit(cfg, key, frozenset(parts))


def indexer_param_count(cfg: ModelConfig) -> int:
  """Parameters of the sparse-attention indexer (GLM 5.x) per model.

  With ``cfg.indexer_types`` they are instantiated on the "full" layers (and
  counted there); a config that only declares the indexer (``index_n_heads`` > 0,
  no ``indexer_types``) counts one on every layer, as GLM 5 ships it.
  """
  if not cfg.index_n_heads:
    return 0
  q_in = cfg.q_lora_rank or cfg.d_model
  per_layer = (q_in * cfg.index_n_heads * cfg.index_head_dim  # wq_b
               + cfg.d_model * cfg.index_head_dim + 2 * cfg.index_head_dim  # wk, k_norm
               + cfg.d_model * cfg.index_n_heads)  # per-head weights
  layers = cfg.indexer_types.count("full") if cfg.sparse_attention else cfg.n_layers
  return per_layer * layers


def count_params(cfg: ModelConfig, *, include_indexer: bool = True) -> int:
  """Total parameter count from shapes alone (works for 1T-parameter presets).

  Includes the sparse-attention indexer when the config declares one; excludes
  multi-token-prediction heads, which are not part of the serving model.
  """
  specs = param_specs(cfg)
  leaves = jax.tree_util.tree_leaves(specs, is_leaf=_is_spec)
  total = sum(math.prod(spec[0]) for spec in leaves)
  instantiated = sum(math.prod(spec[0]) for lp in specs["layers"] for name, spec in lp["attn"].items()
                     if name.startswith("indexer_"))
  return total - instantiated + (indexer_param_count(cfg) if include_indexer else 0)


def active_params_per_token(cfg: ModelConfig) -> int:
  """Parameters touched per token (top_k routed experts instead of all), embeddings excluded."""
  total = count_params(cfg) - cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  inactive_experts = cfg.n_routed_experts - cfg.top_k
  return total - cfg.n_moe_layers * inactive_experts * 3 * cfg.d_model * cfg.moe_ffn_dim


# ----------------------------------------------------------------------------- checking


def _key(k):
  """A tree key's raw value: dict keys and list indices match whichever container holds them."""
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def _desc(x) -> str:
  """'bfloat16[4, 32, 16]' for anything with a shape and a dtype."""
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  if shape is None or dtype is None:
    return f"a {type(x).__name__}"
  return f"{jnp.dtype(dtype).name}[{', '.join(str(d) for d in shape)}]"


def _sds(shape, dtype) -> str:
  return _desc(jax.ShapeDtypeStruct(tuple(shape), dtype))


def _quantised_mismatch(w, shape: tuple[int, ...]) -> tuple[str, str] | None:
  """(expected, found) if the quantised weight ``w`` cannot stand for a dense ``shape``, else None."""
  *lead, k, n = shape
  if isinstance(w, Int4Weight):
    g = w.group_size
    packed, scales = getattr(w, "packed", None), getattr(w, "scales", None)
    found = f"int4 (group {g}): packed {_desc(packed)}, scales {_desc(scales)}"
    if g not in INT4_GROUP_SIZES or k % 2 or k % g:
      return (f"a dense {list(shape)} weight; int4 needs an even K={k} divisible by the group "
              f"size (one of {INT4_GROUP_SIZES})", found)
    # Layout "kn": uint8 [..., K/2, N]; "nk": int4 [..., N, K] (mlkit.quant.formats).
    nk = getattr(w, "layout", "kn") == "nk"
    want_packed, packed_dtype = ((*lead, n, k), jnp.int4) if nk else ((*lead, k // 2, n), jnp.uint8)
    want_scales = (*lead, k // g, n)
    ok = (getattr(packed, "shape", None) is not None and tuple(packed.shape) == want_packed
          and jnp.dtype(packed.dtype) == jnp.dtype(packed_dtype)
          and getattr(scales, "shape", None) is not None and tuple(scales.shape) == want_scales
          and jnp.dtype(scales.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)))
    expected = (f"int4 (group {g}) for {list(shape)}: packed {_sds(want_packed, packed_dtype)}, "
                f"scales bfloat16|float32{list(want_scales)}")
    return None if ok else (expected, found)
  b = w.block_size
  values, scales = getattr(w, "values", None), getattr(w, "scales", None)
  found = f"fp8 (block {b}): values {_desc(values)}, scales {_desc(scales)}"
  want_scales = (*lead, n) if b is None else (*lead, math.ceil(k / b), math.ceil(n / b))
  ok = (b in (None, FP8_BLOCK)
        and getattr(values, "shape", None) is not None and tuple(values.shape) == tuple(shape)
        and jnp.dtype(values.dtype) == jnp.float8_e4m3fn
        and getattr(scales, "shape", None) is not None and tuple(scales.shape) == want_scales
        and jnp.dtype(scales.dtype) == jnp.float32)
  expected = (f"fp8 (block {b}) for {list(shape)}: values {_sds(shape, jnp.float8_e4m3fn)}, "
              f"scales {_sds(want_scales, jnp.float32)}")
  return None if ok else (expected, found)


def check_params(params, cfg: ModelConfig, *, where: str) -> None:
  """Checks that a params tree has exactly the layout ``param_specs(cfg)`` describes.

  Compares names (no leaf missing, none extra), shapes and dtypes: dense leaves must
  have the spec's shape and dtype (``cfg.param_dtype``, the router and its bias f32).
  A quantised leaf (:class:`~mlkit.quant.Int4Weight` / :class:`~mlkit.quant.Fp8Weight`)
  must stand for the spec's dense shape with internally consistent parts: int4 packed
  uint8 [..., K//2, N] and bf16/f32 scales [..., K//group, N]; fp8 values
  float8_e4m3fn [..., K, N] and f32 scales [..., N] (per channel) or
  [..., ceil(K/128), ceil(N/128)] (blocks). The embedding and the router stay dense.
  Reads only shapes and dtypes (no device transfer), so sharded params, host arrays
  and ``jax.ShapeDtypeStruct`` trees are checked alike. Multi-token-prediction
  layers (``params["mtp"]``) are optional; when present they must be the
  ``cfg.n_mtp_layers`` layers of :func:`mtp_specs`, with the optional parts the
  first of them holds.

  Args:
    params: the params tree (nested dicts and lists of arrays or quantised weights).
    cfg: the model config the params are for.
    where: the caller's name, the first word of the error message.

  Raises:
    ValueError: ``cfg`` is not a ModelConfig or ``params`` is not a dict; otherwise
      naming the FIRST leaf (in ``param_specs`` order, then extra leaves in tree
      order) that does not match: its path, what was expected and what was found.
  """
  if not isinstance(cfg, ModelConfig):
    raise ValueError(f"{where}: cfg must be a ModelConfig, got {type(cfg).__name__}")
  if not isinstance(params, dict):
    raise ValueError(f"{where}: params must be a dict (the tree init_params returns), "
                     f"got {type(params).__name__}")
  head = f"{where}: params do not match config {cfg.name!r}"
  mtp = None
  if "mtp" in params:
    if not isinstance(params["mtp"], (list, tuple)) or len(params["mtp"]) != cfg.n_mtp_layers:
      found = len(params["mtp"]) if isinstance(params["mtp"], (list, tuple)) else _desc(params["mtp"])
      raise ValueError(f"{head}: mtp holds {found} multi-token-prediction layer(s), the config "
                       f"declares n_mtp_layers={cfg.n_mtp_layers}")
    mtp = mtp_parts(params["mtp"])
  specs = jax.tree_util.tree_flatten_with_path(param_specs(cfg, mtp=mtp), is_leaf=_is_spec)[0]
  leaves = jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: not isinstance(x, (dict, list, tuple)))[0]
  have = {tuple(_key(k) for k in p): (path_str(p), x) for p, x in leaves}
  want = {tuple(_key(k) for k in p): (path_str(p), s) for p, s in specs}
  missing = [name for key, (name, _) in want.items() if key not in have]
  extra = [name for key, (name, _) in have.items() if key not in want]

  def structure() -> str:
    parts = [f"{len(missing)} missing" if missing else "", f"{len(extra)} extra" if extra else ""]
    eg = f" (e.g. {extra[0]})" if extra else ""
    return f" [{', '.join(p for p in parts if p)} leaves in all{eg}]"

  for key, (name, spec) in want.items():
    shape = spec[0]
    dtype = jnp.dtype(spec[2] if len(spec) == 3 else cfg.param_dtype)
    expected = _sds(shape, dtype)
    if key not in have:
      raise ValueError(f"{head}: {name} is missing (expected {expected}){structure()}")
    x = have[key][1]
    if isinstance(x, (Int4Weight, Fp8Weight)):
      if len(shape) not in (2, 3) or len(spec) == 3 or name.rsplit("/", 1)[-1] == "embed":
        raise ValueError(f"{head}: {name} is a quantised {type(x).__name__} but must stay dense "
                         f"(expected {expected}; the embedding is gathered by row, routers and norms "
                         "are precision sensitive)")
      bad = _quantised_mismatch(x, tuple(shape))
      if bad is not None:
        raise ValueError(f"{head}: {name}: expected {bad[0]}, found {bad[1]}")
      continue
    if getattr(x, "shape", None) is None or getattr(x, "dtype", None) is None:
      raise ValueError(f"{head}: {name} is {_desc(x)}, not an array or a quantised weight "
                       f"(expected {expected})")
    if tuple(x.shape) != tuple(shape) or jnp.dtype(x.dtype) != dtype:
      raise ValueError(f"{head}: {name}: expected {expected}, found {_desc(x)}")
  if extra:
    raise ValueError(f"{head}: {extra[0]} is not a parameter of this config{structure()}")
