"""Temporary folders that tests remove when they finish.

``tempfile.mkdtemp`` leaves its folder behind. Over repeated runs, the suite's
checkpoints, experiment outputs and server logs filled a development machine's /tmp. :func:`temp_dir` registers the removal with the test
(or its class) that asked, so it runs whether the test passed or failed.
"""

from __future__ import annotations

import shutil
import tempfile
import unittest


def temp_dir(owner, prefix: str = "mlkit_test_", **kwargs) -> str:
  """A new folder, removed when ``owner`` is done with it.

  Args:
    owner: a TestCase instance (removed after that test) or a TestCase class
      (removed after the class's tests, for folders made in ``setUpClass``).
    prefix: the folder name's start, naming the test that made it.
    **kwargs: passed to ``tempfile.mkdtemp`` (``dir=``).

  Returns:
    The folder's path.
  """
  path = tempfile.mkdtemp(prefix=prefix, **kwargs)
  if isinstance(owner, type) and issubclass(owner, unittest.TestCase):
    owner.addClassCleanup(shutil.rmtree, path, ignore_errors=True)
  elif isinstance(owner, unittest.TestCase):
    owner.addCleanup(shutil.rmtree, path, ignore_errors=True)
  else:
    raise TypeError(f"owner must be a TestCase or a TestCase class, got {owner!r}")
  return path
