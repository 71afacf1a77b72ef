"""A pytest plugin, on when COMPILE_LOG_DIR is set, that logs every XLA compile the tests run.

About half of `make test` is XLA compiling programs (docs/testing.md, "Where the suite's
time goes"), so the count of compiles per test file is the measure to cut, and unlike a
timing on a shared 2-core machine it does not vary from run to run. Run

    COMPILE_LOG_DIR=/tmp/compiles .venv/bin/python -m pytest tests/test_x.py
    .venv/bin/python tests/compile_log.py /tmp/compiles

(tests/conftest.py registers it; under pytest-xdist each worker writes its own file). Each record holds the
test, the program's name, a hash of its StableHLO text (the same program compiled twice
has the same hash), the platform (cpu, or cuda for the H200 compiles) and the seconds the
compile took.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import sys
import time

_current = ["(collection)"]
_out: list = []


def _log_dir() -> str:
  return os.environ["COMPILE_LOG_DIR"]


def _install() -> None:
  from jax._src import compiler
  compile_and_load = compiler.backend_compile_and_load

  def logged(backend, module, *args, **kwargs):
    t0 = time.perf_counter()
    try:
      return compile_and_load(backend, module, *args, **kwargs)
    finally:
      seconds = time.perf_counter() - t0
      text = module.operation.get_asm(enable_debug_info=False)
      if not _out:
        os.makedirs(_log_dir(), exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out.append(open(os.path.join(_log_dir(), f"{worker}-{os.getpid()}.jsonl"), "a"))
      _out[0].write(json.dumps({
          "test": _current[0], "name": str(module.operation.attributes["sym_name"]).strip('"'),
          "hash": hashlib.sha1(text.encode()).hexdigest()[:16],
          "platform": getattr(backend, "platform", "?"), "seconds": round(seconds, 4)}) + "\n")
      _out[0].flush()

  # jax calls it by its module-global name, so replacing the attribute reaches every compile.
  compiler.backend_compile_and_load = logged


def pytest_plugin_registered(plugin, manager):
  del manager
  if plugin is sys.modules[__name__]:
    _install()


def pytest_runtest_logstart(nodeid, location):
  del location
  _current[0] = nodeid


def summarize(log_dir: str) -> str:
  """Per test file: compiles, seconds compiling, repeats of a program already compiled in
  that file, and the most frequent program names; a markdown table, most seconds first."""
  files: dict[str, list] = collections.defaultdict(list)
  for path in glob.glob(os.path.join(log_dir, "*.jsonl")):
    with open(path) as f:
      for line in f:
        r = json.loads(line)
        files[r["test"].split("::")[0]].append(r)
  rows = ["| file | compiles | seconds | repeats | most compiled |", "|---|---|---|---|---|"]
  for name, recs in sorted(files.items(), key=lambda kv: -sum(r["seconds"] for r in kv[1])):
    seen, repeats = set(), 0
    for r in recs:
      key = (r["hash"], r["platform"])
      repeats += key in seen
      seen.add(key)
    top = collections.Counter(r["name"] for r in recs).most_common(3)
    rows.append(f"| {name} | {len(recs)} | {sum(r['seconds'] for r in recs):.1f} | {repeats} | "
                + ", ".join(f"{n} x{c}" for n, c in top) + " |")
  return "\n".join(rows)


if __name__ == "__main__":
  if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
    sys.exit("usage: python tests/compile_log.py LOG_DIR (the COMPILE_LOG_DIR of a run)")
  print(summarize(sys.argv[1]))
