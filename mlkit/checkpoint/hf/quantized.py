"""The quantised formats published checkpoints ship: reading ``quantization_config`` and the tensors.

Two formats are read into our weight types without a dense intermediate, and
written back by :func:`~mlkit.checkpoint.hf.save.save_hf_checkpoint`:

- **compressed-tensors ``pack-quantized`` INT4** (``quant_method:
  "compressed-tensors"``; what Kimi K2's INT4 checkpoints use): per quantised
  ``nn.Linear`` module ``M``, ``M.weight_packed`` int32 [out, in/8] (eight 4-bit
  values per word, value ``i`` in bits ``4i..4i+3``, stored plus 8),
  ``M.weight_scale`` [out, in/group] and ``M.weight_shape`` int32 [2] = [out, in].
  Symmetric, group-wise, no zero point. It becomes an
  :class:`~mlkit.quant.Int4Weight` with the same integers and scales: read as
  bytes (little-endian, so byte ``j`` of a row holds input columns ``2j`` (low
  nibble) and ``2j+1`` (high nibble)), XOR 0x88 turns each offset-8 nibble into
  the two's-complement nibble Int4Weight stores, and the transpose gives layout
  "kn" ([K/2, N]: byte row ``i`` holds input rows ``2i`` low and ``2i+1`` high).
  The scales are transposed, their bits kept.
- **FP8 with 128x128 block scales** (``quant_method: "fp8"``, ``weight_block_size:
  [128, 128]``; DeepSeek-V3 and GLM): ``M.weight`` float8_e4m3fn [out, in] and
  ``M.weight_scale_inv`` f32 [ceil(out/128), ceil(in/128)], ``w = fp8 *
  scale_inv``. It becomes an :class:`~mlkit.quant.Fp8Weight` (``w = values *
  scales``) with both transposed, bits kept.

Which modules a compressed-tensors checkpoint quantises is what its
``config_groups`` target (``"Linear"``, a module name, or a ``re:`` regex matched
from the start of the name) less what ``ignore`` lists (same matching); the
loader checks that the tensors agree with it, module by module. Everything else
(asymmetric schemes, other bit widths or strategies, activation or KV-cache
quantisation, other formats) is refused, naming the scheme and the file.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from mlkit.checkpoint.errors import CheckpointError
from mlkit.checkpoint.hf.names import is_linear
from mlkit.checkpoint.hf.safetensors import LOAD_OP

COMPRESSED_TENSORS = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
FP8 = "fp8"
# The suffixes of one pack-quantized module's tensors, and those that mean a scheme we refuse.
INT4_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
REFUSED_SUFFIXES = {"weight_zero_point": "a zero point (an asymmetric scheme)",
                    "weight_g_idx": "a group index (activation-ordered groups)",
                    "input_scale": "a static activation scale", "weight_global_scale": "a global scale"}
# The group sizes an Int4Weight holds (mlkit.quant.formats.INT4_GROUP_SIZES).
_GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class Int4Group:
  """One compressed-tensors ``config_groups`` entry: which modules, and their group size."""

  # The group's key in config_groups, for messages.
  name: str
  # Module targets: "Linear", exact module names, or "re:" regexes.
  targets: tuple[str, ...]
  # Input columns per scale.
  group_size: int


@dataclasses.dataclass(frozen=True)
class PublishedQuant:
  """What config.json's ``quantization_config`` says about the stored weights."""

  # "none", "fp8" or "compressed-tensors".
  method: str = "none"
  # fp8 block-scale shape (out, in); also the default for fp8 tensors without a config.
  fp8_block: tuple[int, int] = (128, 128)
  # compressed-tensors: the INT4 groups and the modules left dense.
  groups: tuple[Int4Group, ...] = ()
  ignore: tuple[str, ...] = ()

  def int4_group_size(self, module: str) -> int | None:
    """The group size a compressed-tensors config quantises ``module`` with, or None (dense)."""
    if self.method != COMPRESSED_TENSORS or not is_linear(module):
      return None
    if any(_matches(t, module) for t in self.ignore):
      return None
    hits = [g for g in self.groups if any(_matches(t, module) for t in g.targets)]
    return hits[0].group_size if hits else None

  def unmatched_ignore(self, modules) -> list[str]:
    """The ``ignore`` entries that match none of ``modules``."""
    return [t for t in self.ignore if not any(_matches(t, m) for m in modules)]


