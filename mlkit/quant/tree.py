"""Parameter paths: the ``"layers/3/ffn/w_gate"`` strings recipes and calibration key on."""

from __future__ import annotations

from typing import Any

import jax

from mlkit.quant.formats import Fp8Weight, Int4Weight

QUANTISED_TYPES = (Int4Weight, Fp8Weight)


def is_quantised(x: Any) -> bool:
  """True for a quantised weight format (a pytree that is one parameter)."""
  return isinstance(x, QUANTISED_TYPES)


def path_str(keypath) -> str:
  """A ``jax.tree_util`` key path as ``"a/0/b"`` (dict keys, list indices, attribute names)."""
  parts = []
  for k in keypath:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def flatten_params(tree) -> tuple[list[tuple[str, Any]], Any]:
  """Flattens a params tree into ([(path, leaf)], treedef), quantised formats as single leaves."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantised)
  return [(path_str(p), leaf) for p, leaf in leaves], treedef


# Groups :func:`describe_formats` reports, by the first matching rule on a weight's path.
_GROUPS = (("shared experts", "/ffn/shared/"), ("routers", "/ffn/router"),
           ("attention", "/attn/"), ("embeddings", "embed"), ("lm_head", "lm_head"))


def _group(path: str, leaf) -> str:
  if path.startswith("mtp/"):  # loaded for speculative decoding; the model does not run them
    return "mtp layers"
  if "norm" in path.rsplit("/", 1)[-1]:
    return "norms"
  for name, key in _GROUPS:
    if key in path:
      return name
  if "/ffn/" in path:  # a routed expert's weight is [E, K, N]; a dense FFN's is [K, N]
    return "routed experts" if len(getattr(leaf, "shape", ())) == 3 else "dense FFN"
  return "other"


def leaf_format(leaf) -> str:
  """A weight's storage format in words: "int4 g32 (layout kn)", "fp8 e4m3 block 128", "bfloat16"."""
  if isinstance(leaf, Int4Weight):
    return f"int4 g{leaf.group_size} (layout {leaf.layout})"
  if isinstance(leaf, Fp8Weight):
    return ("fp8 e4m3 per-channel" if leaf.block_size is None
            else f"fp8 e4m3 block {leaf.block_size}")
  return str(getattr(leaf, "dtype", type(leaf).__name__))


def describe_formats(params) -> dict[str, str]:
  """The storage formats actually held, per weight group: what a server logs at start-up.

  Returns:
    {group: formats} with groups attention, routed experts, shared experts, dense FFN,
    routers, embeddings, lm_head, norms, mtp layers (those present), each the sorted distinct formats
    of its weights joined by " + ".
  """
  formats: dict[str, set] = {}
  leaves, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantised)
  for keypath, leaf in leaves:
    path = path_str(keypath)
    formats.setdefault(_group(path, leaf), set()).add(leaf_format(leaf))
  return {g: " + ".join(sorted(f)) for g, f in formats.items()}
