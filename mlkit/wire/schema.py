"""Schemas for frames that arrive from a socket: types, lengths and ranges, checked before use.

A decoded frame is plain data (dicts with string keys, lists, ints, floats,
strings, bytes, numpy arrays; ``mlkit.wire.frames``). Before any of it is used,
the receiver checks it against the schema of its message kind: every field's
type, every list's and string's length, every number's range, every array's
dtype, rank and size. A value that fails raises :class:`SchemaError` naming the
path of the offending field (``prompts[3][17]: 200000 is not in [0, 1000)``).

Schemas are small frozen objects; ``schema.check(value, path)`` returns the
value (lists of ints as Python ints, arrays as numpy arrays) or raises.

    GENERATE = Fields({"prompts": List(List(Int(0, vocab), max_len=4096), max_len=64)})
    msg = GENERATE.check(decoded, "generate")

Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np


class SchemaError(ValueError):
  """A decoded value does not match its schema (the message names the field's path)."""


def _fail(path: str, why: str) -> SchemaError:
  return SchemaError(f"{path or 'frame'}: {why}")


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class Int:
  """An int (never a bool or a float) in [lo, hi)."""

  lo: int | None = None
  hi: int | None = None

  def check(self, value, path: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise _fail(path, f"expected an int, got {type(value).__name__}")
    if (self.lo is not None and value < self.lo) or (self.hi is not None and value >= self.hi):
      raise _fail(path, f"{value} is not in [{self.lo}, {self.hi})")
    return value


@dataclasses.dataclass(frozen=True)
class Float:
  """A finite real number (an int is accepted and converted) in [lo, hi]."""

  lo: float | None = None
  hi: float | None = None

  def check(self, value, path: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise _fail(path, f"expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
      raise _fail(path, f"{value} is not finite")
    if (self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi):
      raise _fail(path, f"{value} is not in [{self.lo}, {self.hi}]")
    return value


@dataclasses.dataclass(frozen=True)
class Bool:
  """True or False."""

  def check(self, value, path: str = "") -> bool:
    if not isinstance(value, bool):
      raise _fail(path, f"expected a bool, got {type(value).__name__}")
    return value


@dataclasses.dataclass(frozen=True)
class Str:
  """A string of at most ``max_len`` characters, one of ``choices`` when given."""

  max_len: int = 256
  choices: tuple[str, ...] | None = None

  def check(self, value, path: str = "") -> str:
    if not isinstance(value, str):
      raise _fail(path, f"expected a string, got {type(value).__name__}")
    if len(value) > self.max_len:
      raise _fail(path, f"string of {len(value)} characters exceeds {self.max_len}")
    if self.choices is not None and value not in self.choices:
      raise _fail(path, f"{_short(value)} is not one of {list(self.choices)}")
    return value


@dataclasses.dataclass(frozen=True)
class Nullable:
  """None, or a value of ``inner``."""

  inner: Any

  def check(self, value, path: str = ""):
    return None if value is None else self.inner.check(value, path)


@dataclasses.dataclass(frozen=True)
class List:
  """A list of ``min_len`` to ``max_len`` items, each of schema ``item``.

  A list of plain ints is checked in one numpy pass when ``item`` is an
  :class:`Int` (token ids: thousands per frame).
  """

  item: Any
  max_len: int
  min_len: int = 0

  def check(self, value, path: str = "") -> list:
    if not isinstance(value, list):
      raise _fail(path, f"expected a list, got {type(value).__name__}")
    if not self.min_len <= len(value) <= self.max_len:
      raise _fail(path, f"list of {len(value)} items; expected {self.min_len} to {self.max_len}")
    if isinstance(self.item, Int) and value and all(type(v) is int for v in value):
      arr = np.asarray(value)
      if arr.dtype.kind == "i":  # every item fits int64 (else the items are checked one by one)
        lo, hi = self.item.lo, self.item.hi
        bad = np.zeros(len(value), bool)
        if lo is not None:
          bad |= arr < lo
        if hi is not None:
          bad |= arr >= hi
        if bad.any():
          i = int(np.argmax(bad))
          raise _fail(f"{path}[{i}]", f"{value[i]} is not in [{lo}, {hi})")
        return value
    return [self.item.check(v, f"{path}[{i}]") for i, v in enumerate(value)]


@dataclasses.dataclass(frozen=True)
class Tuple:
  """A list of exactly ``len(items)`` values, item i of schema ``items[i]``."""

  items: tuple

  def check(self, value, path: str = "") -> list:
    if not isinstance(value, list):
      raise _fail(path, f"expected a list, got {type(value).__name__}")
    if len(value) != len(self.items):
      raise _fail(path, f"expected {len(self.items)} items, got {len(value)}")
    return [s.check(v, f"{path}[{i}]") for i, (s, v) in enumerate(zip(self.items, value))]


@dataclasses.dataclass(frozen=True)
class Fields:
  """A dict with string keys: ``required`` fields must be present, ``optional`` ones may be.

  Any other key is refused: a misspelled field is an error, not silently ignored.
  """

  required: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  optional: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def check(self, value, path: str = "") -> dict:
    if not isinstance(value, dict):
      raise _fail(path, f"expected a map, got {type(value).__name__}")
    missing = [k for k in self.required if k not in value]
    if missing:
      raise _fail(path, f"missing field(s) {missing}")
    out = {}
    for key, v in value.items():
      schema = self.required.get(key) if key in self.required else self.optional.get(key)
      if schema is None:
        raise _fail(path, f"unexpected field {_short(key)}; expected "
                    f"{sorted([*self.required, *self.optional])}")
      out[key] = schema.check(v, f"{path}.{key}" if path else key)
    return out


@dataclasses.dataclass(frozen=True)
class MapOf:
  """A dict of at most ``max_len`` entries: string keys of schema ``key``, values of ``value``."""

  key: Str
  value: Any
  max_len: int

  def check(self, value, path: str = "") -> dict:
    if not isinstance(value, dict):
      raise _fail(path, f"expected a map, got {type(value).__name__}")
    if len(value) > self.max_len:
      raise _fail(path, f"map of {len(value)} entries exceeds {self.max_len}")
    return {self.key.check(k, f"{path} key"): self.value.check(v, f"{path}[{k!r}]")
            for k, v in value.items()}


@dataclasses.dataclass(frozen=True)
class Array:
  """A numpy array (decoded from dtype + shape + raw bytes) of a listed dtype.

  Attributes:
    dtypes: allowed dtype names (e.g. ``("int32",)``).
    ndim: required rank, or None for any.
    shape: required shape; an entry None matches any length.
    max_size: the most elements.
    lo / hi: every element in [lo, hi) (integer arrays).
  """

  dtypes: tuple[str, ...]
  ndim: int | None = None
  shape: tuple | None = None
  max_size: int = 1 << 24
  lo: int | None = None
  hi: int | None = None

  def check(self, value, path: str = "") -> np.ndarray:
    if not isinstance(value, np.ndarray):
      raise _fail(path, f"expected an array, got {type(value).__name__}")
    if value.dtype.name not in self.dtypes:
      raise _fail(path, f"array of dtype {value.dtype.name}; expected one of {list(self.dtypes)}")
    if self.ndim is not None and value.ndim != self.ndim:
      raise _fail(path, f"array of rank {value.ndim}; expected {self.ndim}")
    if self.shape is not None and (
        len(self.shape) != value.ndim
        or any(want is not None and want != got for want, got in zip(self.shape, value.shape))):
      raise _fail(path, f"array of shape {value.shape}; expected {self.shape}")
    if value.size > self.max_size:
      raise _fail(path, f"array of {value.size} elements exceeds {self.max_size}")
    if value.size and (self.lo is not None or self.hi is not None):
      lo, hi = value.min(), value.max()
      if (self.lo is not None and lo < self.lo) or (self.hi is not None and hi >= self.hi):
        raise _fail(path, f"values in [{lo}, {hi}] outside [{self.lo}, {self.hi})")
    return value


@dataclasses.dataclass(frozen=True)
class Plain:
  """JSON-like data (maps with string keys, lists, numbers, strings, bools, None), bounded.

  For values a receiver only reports, such as a metrics snapshot: no arrays or
  bytes, at most ``max_depth`` levels and ``max_items`` values in all.
  """

  max_depth: int = 8
  max_items: int = 100_000

  def check(self, value, path: str = ""):
    count = [0]

    def walk(v, depth, p):
      count[0] += 1
      if count[0] > self.max_items:
        raise _fail(path, f"more than {self.max_items} values")
      if depth > self.max_depth:
        raise _fail(p, f"nested deeper than {self.max_depth} levels")
      if v is None or isinstance(v, (bool, int, str)):
        return
      if isinstance(v, float):
        return
      if isinstance(v, list):
        for i, x in enumerate(v):
          walk(x, depth + 1, f"{p}[{i}]")
        return
      if isinstance(v, dict):
        for k, x in v.items():
          if not isinstance(k, str):
            raise _fail(p, f"map key {_short(k)} is not a string")
          walk(x, depth + 1, f"{p}.{k}")
        return
      raise _fail(p, f"{type(v).__name__} is not plain data")

    walk(value, 0, path)
    return value


def message_schema(kinds: Mapping[str, Fields], value, path: str = "") -> dict:
  """Checks a decoded message: a map whose ``"kind"`` is one of ``kinds``, then that kind's fields.

  Returns:
    The checked message (its ``kind`` kept).

  Raises:
    SchemaError: not a map, no or an unknown kind, or a field that fails its schema.
  """
  if not isinstance(value, dict):
    raise _fail(path, f"a message must be a map, got {type(value).__name__}")
  kind = value.get("kind")
  if not isinstance(kind, str) or kind not in kinds:
    raise _fail(path, f"unknown message kind {_short(kind)}; this end takes {sorted(kinds)}")
  body = {k: v for k, v in value.items() if k != "kind"}
  return {"kind": kind, **kinds[kind].check(body, kind)}