def _matches(target: str, module: str) -> bool:
  """compressed-tensors' matching: a "re:" regex from the start of the name, the class name
  "Linear", or the exact module name."""
  if target.startswith("re:"):
    return re.match(target[3:], module) is not None
  if target == "Linear":
    return is_linear(module)
  return target == module


def parse_quantization_config(hf_config: dict, cfg_file: str) -> PublishedQuant:
  """The published quantisation that ``config.json`` declares (see the module docstring).

  Args:
    hf_config: the parsed config.json.
    cfg_file: its path, for messages.

  Raises:
    CheckpointError: naming ``cfg_file`` and the scheme, for a quantisation this
      loader does not read as it is.
  """
  q = hf_config.get("quantization_config")
  if q is None:
    return PublishedQuant()
  if not isinstance(q, dict):
    raise CheckpointError(LOAD_OP, cfg_file, "quantization_config must be an object whose "
                                           f"weight_block_size is two positive ints, got {q!r}")
  method = q.get("quant_method")
  if method == COMPRESSED_TENSORS:
    return _compressed_tensors(q, cfg_file)
  block = q.get("weight_block_size", (128, 128))
  if (not isinstance(block, (list, tuple)) or len(block) != 2
      or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
    raise CheckpointError(LOAD_OP, cfg_file, "quantization_config must be an object whose "
                                           f"weight_block_size is two positive ints, got {q!r}")
  if method not in (None, FP8):
    raise CheckpointError(LOAD_OP, cfg_file, f"quantization_config quant_method {method!r} is not "
                                           f"supported (read: {FP8!r} with block scales, "
                                           f"{COMPRESSED_TENSORS!r} {PACK_QUANTIZED!r} INT4)")
  if method == FP8:
    act = q.get("activation_scheme", "dynamic")
    if act not in (None, "dynamic"):
      # Static activation scales ship as input_scale tensors that a W8A16 model has no use for.
      raise CheckpointError(LOAD_OP, cfg_file, f"fp8 activation_scheme {act!r} is not supported (only "
                                             "'dynamic': weights fp8, activations as computed)")
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
      raise CheckpointError(LOAD_OP, cfg_file, f"fp8 fmt {fmt!r} is not supported (only 'e4m3')")
  return PublishedQuant(method=FP8 if method == FP8 else "none", fp8_block=tuple(block))


def _compressed_tensors(q: dict, cfg_file: str) -> PublishedQuant:
  def refuse(what: str):
    raise CheckpointError(LOAD_OP, cfg_file, f"compressed-tensors {what}; read: {PACK_QUANTIZED!r} INT4, "
                                           "symmetric, group-wise (group 32, 64 or 128), weights only")
  fmt = q.get("format")
  groups_cfg = q.get("config_groups")
  if not isinstance(groups_cfg, dict) or not groups_cfg:
    refuse(f"quantization_config has no config_groups (got {groups_cfg!r})")
  for key in ("kv_cache_scheme", "transform_config"):
    if q.get(key):
      refuse(f"{key} {q[key]!r} is not supported")
  sparsity = q.get("sparsity_config")
  if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense"):
    refuse(f"sparsity_config {sparsity!r} is not supported")
  groups = []
  for name, g in groups_cfg.items():
    if not isinstance(g, dict):
      refuse(f"config_groups[{name!r}] must be an object, got {g!r}")
    gfmt = g.get("format") or fmt
    if gfmt != PACK_QUANTIZED:
      refuse(f"format {gfmt!r} (config_groups[{name!r}]) is not supported")
    for act in ("input_activations", "output_activations"):
      if g.get(act) is not None:
        refuse(f"config_groups[{name!r}] quantises {act} ({g[act]!r}): activation quantisation is "
               "not supported")
    w = g.get("weights")
    if not isinstance(w, dict):
      refuse(f"config_groups[{name!r}] has no weights scheme (got {w!r})")
    scheme = (f"config_groups[{name!r}].weights (num_bits={w.get('num_bits')!r}, type="
              f"{w.get('type')!r}, symmetric={w.get('symmetric')!r}, strategy={w.get('strategy')!r}, "
              f"group_size={w.get('group_size')!r})")
    if w.get("num_bits") != 4 or w.get("type", "int") != "int":
      refuse(f"{scheme}: only 4-bit integers are supported")
    if w.get("symmetric") is not True:
      refuse(f"{scheme}: asymmetric (zero-point) schemes are not supported")
    if w.get("strategy") != "group":
      refuse(f"{scheme}: only strategy 'group' is supported")
    if w.get("group_size") not in _GROUP_SIZES:
      refuse(f"{scheme}: group_size must be one of {_GROUP_SIZES}")
    if w.get("dynamic"):
      refuse(f"{scheme}: dynamic weight quantisation is not supported")
    if w.get("actorder") not in (None, "weight", "static"):
      # Activation-ordered groups store a g_idx permutation; the kernels read groups in order.
      refuse(f"{scheme}: actorder {w.get('actorder')!r} is not supported")
    targets = g.get("targets")
    if (not isinstance(targets, (list, tuple)) or not targets
        or not all(isinstance(t, str) for t in targets)):
      refuse(f"config_groups[{name!r}].targets must be a list of names, got {targets!r}")
    groups.append(Int4Group(name, tuple(targets), w["group_size"]))
  ignore = q.get("ignore") or []
  if not isinstance(ignore, (list, tuple)) or not all(isinstance(t, str) for t in ignore):
    refuse(f"ignore must be a list of module names or 're:' patterns, got {ignore!r}")
  for t in list(ignore) + [t for g in groups for t in g.targets]:
    if t.startswith("re:"):
      try:
        re.compile(t[3:])
      except re.error as e:
        refuse(f"pattern {t!r} is not a valid regex ({e})")
  return PublishedQuant(method=COMPRESSED_TENSORS, groups=tuple(groups), ignore=tuple(ignore))


# ----------------------------------------------------------------------------- INT4 bits

def int4_from_packed(packed: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """compressed-tensors INT4 -> Int4Weight's layout "kn", the same integers and scales.

  Args:
    packed: ``weight_packed`` int32 [N, K/8] (or a column range of it, whole words).
    scale: ``weight_scale`` [N, K/group].

  Returns:
    (packed uint8 [K/2, N], scales [K/group, N] in the stored dtype).
  """
  # The words' bytes as stored (safetensors is little-endian): byte j of a row holds
  # columns 2j (bits 0-3) and 2j+1 (bits 4-7), each plus 8; XOR 0x88 flips bit 3 of both
  # nibbles, which turns (q + 8) mod 16 into q mod 16, the two's-complement nibble.
  raw = np.ascontiguousarray(packed).view(np.uint8)  # [N, K/2]
  return np.ascontiguousarray((raw ^ np.uint8(0x88)).T), np.ascontiguousarray(scale.T)


def int4_to_packed(packed_kn: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Int4Weight's layout "kn" -> compressed-tensors INT4 (inverse of :func:`int4_from_packed`).

  Args:
    packed_kn: uint8 [K/2, N], K a multiple of 8.
    scales: [K/group, N].

  Returns:
    (``weight_packed`` int32 [N, K/8], ``weight_scale`` [N, K/group]).
  """
  raw = np.ascontiguousarray(np.asarray(packed_kn).T ^ np.uint8(0x88))  # [N, K/2]
  return raw.view("<i4").astype(np.int32), np.ascontiguousarray(np.asarray(scales).T)
