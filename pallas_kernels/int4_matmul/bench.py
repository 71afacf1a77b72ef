"""GPU checks for the INT4 matmuls: correctness, timing and bandwidth on H200.

`gpu_checks()` returns named callables; a GPU script (the kernels experiment)
calls each and records the dict it returns. Nothing here runs at import and
nothing allocates until a check is called. Shapes are Kimi K2.6's: routed
expert up/gate (K=7168 -> N=2048) and down (2048 -> 7168), and the MLA
attention projections.

Each dense check reports, against DESIGN.md §5's H200 ceilings:
  * rel_err of the Pallas kernel vs the jnp reference (bf16 tolerance 1e-2);
  * median time of the Pallas kernel, the XLA INT4 reference and a bf16 XLA
    dot on the same shape;
  * achieved bandwidth = (int4 weights + scales + activations + output bytes)
    / time, and its fraction of the 4.3 TB/s measured copy bandwidth;
  * speedups vs the bf16 dot and vs the XLA INT4 path, and whether the issue's
    decode target (M <= 16: >= 3x the bf16 dot and >= 75% of copy bandwidth)
    is met. Grouped checks compare against a bf16 `jax.lax.ragged_dot`
    (target >= 2.5x at decode batch sizes).
"""

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.int4_matmul import reference
from pallas_kernels.int4_matmul.block_sizes import H200_SMEM_BYTES
from pallas_kernels.int4_matmul.block_sizes import BlockSizes
from pallas_kernels.int4_matmul.int4_matmul import int4_grouped_matmul
from pallas_kernels.int4_matmul.int4_matmul import int4_matmul

H200_COPY_BW = 4.3e12  # bytes/s, measured copy (DESIGN.md §5)
H200_BF16_FLOPS = 790e12  # FLOP/s, measured bf16 matmul
L2_BYTES = 60 * 2**20
DECODE_TARGET_M = 16

# (name, K, N): Kimi K2.6 matrices, x [M, K] @ W [K, N].
DENSE_SHAPES = (
    ("expert_up", 7168, 2048),
    ("expert_down", 2048, 7168),
    ("q_a_proj", 7168, 1536),
    ("q_b_proj", 1536, 64 * 192),
    ("kv_a_proj", 7168, 512 + 64),
    ("o_proj", 64 * 128, 7168),
)
DENSE_MS = (1, 8, 16, 64, 256)
# (name, E, K, N, M): 384 routed experts; decode batches of 8/64 sequences
# with top-8 routing give 64/512 rows.
GROUPED_SHAPES = (
    ("experts_up_bs8", 384, 7168, 2048, 64),
    ("experts_down_bs8", 384, 2048, 7168, 64),
    ("experts_up_bs64", 384, 7168, 2048, 512),
)


@dataclasses.dataclass(frozen=True)
class GpuCheck:
  """A named check; calling it runs on the default (GPU) device, returns a dict."""

  name: str
  fn: Callable[[], dict[str, Any]]

  def __call__(self) -> dict[str, Any]:
    return {"name": self.name, **self.fn()}


