"""Streaming Hugging Face import: quantised and sharded leaf by leaf, host memory bounded.

The checkpoints are written here from random params (nothing is downloaded).
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
from absl.testing import absltest

from configs import TINY_MLA
from mlkit.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from mlkit.parallel import MeshConfig, make_mesh, shard_params
from mlkit.quant import FP8_ALL, INT4_EXPERTS, INT4_EXPERTS_GPTQ, quantize_params
from numpy_params import init_params_np
from two_processes import two_processes
from tempdirs import temp_dir

_F32 = dict(dtype="float32", param_dtype="float32")

# In a fresh process: loads checkpoint A (compiles the quantisers, warms the allocators),
# drops it, then loads checkpoint B `repeats` times and reports, for each, the resident
# set when the load starts (the peak is reset there), the peak while loading, and the
# bytes B's params hold on their devices (host memory too, on a CPU).
_MEASURE = r"""
import gc, json, sys
import jax
from mlkit.checkpoint import load_hf_checkpoint
from mlkit.parallel import MeshConfig, make_mesh
from mlkit.quant import INT4_EXPERTS

def status(key):
  for line in open("/proc/self/status"):
    if line.startswith(key):
      return int(line.split()[1]) * 1024

mesh = make_mesh(MeshConfig(expert=2), jax.devices()[:2])

def load(path):
  if sys.argv[3] == "stream":
    return load_hf_checkpoint(path, recipe=INT4_EXPERTS, mesh=mesh)[0]
  # The whole dense tree in memory first, then quantised, then placed.
  from mlkit.parallel import shard_params
  from mlkit.quant import quantize_params
  params, cfg = load_hf_checkpoint(path)
  return shard_params(quantize_params(params, INT4_EXPERTS), mesh, cfg=cfg)

warm = load(sys.argv[1])
jax.block_until_ready(warm)
del warm
runs = []
for _ in range(int(sys.argv[4])):
  gc.collect()
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak (VmHWM) starts again from the current resident set
  base = status("VmRSS")
  params = load(sys.argv[2])
  jax.block_until_ready(params)
  held = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(params)
             for s in x.addressable_shards)
  runs.append({"base": base, "peak": status("VmHWM"), "held": held})
  del params
