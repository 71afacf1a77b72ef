"""Recipes: which parameters get which weight format, and applying them.

A :class:`Recipe` is an ordered tuple of :class:`Rule`s. Each rule pairs a path
pattern (and optionally a rank) with a format spec: :class:`Keep`,
:class:`Int4Spec` or :class:`Fp8Spec`. Every parameter must be matched by exactly
one rule, and every non-optional rule must match at least one parameter; both
violations are ``ValueError``s naming the parameter or pattern, so a recipe
cannot silently leave a weight in the wrong precision.

Patterns are globs over ``/``-separated paths such as ``layers/3/ffn/w_gate``:
``*`` matches within one path segment, ``**`` matches any number of whole
segments (including none), ``?`` one character, ``{a,b}`` either alternative.
A pattern starting with ``re:`` is a Python regex matched against the full path.

Never quantised, whatever the recipe says: 1-D params (norms, router bias), the
router (routing decisions are precision sensitive) and ``embed`` (the model
gathers rows from it with ``jnp.take``; tied configs also use it as the head).

A weight that is already quantised (a published checkpoint's INT4 or FP8) is kept
as it is unless the recipe asks for a lower precision it can be converted to:
:func:`published_conversion` says which, :func:`apply_recipe` applies a recipe
to such a tree (what a server does), and the Hugging Face loader does the same
tensor by tensor (docs/checkpoints.md).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from typing import Mapping, Union

import jax
import jax.numpy as jnp

from mlkit.quant.dispatch import dequantize
from mlkit.quant.formats import (FP8_BLOCK, INT4_GROUP_SIZES, INT4_LAYOUTS, Fp8Weight, Int4Weight,
                                 quantize_fp8, quantize_int4)
from mlkit.quant.gptq import CalibrationStats, gptq_quantize_int4
from mlkit.quant.tree import flatten_params, is_quantised, leaf_format

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- specs

@dataclasses.dataclass(frozen=True)
class Keep:
  """Leave the parameter dense."""

  # Optional storage dtype name to cast to (e.g. "bfloat16"); None keeps the dtype.
  dtype: str | None = None

  def __post_init__(self):
    if self.dtype not in (None, "bfloat16", "float32"):
      raise ValueError(f"Keep.dtype must be None, 'bfloat16' or 'float32', got {self.dtype!r}")


@dataclasses.dataclass(frozen=True)
class Int4Spec:
  """Symmetric group-wise int4 (:class:`~mlkit.quant.formats.Int4Weight`)."""

  # Input rows per scale: 32, 64 or 128.
  group_size: int = 128
  # Scale storage dtype name: "bfloat16" or "float32".
  scale_dtype: str = "bfloat16"
  # "rtn" (round to nearest) or "gptq" (needs calibration, see quantize_params).
  method: str = "rtn"
  # GPTQ Hessian damping as a fraction of its mean diagonal.
  damp: float = 0.01

  def __post_init__(self):
    if self.group_size not in INT4_GROUP_SIZES:
      raise ValueError(f"Int4Spec.group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size!r}")
    if self.scale_dtype not in ("bfloat16", "float32"):
      raise ValueError(f"Int4Spec.scale_dtype must be 'bfloat16' or 'float32', got {self.scale_dtype!r}")
    if self.method not in ("rtn", "gptq"):
      raise ValueError(f"Int4Spec.method must be 'rtn' or 'gptq', got {self.method!r}")
    if not self.damp > 0:
      raise ValueError(f"Int4Spec.damp must be > 0, got {self.damp!r}")


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
  """float8_e4m3fn with f32 scales (:class:`~mlkit.quant.formats.Fp8Weight`)."""

  # 128 for 128x128 block scales (DeepSeek-V3/GLM checkpoints), None for per-output-channel.
  block_size: int | None = FP8_BLOCK

  def __post_init__(self):
    if self.block_size not in (None, FP8_BLOCK):
      raise ValueError(f"Fp8Spec.block_size must be None or {FP8_BLOCK}, got {self.block_size!r}")


FormatSpec = Union[Keep, Int4Spec, Fp8Spec]
KEEP = Keep()


@dataclasses.dataclass(frozen=True)
class Rule:
  """One recipe line: parameters whose path matches ``pattern`` (and rank ``ndim``) get ``spec``."""

  # Glob (or "re:" regex) over the parameter path, e.g. "layers/*/ffn/w_gate".
  pattern: str
  # The format for matching parameters.
  spec: FormatSpec
  # Only match parameters of this rank (or any rank in a tuple); None matches any.
  ndim: int | tuple[int, ...] | None = None
  # Allow the rule to match nothing (e.g. lm_head on tied-embedding configs).
  optional: bool = False

  def __post_init__(self):
    if not isinstance(self.pattern, str) or not self.pattern:
      raise ValueError(f"Rule.pattern must be a non-empty string, got {self.pattern!r}")
    if not isinstance(self.spec, (Keep, Int4Spec, Fp8Spec)):
      raise ValueError(f"Rule.spec must be Keep, Int4Spec or Fp8Spec, got {self.spec!r}")
    try:
      _compile(self.pattern)
    except re.error as e:
      raise ValueError(f"Rule.pattern {self.pattern!r} is not a valid pattern: {e}") from None

  def matches(self, path: str, ndim: int) -> bool:
    if self.ndim is not None:
      allowed = (self.ndim,) if isinstance(self.ndim, int) else tuple(self.ndim)
      if ndim not in allowed:
        return False
    return _compile(self.pattern).fullmatch(path) is not None


@dataclasses.dataclass(frozen=True)
class Recipe:
  """A named, ordered tuple of rules; see the module docstring for the matching contract."""

  # Name used in tables and error messages.
  name: str
  # The rules; each parameter must match exactly one.
  rules: tuple[Rule, ...]

  def __post_init__(self):
    if not self.rules:
      raise ValueError(f"Recipe {self.name!r}: rules must not be empty")
    object.__setattr__(self, "rules", tuple(self.rules))


# ----------------------------------------------------------------------------- matching

def _glob_segment(seg: str) -> str:
  out, i = [], 0
  while i < len(seg):
    c = seg[i]
    if c == "*":
      out.append("[^/]*")
    elif c == "?":
      out.append("[^/]")
    elif c == "{":
      j = seg.index("}", i)  # ValueError -> reported as a bad pattern below
      alts = seg[i + 1:j].split(",")
      out.append("(?:" + "|".join(_glob_segment(a) for a in alts) + ")")
      i = j
    else:
      out.append(re.escape(c))
    i += 1
  return "".join(out)


_CACHE: dict[str, re.Pattern] = {}


def _compile(pattern: str) -> re.Pattern:
  if pattern not in _CACHE:
    if pattern.startswith("re:"):
      rx = pattern[3:]
    else:
      segs = pattern.split("/")
      rx = ""
      for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg == "**":
          rx += ".*" if last else "(?:[^/]+/)*"
        else:
          try:
            rx += _glob_segment(seg) + ("" if last else "/")
          except ValueError:
            raise re.error(f"unclosed '{{' in {seg!r}") from None
    _CACHE[pattern] = re.compile(rx)
  return _CACHE[pattern]


def _leaf_ndim(leaf) -> int:
  if isinstance(leaf, tuple) and leaf and isinstance(leaf[0], tuple):  # param_specs leaf
    return len(leaf[0])
  return len(leaf.shape)


def assign_formats(params, recipe: Recipe) -> dict[str, FormatSpec]:
  """Matches every parameter to its one rule.

  Args:
    params: a params tree (arrays, ``jax.ShapeDtypeStruct``s or quantised formats).
    recipe: the recipe.

  Returns:
    {path: spec} for every parameter, in tree order.

  Raises:
    ValueError: naming the parameter if it matches no rule or two rules, naming the
      pattern if a non-optional rule matches no parameter, and naming the parameter
      if the recipe would quantise a 1-D param, a router or ``embed``.
  """
  flat, _ = flatten_params(params)
  used = [False] * len(recipe.rules)
  out: dict[str, FormatSpec] = {}
  for path, leaf in flat:
    ndim = _leaf_ndim(leaf)
    hits = [i for i, r in enumerate(recipe.rules) if r.matches(path, ndim)]
    if not hits:
      raise ValueError(f"Recipe {recipe.name!r}: parameter {path!r} is matched by no rule")
    if len(hits) > 1:
      pats = " and ".join(repr(recipe.rules[i].pattern) for i in hits)
      raise ValueError(f"Recipe {recipe.name!r}: parameter {path!r} is matched by two rules: {pats}")
    used[hits[0]] = True
    spec = recipe.rules[hits[0]].spec
    if not isinstance(spec, Keep):
      last = path.rsplit("/", 1)[-1]
      if ndim not in (2, 3):
        raise ValueError(f"Recipe {recipe.name!r}: parameter {path!r} is {ndim}-D; "
                         "only 2-D/3-D projection weights can be quantised")
      if last.startswith("router") or last == "embed":
        raise ValueError(f"Recipe {recipe.name!r}: parameter {path!r} must stay dense "
                         "(routers are precision sensitive; the embedding is gathered by row)")
    out[path] = spec
  for rule, u in zip(recipe.rules, used):
    if not u and not rule.optional:
      raise ValueError(f"Recipe {recipe.name!r}: pattern {rule.pattern!r} matches no parameter")
  return out


# ----------------------------------------------------------------------------- applying

def quantize_leaf(w, spec: FormatSpec, *, name: str = "weight",
                  calibration: CalibrationStats | None = None, int4_layout: str | None = None):
  """Applies one format spec to one dense weight (see :func:`quantize_params`)."""
  if isinstance(spec, Keep):
    if isinstance(w, Int4Weight) and int4_layout is not None:
      return w.to_layout(int4_layout)  # a copy only when the layouts differ
    # A quantised weight kept by a later recipe stays as it is (no dense cast).
    return w if spec.dtype is None or is_quantised(w) else w.astype(spec.dtype)
  if is_quantised(w):
    raise ValueError(f"{name}: parameter is already quantised ({type(w).__name__})")
  if isinstance(spec, Fp8Spec):
    return quantize_fp8(w, spec.block_size, name=name)
  scale_dtype = jnp.dtype(spec.scale_dtype)
  if spec.method == "gptq" and calibration is not None:
    q = gptq_quantize_int4(w, calibration, spec.group_size, scale_dtype=scale_dtype,
                           damp=spec.damp, name=name)
  else:
    q = quantize_int4(w, spec.group_size, scale_dtype=scale_dtype, name=name)
  return q.to_layout(int4_layout or "kn")


def published_conversion(w, spec: FormatSpec | None, *, name: str = "weight") -> str | None:
  """What a recipe does to a weight that is already quantised (as a checkpoint published it).

  The published format is kept unless the recipe asks for a lower precision:

  - ``spec`` None or :class:`Keep`, or the format ``w`` already has (int4 of the
    same group size, fp8 of the same block size): kept as it is (None);
  - fp8 -> int4: converted, dequantising ``w`` in f32 and quantising that (how the
    report made GLM's INT4 experts from its FP8 release); the description of it
    is returned, e.g. "fp8 e4m3 block 128 -> int4 g32";
  - anything else is refused: int4 -> fp8 would invent precision the checkpoint
    does not have, and re-rounding onto another int4 group size or fp8 scaling
    would round twice.

  Args:
    w: an :class:`Int4Weight` or :class:`Fp8Weight` (arrays or ShapeDtypeStructs).
    spec: the recipe's format for it.
    name: the parameter's name, for messages.

  Raises:
    ValueError: naming ``name``, both formats and why, for a refused conversion.
  """
  if spec is None or isinstance(spec, Keep):
    return None
  have = leaf_format(w)
  if isinstance(w, Int4Weight):
    if isinstance(spec, Int4Spec) and spec.group_size == w.group_size:
      return None
    if isinstance(spec, Fp8Spec):
      raise ValueError(f"{name}: the recipe asks for fp8, but the checkpoint holds it as {have}: "
                       "converting INT4 to FP8 would invent precision the checkpoint does not "
                       "have (keep it: a recipe that keeps the experts, or none)")
    raise ValueError(f"{name}: the recipe asks for int4 g{spec.group_size}, but the checkpoint holds "
                     f"it as {have}: re-rounding onto another group size is not done (keep it)")
  if isinstance(w, Fp8Weight):
    if isinstance(spec, Fp8Spec) and spec.block_size == w.block_size:
      return None
    if isinstance(spec, Int4Spec):
      return f"{have} -> int4 g{spec.group_size}"
    raise ValueError(f"{name}: the recipe asks for fp8 with {spec.block_size or 'per-channel'} "
                     f"scales, but the checkpoint holds it as {have}: requantising fp8 is not "
                     "done (keep it)")
  raise ValueError(f"{name}: {type(w).__name__} is not a quantised format")


def apply_recipe(params, recipe: Recipe, *, int4_layout: str | None = None):
  """Applies a round-to-nearest recipe to a tree that may hold published quantised weights.

  Dense leaves are quantised as :func:`quantize_params` does. Quantised leaves (a
  checkpoint loaded in its published formats) are kept or converted as
  :func:`published_conversion` says; each conversion is logged. What a server
  does with its ``--recipe`` after loading a checkpoint.

  Args:
    params: the params tree.
    recipe: which format each parameter gets (no GPTQ: it needs calibration).
    int4_layout: as for :func:`quantize_params`.

  Returns:
    The new tree.

  Raises:
    ValueError: recipe mismatches (:func:`assign_formats`), a GPTQ rule, a conversion
      :func:`published_conversion` refuses, or the errors of :func:`quantize_params`.
  """
  specs = assign_formats(params, recipe)
  gptq = [p for p, s in specs.items() if isinstance(s, Int4Spec) and s.method == "gptq"]
  if gptq:
    raise ValueError(f"Recipe {recipe.name!r} uses GPTQ for {gptq[0]!r}, which needs calibration "
                     "activations; use quantize_params with collect_calibration")
  if int4_layout is not None and int4_layout not in INT4_LAYOUTS:
    raise ValueError(f"apply_recipe: int4_layout must be one of {INT4_LAYOUTS} or None, "
                     f"got {int4_layout!r}")
  flat, treedef = flatten_params(params)
  how = {p: published_conversion(leaf, specs[p], name=p) for p, leaf in flat if is_quantised(leaf)}
  out = []
  for p, leaf in flat:
    if is_quantised(leaf) and how[p] is None:
      out.append(quantize_leaf(leaf, KEEP, name=p, int4_layout=int4_layout))
    elif is_quantised(leaf):
      # Dequantised in f32 (exact for fp8 * scale), so the int4 rounding sees the published values.
      out.append(quantize_leaf(dequantize(leaf, jnp.float32), specs[p], name=p,
                               int4_layout=int4_layout))
    else:
      out.append(quantize_leaf(leaf, specs[p], name=p, int4_layout=int4_layout))
  converted = {p: h for p, h in how.items() if h is not None}
  if converted:
    p, h = next(iter(converted.items()))
    log.info("recipe %r converted %d published weight(s), dequantising each and quantising it "
             "(e.g. %s: %s)", recipe.name, len(converted), p, h)
  return jax.tree_util.tree_unflatten(treedef, out)


def quantize_params(params, recipe: Recipe,
                    calibration: Mapping[str, CalibrationStats | jax.Array] | None = None,
                    *, int4_layout: str | None = None):
  """Returns a new params tree with each weight in the format its rule names.

  The model runs on the result unchanged: quantised weights are pytrees that
  :func:`mlkit.quant.matmul` and friends dispatch on.

  Args:
    params: the dense params tree (as from ``mlkit.model.init_params``).
    recipe: which format each parameter gets.
    calibration: for ``Int4Spec(method="gptq")`` rules: {path: CalibrationStats or
      activations [..., K]}, e.g. from :func:`mlkit.quant.gptq.collect_calibration`.
      GPTQ parameters missing from it (MLA's ``wkv_b``, which the model only
      dequantises) fall back to round-to-nearest with a warning.
    int4_layout: the int4 weights' layout: "kn" (packed, what checkpoints
      hold) or "nk" (what the GPU kernels dequantise in registers;
      ``mlkit.quant.kernel_int4_layout()`` names the one for this platform). Each
      weight is relaid as it is quantised, so only one leaf is ever held twice.
      Int4 weights that were already quantised are relaid too (a copy of each
      such leaf beside the caller's; ``load_checkpoint(int4_layout=)`` restores a
      quantised checkpoint into the layout without one). None: new int4 weights
      in "kn", existing ones as they are.

  Returns:
    The new tree (same structure; quantised leaves are Int4Weight / Fp8Weight).

  Raises:
    ValueError: for recipe mismatches (see :func:`assign_formats`), for a GPTQ
      rule without any ``calibration``, and, naming the parameter, for a group size
      that does not divide K, an odd K, or non-finite weights.
  """
  specs = assign_formats(params, recipe)
  gptq = [p for p, s in specs.items() if isinstance(s, Int4Spec) and s.method == "gptq"]
  if gptq and calibration is None:
    raise ValueError(f"Recipe {recipe.name!r} uses GPTQ for {gptq[0]!r} (and {len(gptq) - 1} more) "
                     "but no calibration was given; see collect_calibration")
  calibration = calibration or {}
  uncalibrated = [p for p in gptq if p not in calibration]
  if uncalibrated:
    warnings.warn(f"Recipe {recipe.name!r}: no calibration for {uncalibrated}; "
                  "using round-to-nearest for them")
  if int4_layout is not None and int4_layout not in INT4_LAYOUTS:
    raise ValueError(f"quantize_params: int4_layout must be one of {INT4_LAYOUTS} or None, "
                     f"got {int4_layout!r}")
  flat, treedef = flatten_params(params)
  out = [quantize_leaf(leaf, specs[p], name=p, calibration=calibration.get(p),
                       int4_layout=int4_layout) for p, leaf in flat]
  return jax.tree_util.tree_unflatten(treedef, out)


def dequantize_params(params, dtype=None):
  """The dense tree a (partly) quantised tree stands for.

  Args:
    params: a params tree.
    dtype: dtype for dequantised weights (default f32); dense leaves are unchanged.

  Returns:
    The same structure with every quantised weight replaced by its dense array.
  """
  dtype = dtype or jnp.float32
  return jax.tree_util.tree_map(lambda w: dequantize(w, dtype) if is_quantised(w) else w,
                                params, is_leaf=is_quantised)


def calibration_paths(params, recipe: Recipe) -> list[str]:
  """The parameters a recipe quantises with GPTQ (what to pass to ``collect_calibration``)."""
  return [p for p, s in assign_formats(params, recipe).items()
          if isinstance(s, Int4Spec) and s.method == "gptq"]


# ----------------------------------------------------------------------------- presets

# Rules shared by every preset: never-quantised params, plus tensors only some
# configs have (optional). lm_head stays bf16 as in both the Kimi K2 int4 and the
# DeepSeek-V3/GLM fp8 checkpoints. MTP layers' own parts (eh_proj, and their embedding
# and head where shipped) and GLM's sparse-attention indexer ship in bf16 (the
# indexer's head weights in f32). The presets' layer rules cover the loaded MTP
# layers (``mtp/<j>/...``) as well, so they take the formats of the layers they
# copy; accounting trees append MTP layers to ``layers`` instead.
_DENSE_ALWAYS = (
    Rule("{embed,lm_head}", KEEP),
    Rule("**/*norm", KEEP),
    Rule("{layers,mtp}/*/ffn/router*", KEEP, optional=True),
    Rule("{layers,mtp}/*/eh_proj", KEEP, optional=True),
    Rule("mtp/*/{embed,lm_head}", KEEP, optional=True),
    Rule("{layers,mtp}/*/attn/indexer_w*", KEEP, optional=True),
    Rule("{layers,mtp}/*/attn/indexer_k_bias", KEEP, optional=True),
)


def bf16() -> Recipe:
  """Nothing quantised: every parameter kept as it is."""
  return Recipe("bf16", (Rule("**", KEEP),))


def int4_experts(group_size: int = 32, *, method: str = "rtn", rest: FormatSpec = KEEP,
                 scale_dtype: str = "bfloat16") -> Recipe:
  """Routed experts int4; attention, shared experts and dense FFNs in ``rest``.

  With the defaults this is how Kimi K2.6 ships (W4A16, group 32, bf16 scales,
  everything else bf16).

  Args:
    group_size: int4 group size (32, 64 or 128).
    method: "rtn" or "gptq".
    rest: format for attention, shared-expert and dense-FFN weights (KEEP or Fp8Spec()).
    scale_dtype: int4 scale dtype name.

  Returns:
    The recipe.
  """
  int4 = Int4Spec(group_size=group_size, method=method, scale_dtype=scale_dtype)
  name = f"int4-experts-g{group_size}{'-gptq' if method == 'gptq' else ''}"
  if isinstance(rest, Fp8Spec):
    name += "-fp8-rest"
  return Recipe(name, _DENSE_ALWAYS + (
      Rule("{layers,mtp}/*/attn/w*", rest),
      Rule("layers/*/ffn/w_*", rest, ndim=2, optional=True),  # dense FFN layers
      Rule("{layers,mtp}/*/ffn/shared/w_*", rest, optional=True),
      Rule("{layers,mtp}/*/ffn/w_*", int4, ndim=3),  # routed experts [E, K, N]
  ))


def fp8_all(block_size: int | None = FP8_BLOCK) -> Recipe:
  """Every attention/FFN/expert projection in fp8 (how GLM and DeepSeek-V3 ship)."""
  fp8 = Fp8Spec(block_size)
  return Recipe("fp8-all" + ("" if block_size else "-per-channel"), _DENSE_ALWAYS + (
      Rule("{layers,mtp}/*/attn/w*", fp8),
      Rule("{layers,mtp}/*/ffn/**/w_*", fp8),  # dense FFN, routed and shared experts
  ))


def int4_all(group_size: int = 128, *, method: str = "rtn") -> Recipe:
  """Every attention/FFN/expert projection in int4 (an aggressive ablation)."""
  int4 = Int4Spec(group_size=group_size, method=method)
  return Recipe(f"int4-all-g{group_size}", _DENSE_ALWAYS + (
      Rule("{layers,mtp}/*/attn/w*", int4),
      Rule("{layers,mtp}/*/ffn/**/w_*", int4),
  ))


BF16 = bf16()
INT4_EXPERTS = int4_experts()
INT4_EXPERTS_GPTQ = int4_experts(method="gptq")
FP8_ALL = fp8_all()
INT4_EXPERTS_FP8_REST = int4_experts(rest=Fp8Spec())

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    BF16, INT4_EXPERTS, INT4_EXPERTS_GPTQ, FP8_ALL, INT4_EXPERTS_FP8_REST)}
