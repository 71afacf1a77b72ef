"""Hugging Face checkpoint -> quantised orbax checkpoint, resumable (``python -m mlkit.convert``).

:func:`convert_hf_checkpoint` reads the source with
:func:`mlkit.checkpoint.hf.open_hf_checkpoint` (everything checked before the first
read), converts one parameter at a time exactly as :func:`load_hf_checkpoint` does,
and writes each into a staging directory beside the destination::

  <dst>.convert-staging/
    manifest.json            the source's fingerprint, the recipe and dtype, the leaf names
    leaves/<leaf>.<i>.bin    the raw bytes of the leaf's i-th array (a quantised leaf has two)
    leaves/<leaf>.json       shape, dtype and CRC-32 of each: written last, it marks the leaf done

Every file is written to ``<name>.tmp``, synced and renamed, so a kill leaves
either a complete file or a ``.tmp`` that is ignored. Re-running the same command
reuses every leaf whose record is there and whose files still match their CRC-32,
and converts only the rest. When every leaf is staged, the orbax checkpoint is
assembled from them (``save_checkpoint``, which writes into a temporary directory
and renames it to ``<dst>`` only once complete) and the staging directory is
removed. ``<dst>`` therefore never exists half-written. See docs/checkpoints.md.

:func:`export_hf_checkpoint` writes a Hugging Face checkpoint instead, in one of
:func:`~mlkit.checkpoint.hf.save_hf_checkpoint`'s formats (compressed-tensors INT4,
FP8 with block scales, or dense): it holds the converted model in host memory and
is not resumable, and it too renames its output into place only once complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import time
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.checkpoint.hf import CONFIG_FILE, INDEX_FILE, open_hf_checkpoint
from mlkit.checkpoint.orbax_io import is_complete_checkpoint, save_checkpoint, with_param_shardings

log = logging.getLogger(__name__)

STAGING_SUFFIX = ".convert-staging"
_MANIFEST = "manifest.json"
_LEAVES = "leaves"
_STAGING_VERSION = 1
_CONVERT = "convert_hf_checkpoint"


@dataclasses.dataclass(frozen=True)
class ConvertResult:
  """What one :func:`convert_hf_checkpoint` call did.

  Attributes:
    path: the orbax checkpoint written.
    converted: leaves read and converted by this call, in order.
    reused: leaves taken from the staging directory of an interrupted run.
    bytes_read: tensor bytes read from the source by this call.
    seconds: wall time of the call.
    per_device_bytes: with ``mesh``, the bytes one device of it holds when the
      checkpoint is loaded there (the largest shard of each leaf); else None.
  """

  path: str
  converted: tuple[str, ...]
  reused: tuple[str, ...]
  bytes_read: int
  seconds: float
  per_device_bytes: int | None = None


def staging_dir(dst: str | os.PathLike) -> str:
  """Where a conversion into ``dst`` keeps its converted leaves until it completes."""
  return os.path.abspath(os.fspath(dst)) + STAGING_SUFFIX


def _write_file(path: str, data) -> None:
  """Writes ``data`` (bytes-like) to ``path`` atomically: ``path.tmp``, fsync, rename."""
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _write_json(path: str, value) -> None:
  _write_file(path, json.dumps(value, indent=1, sort_keys=True).encode())


def _bytes(arr: np.ndarray) -> np.ndarray:
  """The array's bytes as uint8 (memoryview cannot export bfloat16 / float8 buffers)."""
  return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _crc32(arr: np.ndarray) -> int:
  return zlib.crc32(_bytes(arr))


def _size(n: float) -> str:
  return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _fingerprint(src: str) -> dict:
  """Identifies the source files: a changed source must not resume an old staging."""
  files = {}
  for name in sorted(os.listdir(src)):
    if name.endswith(".safetensors") or name in (CONFIG_FILE, INDEX_FILE):
      st = os.stat(os.path.join(src, name))
      files[name] = [st.st_size, st.st_mtime_ns]
  return files


