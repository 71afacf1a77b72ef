"""One prepared device check: every kernel vs its reference, timed, as JSON.

On an H200:  python scripts/gpu_check.py --out results/gpu_check.json
On CPU:      python scripts/gpu_check.py --smoke --out /tmp/smoke.json
  (tiny shapes, kernels in interpret mode, 2 timed runs: proves the script
  works before device time is spent; its timings mean nothing.)

Each check is a named entry in CHECKS: a function (smoke: bool) -> list of
records. A record holds the case, correctness (relative-norm error vs the
reference, finiteness), timings (median of many runs after warm-up, with
jax.block_until_ready, on random non-zero inputs larger than L2 where the
real case is), achieved bandwidth = bytes the op must move / time, its
fraction of the H200's ~4.3 TB/s copy bandwidth, and ratios to the XLA
reference path and to the bf16-cache kernel (for INT4: to the XLA INT4
reference and the bf16 dot). Add a kernel by appending a Check to CHECKS.
"""

import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import paged_attention as pa  # noqa: E402
from pallas_kernels import tag_check as tc  # noqa: E402

H200_COPY_BW = 4.3e12  # bytes/s, measured device copy (DESIGN.md §5)
FP8 = jnp.float8_e4m3fn
TOL = {"bf16": 1e-2, "fp8": 5e-2}


@dataclasses.dataclass(frozen=True)
class Check:
  """A named group of kernel checks; run(smoke) returns JSON-able records."""
  name: str
  run: Callable[[bool], list[dict]]


def time_fn(fn, args, *, smoke):
  """Median seconds of fn(*args) over many runs after warm-up."""
  warmup, iters = (1, 2) if smoke else (5, 50)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def rel_err(out, ref):
  out = np.asarray(out, np.float32)
  ref = np.asarray(ref, np.float32)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def kernel_backend(smoke):
  return "interpret" if smoke else "pallas"


def _quant_pages(key, shape, kv):
  """Random pages [N, ps, ...] and per-token scales (fp8) or None."""
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, shape, jnp.float32)
  if kv == "bf16":
    return x.astype(jnp.bfloat16), None
  # amax / 448 per token (e4m3 never overflows to NaN), varied by [1, 2).
  s = jnp.max(jnp.abs(x), axis=-1) / 448.0 * jax.random.uniform(
      k2, shape[:-1], jnp.float32, 1.0, 2.0)
  return (x / s[..., None]).astype(FP8), s