print(json.dumps(runs))
"""


def _measure(warm: str, path: str, mode: str, repeats: int) -> list[dict]:
  # glibc gives every thread that allocates its own arena and keeps what is freed there;
  # XLA's CPU thread pool then scatters a few hundred MB of freed buffers over them at
  # random, which drowns the loader's own working set. One arena makes it measurable.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu", MALLOC_ARENA_MAX="1")
  out = subprocess.run([sys.executable, "-c", _MEASURE, warm, path, mode, str(repeats)],
                       capture_output=True, text=True, env=env, timeout=600, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


class StreamingLoadTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.cfg = dataclasses.replace(TINY_MLA, **_F32)
    cls.dir = temp_dir(cls, "hf_stream_")
    save_hf_checkpoint(cls.dir, init_params_np(cls.cfg), cls.cfg, shards=2)
    cls.dense, _ = load_hf_checkpoint(cls.dir)

  def test_quantised_and_sharded_as_read_equals_load_then_quantise_then_shard(self):
    mesh = make_mesh(MeshConfig(tensor=2, expert=2), jax.devices()[:4])
    for recipe in (None, INT4_EXPERTS, FP8_ALL):
      got, cfg = load_hf_checkpoint(self.dir, recipe=recipe, mesh=mesh)
      want = quantize_params(self.dense, recipe) if recipe is not None else self.dense
      want = shard_params(want, mesh, cfg=cfg)
      self.assertEqual(jax.tree_util.tree_structure(got), jax.tree_util.tree_structure(want))
      for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        self.assertEqual(a.sharding, b.sharding)

  def test_quantised_without_a_mesh(self):
    got, _ = load_hf_checkpoint(self.dir, recipe=INT4_EXPERTS)
    want = quantize_params(self.dense, INT4_EXPERTS)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_into_the_kernels_int4_layout(self):
    mesh = make_mesh(MeshConfig(tensor=2, expert=2), jax.devices()[:4])
    got, cfg = load_hf_checkpoint(self.dir, recipe=INT4_EXPERTS, mesh=mesh, int4_layout="nk")
    want = shard_params(quantize_params(self.dense, INT4_EXPERTS, int4_layout="nk"), mesh,
                        cfg=cfg)
    self.assertEqual(jax.tree_util.tree_structure(got), jax.tree_util.tree_structure(want))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      self.assertEqual(a.sharding, b.sharding)

  def test_bad_requests_fail_before_reading(self):
    with self.assertRaisesRegex(ValueError, "int4_layout must be one of"):
      load_hf_checkpoint(self.dir, recipe=INT4_EXPERTS, int4_layout="NK")
    with self.assertRaisesRegex(ValueError, "GPTQ .* calibration"):
      load_hf_checkpoint(self.dir, recipe=INT4_EXPERTS_GPTQ)
    with self.assertRaisesRegex(ValueError, "rules= needs a mesh="):
      from mlkit.parallel import DEFAULT_RULES
      load_hf_checkpoint(self.dir, rules=DEFAULT_RULES)

  def test_progress_is_logged_with_bytes_and_rate(self):
    with self.assertLogs("mlkit.checkpoint.hf", level="INFO") as logs:
      load_hf_checkpoint(self.dir)
    self.assertTrue(any("GB read in" in m and "MB/s" in m for m in logs.output), logs.output)

  def test_host_memory_stays_within_a_few_of_the_largest_parameters(self):
    # The largest parameter is an expert stack of 16 x 256 x 1024 f32: 16 MiB. Checkpoint
    # B (9 MoE layers) is more than 4x a bound of 6 of them. Streaming, loading B may hold
    # at most that bound beyond what its loaded (INT4) params occupy: the tensors read,
    # their stack, the quantiser's input and temporaries. Loading densely first holds
    # most of the dense checkpoint on top.
    big = dataclasses.replace(TINY_MLA, name="stream", d_model=256, moe_ffn_dim=1024,
                              n_routed_experts=16, **_F32)
    largest = 16 * 256 * 1024 * 4
    bound = 6 * largest
    paths = {}
    for n_layers in (3, 10):  # A warms up; B is measured
      cfg = dataclasses.replace(big, n_layers=n_layers)
      paths[n_layers] = temp_dir(self, f"hf_stream_{n_layers}_")
      save_hf_checkpoint(paths[n_layers], init_params_np(cfg), cfg, shards=2)
    size = sum(os.path.getsize(os.path.join(paths[10], f)) for f in os.listdir(paths[10]))
    self.assertGreaterEqual(size, 4 * bound)
    # The allocators add random spikes on top of the loader's working set (freed XLA
    # buffers left in glibc's pools), never take from it: the least of three loads is the
    # working set. A loader that held the checkpoint would exceed the bound every time.
    runs = {"stream": _measure(paths[3], paths[10], "stream", 3),
            "dense": _measure(paths[3], paths[10], "dense", 1)}

    def transient(r):  # peak memory beyond the start and what the loaded params hold
      return r["peak"] - r["base"] - r["held"]

    self.assertLessEqual(min(map(transient, runs["stream"])), bound, runs)
    self.assertGreater(transient(runs["dense"][0]), size // 2, runs)


class MultiProcessReadTest(absltest.TestCase):
  """Two processes on this machine load one checkpoint onto a global mesh (docs/checkpoints.md)."""

  TIMEOUT_S = 120

  def test_each_process_reads_only_what_its_devices_hold(self):
    import checkpoint_multihost_worker as worker_mod
    from mlkit.quant import RECIPES
    # Expert FFN width 256: w_down's K splits into 4 tensor shards of 2 int4 groups each.
    cfg = dataclasses.replace(TINY_MLA, n_layers=2, moe_ffn_dim=256, **_F32)
    src = temp_dir(self, "hf_multi_")
    save_hf_checkpoint(src, init_params_np(cfg, seed=3), cfg, shards=2)
    with two_processes(self, worker_mod.__file__, ["--src", src], self.TIMEOUT_S) as out:
      reports = []
      for i in range(2):
        with open(os.path.join(out, f"report_{i}.json")) as f:
          reports.append(json.load(f))
      values = dict(np.load(os.path.join(out, "values.npz")))
    for kind in ("tensor4", "expert2"):
      want = [np.asarray(x).view(np.uint8) for x in jax.tree_util.tree_leaves(
          load_hf_checkpoint(src, recipe=RECIPES[reports[0][kind]["recipe"]])[0])]
      for j, w in enumerate(want):  # the assembled arrays are the single-process load's
        np.testing.assert_array_equal(values[f"{kind}_{j}"], w, err_msg=f"{kind} leaf {j}")
      partial = reports[0][kind]["partial"]
      self.assertEqual(partial, reports[1][kind]["partial"])
      nbytes = reports[0][kind]["nbytes"]
      whole = sum(nbytes.values())
      split = sum(nbytes[n] for n in partial)
      self.assertGreater(split, whole / 2, (kind, partial))  # most of the checkpoint is split
      self.assertTrue(any(n.endswith("ffn.w_down") for n in partial), (kind, partial))
      for r in reports:
        got = r[kind]["bytes_read"]
        for name, n in nbytes.items():
          if name in partial:  # its half, not a byte more (shards fall on group edges here)
            self.assertEqual(got[name], n // 2, (kind, name))
          else:  # every device of this process holds all of it
            self.assertEqual(got[name], n, (kind, name))
        self.assertLess(sum(got.values()), whole - split / 2 + 1)


if __name__ == "__main__":
  absltest.main()