def _resolve_recipe(recipe):
  from mlkit.quant import RECIPES, Recipe
  if isinstance(recipe, Recipe):
    if RECIPES.get(recipe.name) != recipe:
      raise ValueError(f"{_CONVERT}: recipe {recipe.name!r} is not one of mlkit.quant.RECIPES; the "
                       "checkpoint records its recipe by name")
    return recipe
  if recipe not in RECIPES:
    raise ValueError(f"{_CONVERT}: unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
  return RECIPES[recipe]


class _Staging:
  """The staging directory of one conversion (layout in the module docstring)."""

  def __init__(self, path: str, manifest: dict):
    self.path = path
    self.leaves = os.path.join(path, _LEAVES)
    manifest_file = os.path.join(path, _MANIFEST)
    old = None
    if os.path.exists(manifest_file):
      try:
        with open(manifest_file) as f:
          old = json.load(f)
      except (OSError, ValueError):
        old = None
    if old != manifest:
      if os.path.exists(path):
        log.warning("%s: %s was staged from another source, recipe or dtype (or is damaged); "
                    "starting over", _CONVERT, path)
        shutil.rmtree(path)
      os.makedirs(self.leaves)
      _write_json(manifest_file, manifest)

  def _record(self, name: str) -> str:
    return os.path.join(self.leaves, name + ".json")

  def _array_file(self, name: str, j: int) -> str:
    return os.path.join(self.leaves, f"{name}.{j}.bin")

  def load(self, name: str, expected: list, verify: bool = True) -> list[np.ndarray] | None:
    """The staged arrays of leaf ``name`` (memory-mapped) if complete and, with ``verify``,
    intact (CRC-32), else None."""
    try:
      with open(self._record(name)) as f:
        record = json.load(f)
      arrays = []
      for j, (want, exp) in enumerate(zip(record["arrays"], expected, strict=True)):
        dtype = jnp.dtype(want["dtype"])
        if tuple(want["shape"]) != tuple(exp.shape) or dtype != jnp.dtype(exp.dtype):
          return None
        path = self._array_file(name, j)
        if os.path.getsize(path) != dtype.itemsize * int(np.prod(want["shape"])):
          return None
        arr = (np.memmap(path, dtype=dtype, mode="r", shape=tuple(want["shape"]))
               if os.path.getsize(path) else np.zeros(want["shape"], dtype))
        if verify and _crc32(arr) != want["crc32"]:
          log.warning("%s: staged %s fails its CRC-32; converting it again", _CONVERT, name)
          return None
        arrays.append(arr)
      return arrays
    except (OSError, ValueError, KeyError, TypeError):
      return None  # missing or damaged: convert it again

  def store(self, name: str, arrays: list[np.ndarray]) -> None:
    record = []
    for j, arr in enumerate(arrays):
      arr = np.ascontiguousarray(arr)
      _write_file(self._array_file(name, j), _bytes(arr))
      record.append({"shape": list(arr.shape), "dtype": jnp.dtype(arr.dtype).name,
                     "crc32": _crc32(arr)})
    _write_json(self._record(name), {"arrays": record})  # last: the leaf is done


def convert_hf_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, recipe, dtype=None,
                          mesh=None, rules=None, overwrite: bool = False,
                          progress: Callable[[str], None] | None = None,
                          after_leaf: Callable[[int, str], None] | None = None) -> ConvertResult:
  """Converts a Hugging Face checkpoint into a quantised orbax checkpoint, resumably.

  The result loads with ``load_checkpoint(dst)`` (or ``load_checkpoint(dst, mesh=...)``)
  into params bit-identical to ``load_hf_checkpoint(src, recipe=recipe, dtype=dtype)``
  (and to that with the same ``mesh=``), without reading or quantising the source again.

  Args:
    src: the Hugging Face checkpoint directory (see :func:`load_hf_checkpoint`).
    dst: the orbax checkpoint directory to write.
    recipe: a name in ``mlkit.quant.RECIPES`` or that Recipe. Round-to-nearest
      recipes only: GPTQ needs calibration activations of the loaded model, which a
      conversion does not have (quantise after loading with ``mlkit.quant.gptq``).
    dtype: parameter dtype ("bfloat16"/"float32"), as for :func:`load_hf_checkpoint`.
    mesh: optional serving mesh (a ``jax.sharding.Mesh`` or ``AbstractMesh``: no
      devices needed) to plan for: the shardings of every converted leaf on it are
      worked out before anything is read, and the bytes one device holds are
      reported. The checkpoint itself stores whole arrays and loads on any mesh.
    rules: logical-axis rules with ``mesh``.
    overwrite: replace a complete checkpoint (or anything else) at ``dst``; it is
      replaced only once the new one is fully staged.
    progress: called with one line per leaf (and at the start and end); default: logging.
    after_leaf: called with (index, name) after each leaf is staged (tests use it to
      interrupt a conversion).

  Returns:
    A :class:`ConvertResult`.

  Raises:
    FileExistsError: ``dst`` exists (a complete checkpoint or not) and ``overwrite`` is False.
    FileNotFoundError: the source directory, its config.json or a shard is missing.
    CheckpointError: a source file is unreadable or does not fit its config (names it).
    ValueError: an unknown recipe, a GPTQ recipe, rules without a mesh.
    OSError: writing failed; with ``errno.ENOSPC`` the message says how much is staged.
      Re-running the same call resumes.
  """
  t0 = time.perf_counter()
  say = progress or (lambda line: log.info("%s", line))
  recipe = _resolve_recipe(recipe)
  if rules is not None and mesh is None:
    raise ValueError(f"{_CONVERT}: rules= needs a mesh=")
  src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
  if os.path.exists(dst) and not overwrite:
    what = "a complete checkpoint" if is_complete_checkpoint(dst) else "something that is not a checkpoint"
    raise FileExistsError(f"{_CONVERT}: {dst} already exists and holds {what}; pass overwrite=True "
                          "(--overwrite) to replace it")
  ck = open_hf_checkpoint(src, dtype=dtype, recipe=recipe)
  _say_conversions(ck, recipe, say)
  per_device = None
  if mesh is not None:
    from mlkit.parallel.abstract import per_device_bytes
    per_device = per_device_bytes(with_param_shardings(ck.abstract, mesh, rules, ck.cfg))
    say(f"on mesh {dict(mesh.shape)}: {_size(per_device)} of parameters per device")
  expected = [jax.tree_util.tree_leaves(leaf) for leaf in _leaf_abstracts(ck)]
  manifest = {"version": _STAGING_VERSION, "source": src, "files": _fingerprint(src),
              "recipe": recipe.name, "dtype": ck.cfg.param_dtype, "leaves": ck.names}
  staging = _Staging(staging_dir(dst), manifest)

  n = len(ck)
  intact = [staging.load(name, exp) is not None for name, exp in zip(ck.names, expected)]
  todo = [i for i in range(n) if not intact[i]]
  reused = [ck.names[i] for i in range(n) if intact[i]]
  total = sum(ck.nbytes(i) for i in todo)
  say(f"{src} -> {dst} ({recipe.name}, {ck.cfg.param_dtype}): {n} tensors, {len(reused)} already "
      f"converted in {staging.path}, {len(todo)} to convert ({_size(total)} to read)")
  done_bytes, t_read = 0, time.perf_counter()
  for k, i in enumerate(todo):
    name = ck.names[i]
    leaf = ck.leaf(i)
    arrays = [np.asarray(x) for x in jax.tree_util.tree_leaves(leaf)]
    del leaf
    with _out_of_space(f"writing {name} into {staging.path} ({len(reused) + k} of {n} tensors are "
                       "staged there; free space and run the same conversion again to resume)"):
      staging.store(name, arrays)
    del arrays
    done_bytes += ck.nbytes(i)
    dt = max(time.perf_counter() - t_read, 1e-9)
    say(f"[{len(reused) + k + 1}/{n}] {name}: {_size(done_bytes)} of {_size(total)} read, "
        f"{done_bytes / 1e6 / dt:.1f} MB/s")
    if after_leaf is not None:
      after_leaf(i, name)

  say(f"assembling the orbax checkpoint {dst}")
  fields = []
  for name, exp in zip(ck.names, expected):
    # Checked when reused or just written; save_checkpoint records every leaf's CRC-32 again.
    arrays = staging.load(name, exp, verify=False)
    if arrays is None:  # removed or truncated under us since it was staged
      raise OSError(errno.EIO, f"{_CONVERT}: staged {name} in {staging.path} is gone or truncated; "
                    "run the conversion again")
    fields += arrays
  params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(ck.abstract), fields)
  with _out_of_space(f"writing the orbax checkpoint {dst} (all {n} tensors are staged in "
                     f"{staging.path}; free space and run the same conversion again to finish)"):
    save_checkpoint(dst, params, ck.cfg, overwrite=overwrite, recipe=recipe)
    # The tokenizer travels with the weights: a server reads it from the checkpoint.
    from mlkit.text.files import copy_tokenizer_files
    copied = copy_tokenizer_files(str(src), str(dst))
  if copied:
    say(f"copied the tokenizer files {', '.join(copied)}")
  del params, fields
  shutil.rmtree(staging.path, ignore_errors=True)
  secs = time.perf_counter() - t0
  say(f"done: {dst} ({len(todo)} tensors converted, {len(reused)} reused) in {secs:.1f} s")
  return ConvertResult(dst, tuple(ck.names[i] for i in todo), tuple(reused),
                       sum(ck.bytes_read.values()), secs, per_device)


