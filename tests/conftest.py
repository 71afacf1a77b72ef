"""Test-wide setup: 8 host CPU devices for sharding tests, CPU programs compiled fast
(tests/cpu_compile_flags.py), the H200 compile environment, the `gpu` marker, and no
persistent compilation cache.

XLA_FLAGS and the compile environment must be set before jax is imported anywhere, so it
happens at the top of this file, which pytest imports before any test module.
"""

import os

from pallas_kernels.h200 import env as h200_env

import cpu_compile_flags  # tests/ is on sys.path, as for this file

# JAX_PLATFORMS=cpu where there is no GPU (the CUDA compiler plugin is installed), and XLA's
# ptxas report on, so that the kernel compile tests read registers and spills.
h200_env.prepare()

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
# The same CPU programs, compiled faster (tests/cpu_compile_flags.py says how and why). A
# setting already in XLA_FLAGS is kept: set one there to run the tests another way.
flags = cpu_compile_flags.with_test_flags(flags)
os.environ["XLA_FLAGS"] = flags

# No persistent compilation cache in the tests: while hunting a worker crash inside XLA
# (see _release_compiled_programs below), one run died in the cache's write
# (``executable.serialize()``); sharing it between the workers saved only about 2%.
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

# The serving processes' key file (mlkit.wire.keys) for this run: a fresh directory, never the
# user's own ~/.cache/mlkit/serve.key. Servers the tests start on loopback generate the key
# there; clients, and the servers' peers, read it.
if "MLKIT_SERVE_AUTHKEY_FILE" not in os.environ:
  import atexit
  import shutil
  import tempfile
  _key_dir = tempfile.mkdtemp(prefix="mlkit-test-key-")
  os.environ["MLKIT_SERVE_AUTHKEY_FILE"] = os.path.join(_key_dir, "serve.key")
  atexit.register(shutil.rmtree, _key_dir, ignore_errors=True)
os.environ.pop("MLKIT_SERVE_AUTHKEY", None)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Stateful tests: CI runs a fixed, derandomised budget (about a minute in all); `make soak`
# (HYPOTHESIS_PROFILE=soak) searches far longer with fresh randomness.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=10, derandomize=True, database=None, deadline=None,
                          suppress_health_check=_SLOW_OK, print_blob=True)
settings.register_profile("soak", max_examples=400, deadline=None, suppress_health_check=_SLOW_OK,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The longest test files, longest first. `make test` hands whole files to two workers as
# they free up (`--dist loadfile --no-loadscope-reorder`), in collection order: these
# first, then the rest in name order, so that the run ends on short files rather than one
# worker finishing a long file while the other idles (pytest-xdist's own order is by
# number of tests, which put long files with few tests last).
LONGEST_FIRST = (
    "test_experiments.py", "test_h200_compile_attention.py", "test_paged_attention_kernel.py",
    "test_serve_processes.py", "test_h200_compile_int4.py", "test_merge_pieces_kernel.py",
    "test_speculative_engine.py", "test_launches_per_moe_layer.py", "test_glm_serving.py",
    "test_checkpoint_streaming.py", "test_gpu_check.py", "test_hf_parity.py",
)


def pytest_configure(config):
  """With COMPILE_LOG_DIR set, logs every XLA compile of the run there (tests/compile_log.py)."""
  if os.environ.get("COMPILE_LOG_DIR"):
    import compile_log  # tests/ is on sys.path, as for this file
    config.pluginmanager.register(compile_log, "compile_log")


def pytest_collection_modifyitems(config, items):
  """Puts LONGEST_FIRST's files first; skips (and counts as skipped) tests marked `gpu`
  when no GPU backend is present."""
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
  # Here rather than at configure time: this hook runs where tests run (each worker), not
  # in pytest-xdist's controller, which never imports jax.
  import host_callbacks  # tests/ is on sys.path, as for this file
  host_callbacks.install()
  import jax
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU; this machine has none")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jax's compiled programs after each test module. A worker otherwise holds every
  program it has compiled for the whole run (thousands), and late in fresh-clone runs a
  worker died inside XLA's CPU compiler (a segfault, twice at different tests, and an abort
  in an executable's serialisation), always the same worker near its end; the modules
  share compiled programs within themselves, not across."""
  yield
  import jax
  jax.clear_caches()


@pytest.fixture(autouse=True, scope="module")
def _restore_log_levels():
  """Puts the root and absl loggers' levels back after each test module. Both are
  process-wide, and a worker runs many modules: a module that lowers them (mlkit.serve's
  main() sets absl's verbosity to WARNING for its process) would otherwise silence the INFO
  logs a later module asserts, and only in the runs whose file order puts the two in one
  worker."""
  import logging

  from absl import logging as absl_logging
  loggers = (logging.getLogger(), absl_logging.get_absl_logger())
  levels = [lg.level for lg in loggers]
  yield
  for lg, level in zip(loggers, levels):
    lg.setLevel(level)