def _tables(key, batch, max_pages, num_pages, page_size, context):
  bt = jax.random.permutation(key, num_pages)[: batch * max_pages]
  bt = bt.reshape(batch, max_pages).astype(jnp.int32)
  # Ragged: request b uses between half and all of the context.
  lengths = np.linspace(context // 2, context, batch).astype(np.int32)
  return bt, jnp.asarray(lengths)


def _attention_record(name, case, run_kernel, run_xla, bytes_required, smoke,
                      kv):
  out = run_kernel()
  ref = run_xla()
  err = rel_err(out, ref)
  finite = bool(jnp.all(jnp.isfinite(out)))
  t_kernel = time_fn(lambda: run_kernel(), (), smoke=smoke)
  t_xla = time_fn(lambda: run_xla(), (), smoke=smoke)
  bw = bytes_required / t_kernel
  return dict(
      check=name, case=case, ok=finite and err <= TOL[kv], rel_err=err,
      finite=finite, time_s=t_kernel, xla_time_s=t_xla,
      bytes_required=bytes_required, achieved_bw=bw,
      fraction_of_copy_bw=bw / H200_COPY_BW, speedup_vs_xla=t_xla / t_kernel)


def _add_bf16_ratios(records):
  """ratio_vs_bf16 = bf16 kernel time / fp8 kernel time, same case otherwise."""
  by_case = {json.dumps({k: v for k, v in r["case"].items() if k != "kv"},
                        sort_keys=True) + r["check"]: r for r in records
             if r.get("case", {}).get("kv") == "bf16"}
  for r in records:
    if r.get("case", {}).get("kv") == "fp8":
      key = json.dumps({k: v for k, v in r["case"].items() if k != "kv"},
                       sort_keys=True) + r["check"]
      if key in by_case and "time_s" in by_case[key]:
        r["speedup_vs_bf16"] = by_case[key]["time_s"] / r["time_s"]
  return records


def check_mla(smoke):
  """Paged MLA decode, fp8 and bf16 caches, 8K and 32K contexts."""
  if smoke:
    cases = [dict(batch=2, heads=16, c=128, r=64, page_size=64, context=100)]
  else:
    # batch * context * 576 B >= 150 MB in fp8: larger than L2 (60 MB).
    cases = [dict(batch=32, heads=64, c=512, r=64, page_size=64, context=8192),
             dict(batch=8, heads=128, c=512, r=64, page_size=64, context=32768),
             dict(batch=64, heads=16, c=512, r=64, page_size=64, context=8192)]
  records = []
  for shape, kv, impl in itertools.product(cases, ("bf16", "fp8"), ("mgpu", "triton")):
    if True:
      case = dict(shape, kv=kv, impl=impl)
      b, h, c, r, ps, ctx = (shape[k] for k in ("batch", "heads", "c", "r", "page_size", "context"))
      bs = pa.BlockSizes.get_default("mla", num_heads=h, page_size=ps,
                                     max_pages=-(-ctx // ps), batch=b)
      bs = dataclasses.replace(bs, impl=impl)
      case["num_splits"] = bs.num_splits
      max_pages = -(-ctx // ps)
      n = b * max_pages + 1
      keys = jax.random.split(jax.random.key(0), 5)
      q_lat = jax.random.normal(keys[0], (b, h, c), jnp.bfloat16)
      q_rope = jax.random.normal(keys[1], (b, h, r), jnp.bfloat16)
      lat, lat_s = _quant_pages(keys[2], (n, ps, c), kv)
      rope, rope_s = _quant_pages(keys[3], (n, ps, r), kv)
      bt, lengths = _tables(keys[4], b, max_pages, n, ps, ctx)
      args = (q_lat, q_rope, lat, rope, lat_s, rope_s, bt, lengths)
      scale = 1 / math.sqrt(192)
      run_kernel = lambda: pa.paged_mla_decode(*args, scale=scale, backend=kernel_backend(smoke),
                                               block_sizes=bs)
      run_xla = lambda: pa.paged_mla_decode(*args, scale=scale, backend="xla")  # jitted reference
      tokens = int(np.sum(np.asarray(lengths)))
      per_token = (c + r) * jnp.dtype(lat.dtype).itemsize + (8 if kv == "fp8" else 0)
      nbytes = tokens * per_token + 2 * b * h * (2 * c + r) + bt.size * 4
      try:
        records.append(_attention_record("paged_mla_decode", case, run_kernel, run_xla, nbytes, smoke, kv))
      except Exception as e:  # keep going: one failure must not hide the rest
        records.append(dict(check="paged_mla_decode", case=case, ok=False, error=repr(e)[:2000],
                            traceback=traceback.format_exc()[-4000:]))
  return _add_bf16_ratios(records)


def check_gqa(smoke):
  """Paged GQA decode, head_dim 128, group sizes 1 and 8."""
  if smoke:
    cases = [dict(batch=2, kv_heads=8, group=2, hd=64, page_size=16, context=40)]
  else:
    cases = [dict(batch=32, kv_heads=8, group=8, hd=128, page_size=16, context=8192),
             dict(batch=8, kv_heads=8, group=1, hd=128, page_size=16, context=32768)]
  records = []
  for shape, kv, impl in itertools.product(cases, ("bf16", "fp8"), ("mgpu", "triton")):
    if True:
      case = dict(shape, kv=kv, impl=impl)
      b, nkv, g, hd, ps, ctx = (shape[k] for k in ("batch", "kv_heads", "group", "hd", "page_size", "context"))
      bs = pa.BlockSizes.get_default("gqa", num_heads=g, page_size=ps,
                                     max_pages=-(-ctx // ps), batch=b * nkv)
      bs = dataclasses.replace(bs, impl=impl)
      case["num_splits"] = bs.num_splits
      max_pages = -(-ctx // ps)
      n = b * max_pages + 1
      keys = jax.random.split(jax.random.key(1), 4)
      q = jax.random.normal(keys[0], (b, nkv * g, hd), jnp.bfloat16)
      k, k_s = _quant_pages(keys[1], (n, ps, nkv, hd), kv)
      v, v_s = _quant_pages(keys[2], (n, ps, nkv, hd), kv)
      bt, lengths = _tables(keys[3], b, max_pages, n, ps, ctx)
      args = (q, k, v, k_s, v_s, bt, lengths)
      scale = 1 / math.sqrt(hd)
      run_kernel = lambda: pa.paged_gqa_decode(*args, scale=scale, backend=kernel_backend(smoke),
                                               block_sizes=bs)
      run_xla = lambda: pa.paged_gqa_decode(*args, scale=scale, backend="xla")  # jitted reference
      tokens = int(np.sum(np.asarray(lengths)))
      per_token = 2 * nkv * (hd * jnp.dtype(k.dtype).itemsize + (4 if kv == "fp8" else 0))
      nbytes = tokens * per_token + 2 * 2 * b * nkv * g * hd + bt.size * 4
      try:
        records.append(_attention_record("paged_gqa_decode", case, run_kernel, run_xla, nbytes, smoke, kv))
      except Exception as e:
        records.append(dict(check="paged_gqa_decode", case=case, ok=False, error=repr(e)[:2000],
                            traceback=traceback.format_exc()[-4000:]))
  return _add_bf16_ratios(records)


def check_tag(smoke):
  """Tag check over a whole batch; cost relative to an MLA decode step."""
  if smoke:
    b, p, n, ps = 7, 5, 40, 4
  else:
    b, p, n, ps = 64, 512, 64 * 512 + 1, 64  # 64 requests x 32K tokens
  keys = jax.random.split(jax.random.key(2), 3)
  tags = jax.random.randint(keys[0], (n,), 0, 2**31 - 1, jnp.int32)
  bt = jax.random.permutation(keys[1], n)[: b * p].reshape(b, p).astype(jnp.int32)
  expected = tags[bt].at[0, 0].add(1)  # request 0 corrupted, the rest fine
  lengths = jnp.asarray(np.linspace(1, p * ps, b).astype(np.int32))
  args = (tags, bt, expected, lengths)
  case = dict(batch=b, max_pages=p, page_size=ps)
  try:
    out = tc.tag_check(*args, page_size=ps, backend=kernel_backend(smoke))
    ref = tc.tag_check_reference(*args, page_size=ps)
    want = np.ones(b, bool)
    want[0] = False
    ok = bool(np.array_equal(np.asarray(out), np.asarray(ref))) and bool(
        np.array_equal(np.asarray(out), want))
    t = time_fn(lambda: tc.tag_check(*args, page_size=ps, backend=kernel_backend(smoke)), (), smoke=smoke)
    t_xla = time_fn(lambda: tc.tag_check(*args, page_size=ps, backend="xla"), (), smoke=smoke)
    used = int(np.sum((np.asarray(lengths) + ps - 1) // ps))
    nbytes = used * 12 + b * 4  # id + expected + tag per used page
    return [dict(check="tag_check", case=case, ok=ok, time_s=t, xla_time_s=t_xla,
                 bytes_required=nbytes, speedup_vs_xla=t_xla / t)]
  except Exception as e:
    return [dict(check="tag_check", case=case, ok=False, error=repr(e)[:2000],
                 traceback=traceback.format_exc()[-4000:])]


def check_int4(smoke):
  """W4A16 dense and grouped matmuls at Kimi shapes (pallas_kernels/int4_matmul/bench.py).

  The full run uses decode-sized M (1, 8, 16) and the grouped decode shapes with
  group size 32 (Kimi's checkpoints) to fit one device command; smoke runs one
  tiny dense and one tiny grouped case in interpret mode.
  """
  from pallas_kernels.int4_matmul import bench
  if smoke:
    checks = bench.gpu_checks(32, backend="interpret", dense_shapes=(("tiny", 256, 128),),
                              dense_ms=(8,), grouped_shapes=(("tiny", 4, 256, 128, 16),))
  else:
    checks = [c for c in bench.gpu_checks(32)
              if "grouped" in c.name or any(f"/m{m}/" in c.name for m in (1, 8, 16))]
  records = []
  for c in checks:
    try:
      r = c()
      records.append(dict(check="int4_matmul", case=c.name, ok=bool(r.get("correct")), **{
          k: v for k, v in r.items() if k not in ("correct",)}))
    except Exception as e:
      records.append(dict(check="int4_matmul", case=c.name, ok=False, error=repr(e)[:2000],
                          traceback=traceback.format_exc()[-4000:]))
  return records


CHECKS = [
    Check("paged_mla_decode", check_mla),
    Check("paged_gqa_decode", check_gqa),
    Check("tag_check", check_tag),
    Check("int4_matmul", check_int4),
]


def _tag_vs_step(records):
  """Tag-check time as a fraction of a 61-layer fp8 MLA attention step.

  The attention of all layers is a lower bound of a decode step, so this
  fraction is an upper bound of the tag check's share (target < 1%).
  """
  tag = [r for r in records if r["check"] == "tag_check" and "time_s" in r]
  mla = [r for r in records if r["check"] == "paged_mla_decode" and
         r.get("case", {}).get("kv") == "fp8" and "time_s" in r]
  if tag and mla:
    step = 61 * mla[0]["time_s"]
    tag[0]["fraction_of_61_layer_attention"] = tag[0]["time_s"] / step


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="JSON output path")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny shapes, interpret mode: checks the script on CPU")
  parser.add_argument("--only", default="", help="comma-separated check names")
  args = parser.parse_args(argv)
  only = set(filter(None, args.only.split(",")))
  records = []
  for check in CHECKS:
    if only and check.name not in only:
      continue
    t0 = time.perf_counter()
    recs = check.run(args.smoke)
    for r in recs:
      r["check_wall_s"] = time.perf_counter() - t0
    records.extend(recs)
    print(f"{check.name}: {sum(r['ok'] for r in recs)}/{len(recs)} ok", flush=True)
  _tag_vs_step(records)
  dev = jax.devices()[0]
  result = dict(
      machine=dict(platform=platform.platform(), device_kind=dev.device_kind,
                   backend=jax.default_backend(), num_devices=jax.device_count()),
      versions=dict(jax=jax.__version__, jaxlib=jax.lib.__version__ if hasattr(jax, "lib") else None,
                    numpy=np.__version__, python=platform.python_version()),
      smoke=args.smoke, copy_bw_ref=H200_COPY_BW, records=records)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1, default=str)
  bad = [r for r in records if not r["ok"]]
  for r in bad:
    print("FAILED", r["check"], r["case"], r.get("error", r.get("rel_err")), flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