def export_hf_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, recipe, format: str,
                         dtype=None, shards: int = 1, overwrite: bool = False,
                         progress: Callable[[str], None] | None = None) -> ConvertResult:
  """Converts a Hugging Face checkpoint into another Hugging Face checkpoint.

  The source is read as :func:`load_hf_checkpoint` reads it (published formats kept,
  ``recipe`` applied), and written by ``save_hf_checkpoint(..., format=format)``:
  "compressed-tensors" (INT4 pack-quantized), "fp8-block" (FP8, 128x128 block scales)
  or "dense". The result loads back into the same params, bit for bit. The whole
  converted model is held in host memory; the output is written into
  ``<dst>.export-tmp`` and renamed to ``dst`` once complete.

  Args:
    src, dst: the source checkpoint directory and the directory to write.
    recipe: a name in ``mlkit.quant.RECIPES`` or that Recipe (round to nearest).
    format: the output format (see above).
    dtype: parameter dtype, as for :func:`load_hf_checkpoint`.
    shards: safetensors files to write.
    overwrite: replace an existing ``dst``.
    progress: called with a few lines (start, conversions, end); default: logging.

  Returns:
    A :class:`ConvertResult` (``converted`` lists every leaf; nothing is ever reused).

  Raises:
    FileExistsError: ``dst`` exists and ``overwrite`` is False.
    FileNotFoundError / CheckpointError: as for :func:`load_hf_checkpoint`.
    ValueError: an unknown or GPTQ recipe, an unknown format, or params the format
      cannot hold (names the leaf; before anything is written).
  """
  from mlkit.checkpoint.hf.save import FORMATS, save_hf_checkpoint
  t0 = time.perf_counter()
  say = progress or (lambda line: log.info("%s", line))
  recipe = _resolve_recipe(recipe)
  if format not in FORMATS:
    raise ValueError(f"{_CONVERT}: format must be one of {FORMATS}, got {format!r}")
  src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
  if os.path.exists(dst) and not overwrite:
    raise FileExistsError(f"{_CONVERT}: {dst} already exists; pass overwrite=True (--overwrite) to "
                          "replace it")
  ck = open_hf_checkpoint(src, dtype=dtype, recipe=recipe)
  say(f"{src} -> {dst} ({recipe.name}, {format}, {ck.cfg.param_dtype}): {len(ck)} tensors, "
      f"{_size(sum(ck.nbytes(i) for i in range(len(ck))))} to read")
  _say_conversions(ck, recipe, say)
  params, cfg = ck.load()
  tmp = dst + ".export-tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  with _out_of_space(f"writing {tmp} (run the same command again)"):
    save_hf_checkpoint(tmp, params, cfg, shards=shards, format=format)
    from mlkit.text.files import copy_tokenizer_files
    copy_tokenizer_files(src, tmp)
  del params
  if os.path.exists(dst):
    shutil.rmtree(dst)
  os.replace(tmp, dst)
  secs = time.perf_counter() - t0
  say(f"done: {dst} in {secs:.1f} s")
  return ConvertResult(dst, tuple(ck.names), (), sum(ck.bytes_read.values()), secs)


def _say_conversions(ck, recipe, say) -> None:
  """One line on what the recipe does to the source's published formats."""
  if ck.conversions:
    name, how = next(iter(ck.conversions.items()))
    say(f"recipe {recipe.name} converts {len(ck.conversions)} published weight(s), dequantising "
        f"each tensor and quantising it (e.g. {name}: {how})")


@contextlib.contextmanager
def _out_of_space(what: str):
  """A full disk becomes an OSError(ENOSPC) that says what was being written and how to resume."""
  try:
    yield
  except OSError as e:
    if e.errno != errno.ENOSPC:
      raise
    raise OSError(errno.ENOSPC, f"no space left on device {what}") from e


def _leaf_abstracts(ck) -> list:
  from mlkit.quant.tree import is_quantised
  return jax.tree_util.tree_leaves(ck.abstract, is_leaf=is_quantised)
