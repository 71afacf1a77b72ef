"""Benchmark case for paged indexer scoring: the kernel against XLA's path.

``bench_case(dims, ...)`` builds a :class:`pallas_kernels.benchmark.Bench` for one
shape of ``paged_index_scores`` (dims as in the target cases: batch, index_heads,
index_dim, page_size, context, max_pages, num_pages, kv dtype). Every request uses
its whole context (so no score is -inf and the relative-norm check sees every
position); block tables are a random permutation of the pool, so pages are
scattered as in a long-running server. Head weights are random of both signs,
scaled by Hi^-1/2 as the model folds it in.

The job reads every cached index key of every request once: it is memory-bound
(2 * Hi * Di FLOPs per key of Di * itemsize bytes: 32 FLOP/B in bf16 and about 62
in fp8 at GLM 5's 32 heads of 128, against the H200's ~184 FLOP/B ridge).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import benchmark as bm
from pallas_kernels.indexer.ops import IndexerBlockSizes
from pallas_kernels.indexer.ops import paged_index_scores
from pallas_kernels.paged_attention.bench import random_pages



def job_cost(dims: dict) -> tuple[int, int]:
  """(bytes, FLOPs) one scoring call must at least move and do.

  Bytes: every cached token's index key read once (Di entries, plus a 4-byte f32 scale
  in fp8), the block tables, the queries (bf16) and head weights (f32) in, and one f32
  score per token out. FLOPs: the [Hi, Di] x [Di, tokens] dot of each request (the
  ReLU and the head reduction are left out: 2 * Hi per token against 2 * Hi * Di).
  Pure arithmetic on ``dims``, so the roofline sheet needs no device.
  """
  b, hi, di, ctx, p, kv = (dims[x] for x in ("batch", "index_heads", "index_dim", "context",
                                             "max_pages", "kv"))
  item = 1 if kv == "fp8" else 2
  tokens = b * ctx
  return (tokens * (di * item + (4 if kv == "fp8" else 0)) + b * p * 4 + b * hi * di * 2
          + b * hi * 4 + tokens * 4, 2 * tokens * hi * di)


def bench_case(dims: dict, *, backend: str = "pallas", seed: int = 0) -> bm.Bench:
  """The Bench of one indexer-scoring case.

  Args:
    dims: the case's dims (pallas_kernels.targets), or smaller ones of the same kind.
    backend: "pallas" on a GPU, "interpret" on a CPU.
    seed: base seed of the random inputs.

  Returns:
    A Bench with impls "pallas" (the kernel, default block sizes) and "xla" (the jnp
    reference compiled by XLA), each checked against the f32 reference.
  """
  b, hi, di, ps, ctx, kv = (dims[x] for x in ("batch", "index_heads", "index_dim",
                                              "page_size", "context", "kv"))
  p, n = dims["max_pages"], dims["num_pages"]
  item = 1 if kv == "fp8" else 2
  set_bytes = n * ps * (di * item + (4 if kv == "fp8" else 0)) + b * hi * (di * 2 + 4)

  def make(i):
    ks = jax.random.split(jax.random.key(seed * 1000 + i), 4)
    keys, scales = random_pages(ks[2], shape=(n, ps, di), kv=kv)
    bt = jax.random.permutation(ks[3], n)[: b * p].reshape(b, p).astype(jnp.int32)
    return (jax.random.normal(ks[0], (b, hi, di), jnp.bfloat16),
            jax.random.normal(ks[1], (b, hi), jnp.float32) * hi ** -0.5, keys, scales, bt,
            jnp.full((b,), ctx, jnp.int32))

  sets = bm.once(lambda: [make(i) for i in range(bm.rotation_sets(set_bytes))])
  # The reference computes in f32 already; the query in f32 changes nothing but its input.
  ref = bm.once(lambda: paged_index_scores(sets()[0][0].astype(jnp.float32), *sets()[0][1:],
                                           backend="xla"))
  impls = [bm.Impl("pallas", functools.partial(paged_index_scores, backend=backend), sets, ref,
                   note="Triton kernel: gathers key rows through the block table"),
           bm.Impl("xla", functools.partial(paged_index_scores, backend="xla"), sets, ref,
                   note="jnp reference: gather the pages, then score (f32)")]
  return bm.Bench(*job_cost(dims), bm.TOL[kv], impls,
                  {"kernel_impl": "triton", "block_sizes": dataclasses.asdict(IndexerBlockSizes()),
                   "input_sets": bm.rotation_sets(set_bytes)})
