"""The one error type for checkpoint files that cannot be used as they are."""

from __future__ import annotations

import json
import os
from typing import Any


class CheckpointError(ValueError):
  """A checkpoint file or directory that is unreadable, corrupt or does not fit the config.

  The message is ``"<func>: <path>: <cause>"``, so that every such error names the file.

  Attributes:
    path: the file or directory at fault.
    cause: what is wrong with it, in one line.
  """

  def __init__(self, func: str, path: str | os.PathLike, cause: str):
    self.path = os.fspath(path)
    self.cause = cause
    super().__init__(f"{func}: {self.path}: {cause}")


def read_json(func: str, path: str, kind: type = dict) -> Any:
  """Parses the JSON file at ``path``; its top-level value must be a ``kind``.

  Raises:
    CheckpointError: naming ``path`` if it cannot be read, is not valid JSON (with the
      line and column), or holds another type.
  """
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(func, path, f"invalid JSON ({e})") from e
  except (OSError, UnicodeDecodeError) as e:
    raise CheckpointError(func, path, f"cannot be read ({e})") from e
  if not isinstance(value, kind):
    raise CheckpointError(func, path, f"expected a JSON {'object' if kind is dict else kind.__name__}"
                                      f", got {type(value).__name__}")
  return value
