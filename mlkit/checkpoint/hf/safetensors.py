"""Reading safetensors files: the lazy reader, the stored dtypes, and fp8 block scales.

A checkpoint directory holds ``config.json`` plus ``model.safetensors``, or shards
``model-0000i-of-0000N.safetensors`` listed in ``model.safetensors.index.json``.

Kept apart from loading because it concerns the file format only, not our
model: :class:`Reader` opens and validates every file up front and reads a
tensor (or only a box of it) with plain ``pread`` calls rather than through
safetensors' memory map, whose pages would count in the process's resident
memory (docs/checkpoints.md). Weights stored as float8_e4m3fn with a DeepSeek
block scale ``<name>_scale_inv`` (one f32 per 128x128 block) are checked and
dequantised here (:func:`dequantize_fp8_blocks`). Every unreadable or
inconsistent file is a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
import struct

import ml_dtypes
import numpy as np
from safetensors import safe_open

from mlkit.checkpoint.errors import CheckpointError, read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}
# What errors are reported under: only the loader reads (the writer writes whole files).
LOAD_OP = "load_hf_checkpoint"


class Reader:
  """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint.

  Every file it opens is validated up front (safetensors checks that the header is
  complete and that the data covers every tensor), and every failure is a
  :class:`CheckpointError` naming the file.
  """

  def __init__(self, path: str):
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
      # The index is authoritative: tensors in the shards that it does not list are ignored.
      weight_map = read_json(LOAD_OP, index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise CheckpointError(LOAD_OP, index, f"has no 'weight_map' object (got {type(weight_map).__name__})")
      for k, v in weight_map.items():
        if not isinstance(v, str) or not v or os.path.basename(v) != v:
          raise CheckpointError(LOAD_OP, index, f"weight_map[{k!r}] must be a file name in {path}, got {v!r}")
      for fname in sorted(set(weight_map.values())):
        if not os.path.exists(os.path.join(path, fname)):
          raise FileNotFoundError(f"{LOAD_OP}: shard {fname} listed in {index} is missing")
      self._where = {k: os.path.join(path, v) for k, v in weight_map.items()}
      files = sorted(set(self._where.values()))
    else:
      self._where = {}
      files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
      if not files:
        raise FileNotFoundError(f"{LOAD_OP}: no *.safetensors files in {path}")
    self._handles = {}
    for f in files:
      try:
        self._handles[f] = safe_open(f, framework="numpy")
      except Exception as e:  # SafetensorError (truncated, bad header) or OSError
        raise CheckpointError(LOAD_OP, f, f"not a readable safetensors file ({e})") from e
    self._headers: dict[str, dict] = {}
    self.bytes_read = 0  # tensor bytes read from the files so far
    keys = {f: set(h.keys()) for f, h in self._handles.items()}
    if os.path.exists(index):
      for k, fname in self._where.items():
        if k not in keys[fname]:
          raise CheckpointError(LOAD_OP, fname, f"tensor {k} is listed in {INDEX_FILE} but missing from "
                                              "this file")
    else:
      for fname in files:
        for k in keys[fname]:
          if k in self._where:
            raise CheckpointError(LOAD_OP, fname, f"tensor {k} appears in both "
                                                f"{os.path.basename(self._where[k])} and this file")
          self._where[k] = fname

  def names(self) -> set[str]:
    return set(self._where)

  def has(self, name: str) -> bool:
    return name in self._where

  def file(self, name: str) -> str:
    """The file holding tensor ``name``."""
    return self._where[name]

  def _slice(self, name):
    return self._handles[self._where[name]].get_slice(name)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._slice(name).get_shape())

  def st_dtype(self, name: str) -> str:
    return self._slice(name).get_dtype()

  def nbytes(self, name: str) -> int:
    """Stored bytes of tensor ``name`` (from the header)."""
    size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(
        self.st_dtype(name), 1)
    return size * math.prod(self.shape(name))

  def get(self, name: str, box: tuple[tuple[int, int], ...] | None = None) -> np.ndarray:
    """Tensor ``name``, or only its ``box`` (a ``(start, stop)`` per axis) read from the file."""
    st = self.st_dtype(name)
    dtype = FP8_DTYPES.get(st) or _ST_DTYPES.get(st)
    if dtype is None:
      raise CheckpointError(LOAD_OP, self._where[name], f"tensor {name} has dtype {st}, which "
                                                     "this loader does not read")
    return self._read_raw(name, np.dtype(dtype), box)

  def _header(self, fname: str) -> dict:
    if fname not in self._headers:
      with open(fname, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        self._headers[fname] = {"_base": 8 + n, **json.loads(f.read(n))}
    return self._headers[fname]

  def _read_raw(self, name: str, dtype: np.dtype, box) -> np.ndarray:
    # Plain reads, not safetensors' memory map: mapped file pages count in the process's
    # resident memory until unmapped, so reading a whole checkpoint through the map
    # would hold all of it (docs/checkpoints.md). Also, safetensors' numpy backend cannot
    # build float8 arrays. Format: u64 header length, JSON header with data_offsets, data.
    # A box is read as its contiguous runs only (docs/checkpoints.md, "Multi-process loading").
    fname = self._where[name]
    try:
      hdr = self._header(fname)
      shape = tuple(hdr[name]["shape"])
      start, end = hdr[name]["data_offsets"]
      if end - start != dtype.itemsize * math.prod(shape):
        raise ValueError(f"data_offsets span {end - start} bytes, the shape needs "
                         f"{dtype.itemsize * math.prod(shape)}")
      box = tuple((0, d) for d in shape) if box is None else tuple(box)
      out_shape = tuple(b - a for a, b in box)
      out = bytearray(dtype.itemsize * math.prod(out_shape))
      if out:
        strides = [dtype.itemsize * math.prod(shape[a + 1:]) for a in range(len(shape))]
        # The last axis the box cuts: each run spans it (and every whole axis after it).
        k = max([a for a in range(len(shape)) if box[a] != (0, shape[a])], default=0)
        run = (box[k][1] - box[k][0]) * strides[k] if shape else dtype.itemsize
        view, pos = memoryview(out), 0
        with open(fname, "rb", buffering=0) as f:
          fd = f.fileno()
          for prefix in itertools.product(*(range(a, b) for a, b in box[:k])):
            off = hdr["_base"] + start + sum(i * st for i, st in zip(prefix, strides))
            off += box[k][0] * strides[k] if shape else 0
            _pread_into(fd, view[pos:pos + run], off)
            pos += run
        self.bytes_read += len(out)
      return np.frombuffer(out, dtype=np.uint8).view(dtype).reshape(out_shape)
    except (OSError, ValueError, KeyError, struct.error) as e:
      raise CheckpointError(LOAD_OP, fname, f"cannot read tensor {name} ({e})") from e


def _pread_into(fd: int, view: memoryview, off: int) -> None:
  """Fills ``view`` from ``fd`` at offset ``off`` (a read may return less than asked)."""
  while len(view):
    n = os.preadv(fd, [view], off)
    if n <= 0:
      raise ValueError(f"file ends at byte {off} (truncated)")
    view, off = view[n:], off + n


def check_fp8_scales(shape, scale_shape, block: tuple[int, int], name: str) -> None:
  """Raises ValueError naming ``name`` unless ``scale_shape`` is one scale per ``block`` of a 2-D ``shape``."""
  if len(shape) != 2:
    raise ValueError(f"{name}: fp8 block scales need a 2-D weight, got shape {tuple(shape)}")
  bo, bi = block
  expected = (math.ceil(shape[0] / bo), math.ceil(shape[1] / bi))
  if tuple(scale_shape) != expected:
    raise ValueError(f"{name}_scale_inv: expected shape {expected} for weight {tuple(shape)} with "
                     f"{bo}x{bi} blocks, got {tuple(scale_shape)}")


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128),
                          *, name: str = "weight") -> np.ndarray:
  """DeepSeek fp8 block dequantisation: ``w * scale_inv`` broadcast over [bo, bi] blocks.

  Args:
    w: fp8 weight [out, in].
    scale_inv: one f32 multiplier per block [ceil(out/bo), ceil(in/bi)].
    block: block shape (bo, bi).
    name: tensor name for error messages.

  Returns:
    The f32 weight [out, in].
  """
  check_fp8_scales(w.shape, scale_inv.shape, block, name)
  bo, bi = block
  s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)
  return w.astype(np.float32) * s[:w.shape[0], :w.shape[1]]
