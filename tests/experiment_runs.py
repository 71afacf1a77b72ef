"""Run ``python -m experiments ...`` in a child process, as a user would, and read its record.

Tests of experiments run them the way the README does (a fresh interpreter from
the repository root), never by importing ``experiments``: the suite then checks
the command users type, and no test's JAX state leaks into an experiment's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_experiment(*names: str, out: str, args: tuple[str, ...] = ("--smoke",),
                   env: dict | None = None, timeout: float = 600) -> dict:
  """Runs ``python -m experiments NAMES... ARGS --out OUT`` and returns ``{name: record}``.

  Args:
    *names: the experiments to run, in one process.
    out: the output folder; each experiment writes ``<name>.json`` (and .md, .png) there.
    args: the flags before ``--out`` (``--smoke`` unless told).
    env: the child's environment (default: this process's).
    timeout: seconds before the run is killed and the test fails.

  Raises:
    AssertionError: the command failed; the message holds the tails of its output.
  """
  cmd = [sys.executable, "-m", "experiments", *names, *args, "--out", out]
  r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
  if r.returncode:
    raise AssertionError(f"{' '.join(cmd[1:])} exited {r.returncode}:\n"
                         f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
  records = {}
  for name in names:
    with open(os.path.join(out, f"{name}.json")) as f:
      records[name] = json.load(f)
  return records
