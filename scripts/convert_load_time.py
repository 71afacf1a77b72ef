"""Load time of a converted checkpoint against quantising a Hugging Face one on load.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 .venv/bin/python scripts/convert_load_time.py

Writes a generated bf16 HF checkpoint (TINY_MLA widened to 16 layers of 16
experts of 512x1024, about 806 MB) into a temporary directory, converts it with
``convert_hf_checkpoint`` (recipe int4-experts-g32), then times
``load_hf_checkpoint(src, recipe=INT4_EXPERTS)`` against
``load_checkpoint(converted)`` three times each, without a mesh and on a
tensor=2 x expert=2 mesh, both sources in the page cache. docs/checkpoints.md
quotes its output.
"""

import dataclasses
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a host-side measurement; no GPU plugin probing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import jax  # noqa: E402

from configs import TINY_MLA  # noqa: E402
from mlkit.checkpoint import load_checkpoint, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from mlkit.checkpoint.convert import convert_hf_checkpoint  # noqa: E402
from mlkit.parallel import MeshConfig, make_mesh  # noqa: E402
from mlkit.quant import INT4_EXPERTS  # noqa: E402
from numpy_params import init_params_np  # noqa: E402


def _size(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _timed(load) -> float:
  t = time.perf_counter()
  jax.block_until_ready(load()[0])
  return time.perf_counter() - t


def main() -> int:
  if len(jax.devices()) < 4:
    raise SystemExit("needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4")
  cfg = dataclasses.replace(TINY_MLA, name="bench", d_model=512, moe_ffn_dim=1024,
                            n_routed_experts=16, n_layers=16, dtype="bfloat16",
                            param_dtype="bfloat16")
  with tempfile.TemporaryDirectory() as root:
    src, dst = os.path.join(root, "hf"), os.path.join(root, "orbax")
    save_hf_checkpoint(src, init_params_np(cfg), cfg, shards=4)
    print(f"source: {_size(src) / 1e6:.0f} MB bf16, {cfg.n_layers} layers, "
          f"{cfg.n_routed_experts} experts")
    t = time.perf_counter()
    convert_hf_checkpoint(src, dst, recipe=INT4_EXPERTS.name, progress=lambda s: None)
    print(f"convert: {time.perf_counter() - t:.2f} s; orbax checkpoint {_size(dst) / 1e6:.0f} MB")
    mesh = make_mesh(MeshConfig(tensor=2, expert=2), jax.devices()[:4])
    for label, hf, ob in (
        ("no mesh", lambda: load_hf_checkpoint(src, recipe=INT4_EXPERTS),
         lambda: load_checkpoint(dst)),
        ("mesh tensor=2,expert=2", lambda: load_hf_checkpoint(src, recipe=INT4_EXPERTS, mesh=mesh),
         lambda: load_checkpoint(dst, mesh=mesh))):
      runs = [(_timed(hf), _timed(ob)) for _ in range(3)]
      print(f"{label}: load_hf_checkpoint(recipe=) " + " / ".join(f"{a:.2f}" for a, _ in runs)
            + " s | load_checkpoint(converted) " + " / ".join(f"{b:.2f}" for _, b in runs) + " s")
    print(f"load_checkpoint(converted, verify=False): "
          f"{_timed(lambda: load_checkpoint(dst, verify=False)):.2f} s")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