def _median_seconds(fn, arg_sets, *, warmup=3, iters=30):
  """Median wall time of fn(*args), rotating arg_sets to defeat L2 reuse."""
  for i in range(warmup):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  times = []
  for i in range(iters):
    args = arg_sets[i % len(arg_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _copies(nbytes):
  """How many input copies to rotate so the working set exceeds 2x L2."""
  return int(min(16, max(1, -(-2 * L2_BYTES // max(nbytes, 1)))))


def _make_dense(seed, m, k, n, group_size):
  kx, kq, ks = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  q = jax.random.randint(kq, (k, n), -8, 8, jnp.int8)
  s = jax.random.uniform(ks, (k // group_size, n), jnp.float32, 0.25, 2.0)
  return x, reference.pack_int4(q), (s / 16).astype(jnp.bfloat16)


def _dense_check(k, n, m, group_size, backend):
  def run():
    x, p, s = _make_dense(0, m, k, n, group_size)
    out = int4_matmul(x, p, s, group_size=group_size, backend=backend)
    ref = reference.int4_matmul_reference(x, p, s, group_size=group_size)
    rel_err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) /
                    jnp.linalg.norm(ref.astype(jnp.float32)))
    finite = bool(jnp.all(jnp.isfinite(out)))
    nbytes = p.nbytes + s.nbytes + x.nbytes + m * n * 2
    sets = [_make_dense(i + 1, m, k, n, group_size) for i in range(_copies(nbytes))]
    w_bf16 = [(x_, reference.dequantize_int4(p_, s_, group_size, jnp.bfloat16))
              for x_, p_, s_ in sets]
    pallas = jax.jit(lambda x_, p_, s_: int4_matmul(
        x_, p_, s_, group_size=group_size, backend=backend))
    xla = jax.jit(lambda x_, p_, s_: int4_matmul(
        x_, p_, s_, group_size=group_size, backend="xla"))
    dot = jax.jit(lambda x_, w_: jnp.dot(x_, w_,
                                         preferred_element_type=jnp.float32
                                         ).astype(jnp.bfloat16))
    t_pallas = _median_seconds(pallas, sets)
    t_xla = _median_seconds(xla, sets)
    t_bf16 = _median_seconds(dot, w_bf16)
    bw = nbytes / t_pallas
    floor = max(nbytes / H200_COPY_BW, 2 * m * k * n / H200_BF16_FLOPS)
    res = dict(
        m=m, k=k, n=n, group_size=group_size, rel_err=rel_err,
        finite=finite, correct=finite and rel_err <= 1e-2,
        time_us=t_pallas * 1e6, xla_int4_us=t_xla * 1e6, bf16_dot_us=t_bf16 * 1e6,
        bytes=nbytes, achieved_bw_gbs=bw / 1e9,
        copy_bw_fraction=bw / H200_COPY_BW, roofline_fraction=floor / t_pallas,
        speedup_vs_bf16_dot=t_bf16 / t_pallas,
        speedup_vs_xla_int4=t_xla / t_pallas)
    if m <= DECODE_TARGET_M:
      res["decode_target_met"] = bool(
          res["speedup_vs_bf16_dot"] >= 3.0 and res["copy_bw_fraction"] >= 0.75)
    return res
  return run


def _decode_group_sizes(e, m, seed):
  # Top-8 routing of m/8 tokens: a few hot experts, many empty ones.
  rng = np.random.default_rng(seed)
  counts = np.bincount(rng.choice(e, size=m, p=rng.dirichlet(np.ones(e) * 0.3)),
                       minlength=e)
  return jnp.asarray(counts, jnp.int32)


def _grouped_check(e, k, n, m, group_size, backend):
  def run():
    kx, kq, ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    q = jax.random.randint(kq, (e, k, n), -8, 8, jnp.int8)
    p = reference.pack_int4(q)
    s = (jax.random.uniform(ks, (e, k // group_size, n), jnp.float32, 0.25, 2.0)
         / 16).astype(jnp.bfloat16)
    del q
    gs = _decode_group_sizes(e, m, 0)
    out = int4_grouped_matmul(x, p, s, gs, group_size=group_size,
                              backend=backend)
    ref = reference.int4_grouped_matmul_reference(x, p, s, gs,
                                                  group_size=group_size)
    rel_err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) /
                    jnp.linalg.norm(ref.astype(jnp.float32)))
    finite = bool(jnp.all(jnp.isfinite(out)))
    active = int(jnp.sum(gs > 0))
    # Only active experts' weights must be read.
    nbytes = active * (p.nbytes + s.nbytes) // e + x.nbytes + m * n * 2
    w_bf16 = reference.dequantize_int4(p, s, group_size, jnp.bfloat16)
    pallas = jax.jit(lambda *a: int4_grouped_matmul(
        *a, group_size=group_size, backend=backend))
    xla = jax.jit(lambda *a: int4_grouped_matmul(
        *a, group_size=group_size, backend="xla"))
    rdot = jax.jit(lambda x_, w_, g_: jax.lax.ragged_dot(
        x_, w_, g_, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    # All experts together exceed L2, so no rotation is needed here.
    t_pallas = _median_seconds(pallas, [(x, p, s, gs)])
    t_xla = _median_seconds(xla, [(x, p, s, gs)])
    t_bf16 = _median_seconds(rdot, [(x, w_bf16, gs)])
    bw = nbytes / t_pallas
    return dict(
        e=e, m=m, k=k, n=n, group_size=group_size, active_experts=active,
        rel_err=rel_err, finite=finite, correct=finite and rel_err <= 1e-2,
        time_us=t_pallas * 1e6, xla_int4_us=t_xla * 1e6,
        bf16_ragged_dot_us=t_bf16 * 1e6, bytes=nbytes,
        achieved_bw_gbs=bw / 1e9, copy_bw_fraction=bw / H200_COPY_BW,
        speedup_vs_bf16_ragged_dot=t_bf16 / t_pallas,
        speedup_vs_xla_int4=t_xla / t_pallas,
        decode_target_met=bool(t_bf16 / t_pallas >= 2.5))
  return run


def gpu_checks(group_size: int = 128, *, backend: str = "pallas",
               dense_shapes=DENSE_SHAPES, dense_ms=DENSE_MS,
               grouped_shapes=GROUPED_SHAPES) -> list[GpuCheck]:
  """Named checks of both kernels at Kimi K2.6 shapes; call each on a GPU.

  Args:
    group_size: quantisation group along K (32, 64 or 128).
    backend: kernel backend under test; "interpret" with tiny shapes smoke-tests
      this module on CPU (timings then mean nothing).
    dense_shapes: (name, K, N) tuples.
    dense_ms: token counts for the dense shapes.
    grouped_shapes: (name, E, K, N, M) tuples.

  Returns:
    A list of GpuCheck; calling one returns a dict with the shape, rel_err,
    correct, median times (us) of the kernel / XLA INT4 / bf16 XLA baselines,
    achieved bandwidth, fractions of the H200 ceilings, speedups and whether
    the issue's target is met.
  """
  checks = []
  for name, k, n in dense_shapes:
    for m in dense_ms:
      checks.append(GpuCheck(f"int4_matmul/{name}/m{m}/g{group_size}",
                             _dense_check(k, n, m, group_size, backend)))
  for name, e, k, n, m in grouped_shapes:
    checks.append(GpuCheck(f"int4_grouped_matmul/{name}/g{group_size}",
                           _grouped_check(e, k, n, m, group_size, backend)))
  return checks


def _sweep_candidates(m, k, n, grouped):
  """Block sizes worth timing for one shape: decode rows favour many small CTAs."""
  # Kept to a few dozen per shape: each candidate compiles on the device.
  tile_ms = sorted({min(t, -(-m // 8) * 8) for t in (16, 64, 128)})
  splits = (1,) if grouped or m > 64 else (1, 4, 8, 14)
  out = []
  for tile_n in (64, 128):
    for tile_m in tile_ms:
      for tile_k in (128, 256):
        for k_splits in splits:
          for steps in (2, 4):
            try:
              bs = BlockSizes(tile_n, tile_m, tile_k, k_splits, steps)
            except ValueError:
              continue
            if n % tile_n or k % tile_k or (k // tile_k) % k_splits:
              continue
            if bs.smem_bytes(group_size=32, grouped=grouped) > H200_SMEM_BYTES:
              continue
            out.append(bs)
  return out


def tuning_checks(group_size: int = 128, *, ms=(1, 16, 64, 256),
                  dense_shapes=DENSE_SHAPES[:2],
                  backend: str = "pallas") -> list[GpuCheck]:
  """One check per (shape, M) that times every candidate BlockSizes on the GPU.

  Each check returns the candidates' median times and the fastest, from which
  the H200 rows of block_sizes.TUNED are filled in.
  """
  def sweep(k, n, m):
    def run():
      x, p, s = _make_dense(0, m, k, n, group_size)
      sets = [_make_dense(i + 1, m, k, n, group_size)
              for i in range(_copies(p.nbytes + s.nbytes + x.nbytes))]
      results = []
      for bs in _sweep_candidates(m, k, n, grouped=False):
        f = jax.jit(lambda x_, p_, s_, bs=bs: int4_matmul(
            x_, p_, s_, group_size=group_size, backend=backend,
            block_sizes=bs))
        try:
          t = _median_seconds(f, sets, warmup=2, iters=10)
        except Exception as e:  # pylint: disable=broad-except
          # A candidate may still overflow registers or SMEM at compile time.
          results.append(dict(block_sizes=dataclasses.asdict(bs),
                              error=str(e).splitlines()[0][:200]))
          continue
        results.append(dict(block_sizes=dataclasses.asdict(bs), time_us=t * 1e6))
      timed = [r for r in results if "time_us" in r]
      best = min(timed, key=lambda r: r["time_us"]) if timed else None
      return dict(m=m, k=k, n=n, group_size=group_size, candidates=results,
                  best=best)
    return run

  return [GpuCheck(f"int4_matmul_tuning/{name}/m{m}/g{group_size}",
                   sweep(k, n, m))
          for name, k, n in dense_shapes for m in ms]
