"""Starts a worker script as two JAX processes on 127.0.0.1 (the multi-process tests).

Each worker gets ``--port P --process_id I --out DIR`` plus the caller's arguments,
sets its own XLA_FLAGS (devices per process) before importing jax and writes its
results under DIR; :func:`two_processes` yields DIR once both exited cleanly.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile


@contextlib.contextmanager
def two_processes(test, worker: str, args=(), timeout_s: float = 240):
  """Runs ``worker`` as processes 0 and 1 of a 2-process job; yields their output directory.

  Args:
    test: the TestCase (its ``fail``/``assertEqual`` report a timeout or a failed process,
      with the end of that process's log).
    worker: path of the worker script.
    args: extra command-line arguments for both processes.
    timeout_s: how long both may take together.
  """
  with socket.socket() as s:  # a free port (released just before the coordinator binds it)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  worker = os.path.abspath(worker)
  root = os.path.dirname(os.path.dirname(worker))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)  # the worker sets its devices per process itself
  with tempfile.TemporaryDirectory() as out:
    procs = [subprocess.Popen([sys.executable, worker, "--port", str(port), "--process_id", str(i),
                               "--out", out, *args], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
      for p in procs:
        logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      test.fail(f"the 2-process run of {os.path.basename(worker)} exceeded {timeout_s} s")
    for i, p in enumerate(procs):
      test.assertEqual(p.returncode, 0, f"process {i} failed:\n{logs[i][-3000:]}")
    yield out
