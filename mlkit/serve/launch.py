"""Starting server processes from Python (tests, experiments, scripts): one place for the details.

    pre = launch.start("prefill", "127.0.0.1:7100", ["--model", "tiny-mla"], log="prefill.log")
    launch.wait_ready(pre, "prefill.log")

Imports no JAX.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

READY = "mlkit.serve: ready"  # the line a server prints once it takes requests


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port nothing listens on now (the OS picks it)."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def start(role: str, listen: str, args: list[str], *, log: str,
          python: str = sys.executable) -> subprocess.Popen:
  """Starts ``python -m mlkit.serve --role ROLE --listen LISTEN ARGS``, its output into ``log``.

  The process runs from the repository root (so ``configs`` imports) and
  inherits the environment; it sets its own device count (``--devices``).
  """
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  with open(log, "w") as f:  # the child keeps its own descriptor
    return subprocess.Popen([python, "-m", "mlkit.serve", "--role", role, "--listen", listen,
                             *args], cwd=root, stdout=f, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, log: str, timeout_s: float = 300.0) -> None:
  """Waits for the server's ready line.

  Raises:
    RuntimeError: the process exited first (with the end of its log).
    TimeoutError: no ready line within ``timeout_s``.
  """
  deadline = time.monotonic() + timeout_s
  while True:
    with open(log) as f:
      text = f.read()
    if READY in text:
      return
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with status {proc.returncode}:\n{text[-3000:]}")
    if time.monotonic() > deadline:
      raise TimeoutError(f"server not ready within {timeout_s:g} s:\n{text[-3000:]}")
    time.sleep(0.1)
