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
