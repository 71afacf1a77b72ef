"""What the fp8 QK of the heads-in-M MLA kernel costs in accuracy, on random data.

The kernel (``pallas_kernels/paged_attention/mla_mgpu.py``, ``BlockSizes.mla_qk``)
runs QK as fp8 wgmmas with an e4m3 query (``ops.fp8_query``: per-row scale, 4
significant bits) instead of an f16 one (``ops.f16_query``: 11 bits). This script
measures, with the jnp reference given each rounded query (the interpret tests
hold the kernel to that reference within the bf16 tolerance), the relative-norm
error of the decode output against an exact f32 computation on the unquantised
cache, for:

- ``fp8 cache``: the fp8 cache (per-token scales, as mlkit's quantiser sets
  them) with the f16 query, i.e. the f16 QK kernel's arithmetic;
- ``+ e4m3 query``: the same with the e4m3 query, the fp8 QK kernel's;
- ``bf16 cache``: a bf16 cache with a bf16 query, for scale.

Sweeps the query's magnitude (sharper softmax: larger logits, larger absolute
logit errors) on two kinds of data: standard normal, and normal with 1% of the
channels 16 times larger in both query and cache (outlier channels, as
activations have). Random data, not a model's: the model-level effect needs the
accuracy experiment with a trained checkpoint.

    .venv/bin/python scripts/mla_qk_error.py [--heads 64 --context 2048 --batch 4]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.h200 import env as h200_env  # noqa: E402

h200_env.prepare(ptxas_report=False)  # the CPU where there is no GPU: no CUDA-plugin probe

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mlkit.kvcache.fp8 import quantize_fp8  # noqa: E402
from pallas_kernels.paged_attention import ops  # noqa: E402
from pallas_kernels.paged_attention import reference  # noqa: E402

QUERY_SCALES = (0.5, 1.0, 2.0, 4.0)
C, R, PAGE = 512, 64, 64  # Kimi K2.6's latent and rope widths, the kernel's page


def _rel_err(out, ref) -> float:
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _data(key, batch, heads, context, outliers):
  """(q_latent, q_rope [B, H, *] f32, latent, rope [N, PAGE, *] f32) with N = B * pages."""
  n = batch * context // PAGE
  kq, kr, kl, kp = jax.random.split(key, 4)
  ql = jax.random.normal(kq, (batch, heads, C))
  qr = jax.random.normal(kr, (batch, heads, R))
  lat = jax.random.normal(kl, (n, PAGE, C))
  rope = jax.random.normal(kp, (n, PAGE, R))
  if outliers:
    # The same 1% of latent channels large in query and cache (the logits' big terms).
    boost = jnp.ones((C,)).at[:: 100].set(16.0)
    ql, lat = ql * boost, lat * boost
  return ql, qr, lat, rope


@functools.partial(jax.jit, static_argnames=("heads", "outliers"))
def _outputs(key, query_scale, tables, lengths, *, heads: int, outliers: bool):
  """The decode outputs [B, H, C] on one data kind at one query scale, in one program: exact
  (f32, unquantised cache), bf16 (cache and query), and the fp8 cache with the f16 query and
  with the e4m3 query. tables [B, pages], lengths [B]."""
  batch, pages = tables.shape
  scale = 1.0 / math.sqrt(C + R)
  ql, qr, lat, rope = _data(key, batch, heads, pages * PAGE, outliers)
  ql, qr = ql * query_scale, qr * query_scale
  lat8, lat_s = quantize_fp8(lat)
  rope8, rope_s = quantize_fp8(rope)

  def attend(q_latent, q_rope, latent, k_rope, latent_scale=None, rope_scale=None):
    return reference.paged_mla_decode_reference(
        q_latent, q_rope, latent, k_rope, latent_scale, rope_scale, tables, lengths,
        scale=scale)

  def rounded(fn):
    *parts, q_scale = fn(ql, qr)
    return [p.astype(jnp.float32) * q_scale[..., None] for p in parts]

  exact = attend(ql, qr, lat, rope)
  bf16 = attend(ql.astype(jnp.bfloat16), qr.astype(jnp.bfloat16),
                lat.astype(jnp.bfloat16), rope.astype(jnp.bfloat16))
  f16q = attend(*rounded(ops.f16_query), lat8, rope8, lat_s, rope_s)
  e4m3q = attend(*rounded(ops.fp8_query), lat8, rope8, lat_s, rope_s)
  return exact, bf16, f16q, e4m3q


def measure(*, batch: int, heads: int, context: int, seed: int = 0) -> list[dict]:
  """One row per (data kind, query scale): the three errors described above."""
  pages = context // PAGE
  tables = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
  lengths = np.full((batch,), context, np.int32)
  rows = []
  for outliers in (False, True):
    for qs in QUERY_SCALES:
      exact, bf16, f16q, e4m3q = _outputs(jax.random.key(seed), np.float32(qs), tables,
                                          lengths, heads=heads, outliers=outliers)
      rows.append({"data": "1% outlier channels" if outliers else "normal",
                   "query_scale": qs, "bf16_cache": _rel_err(bf16, exact),
                   "fp8_cache": _rel_err(f16q, exact), "fp8_cache_e4m3_query": _rel_err(e4m3q, exact),
                   "e4m3_query_vs_fp8_cache": _rel_err(e4m3q, f16q)})
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--heads", type=int, default=64)
  p.add_argument("--context", type=int, default=2048, help="tokens per request, a multiple of 64")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  if a.context <= 0 or a.context % PAGE or a.batch <= 0 or a.heads <= 0:
    p.error(f"--context must be a positive multiple of {PAGE}; --batch and --heads positive")
  rows = measure(batch=a.batch, heads=a.heads, context=a.context, seed=a.seed)
  print(f"batch {a.batch}, {a.heads} heads, context {a.context}, C {C}, R {R}; relative-norm "
        "error of the output against exact f32 on the unquantised cache")
  print("| data | query x | bf16 cache | fp8 cache (f16 query) | fp8 cache, e4m3 query | "
        "e4m3 query vs f16 query |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['data']} | {r['query_scale']:g} | {r['bf16_cache']:.4f} | {r['fp8_cache']:.4f} | "
          f"{r['fp8_cache_e4m3_query']:.4f} | {r['e4m3_query_vs_fp8_cache']:.4f} |")


if __name__ == "__main__":
  main()
