"""Benchmark cases for paged decode attention: the kernels, XLA's path and JAX's own kernels.

``bench_case(kernel, dims, ...)`` builds a :class:`pallas_kernels.benchmark.Bench`
for one shape of ``paged_mla_decode``, ``paged_gqa_decode`` or
``paged_mla_sparse_decode`` (dims as in the target cases: batch, heads / kv_heads
+ group, page_size, context, kv dtype, and for the sparse kernel topk). Every
request uses its whole context; block tables are a random permutation of the
pool, so pages are scattered as in a long-running server. The sparse kernel's
requests each select ``topk`` distinct positions drawn uniformly from their
context (ascending, as the indexer's top-k hands them over): scattered rows, the
gather's hardest case.

Impls, in order:
  * ``pallas``: the op with its default block sizes (the kernel it picks,
    Mosaic GPU or Triton, is in ``info``);
  * ``xla``: the pure-jnp reference compiled by XLA (gathers the pages, f32);
  * with ``peers``: the other of our two kernels (``pallas_mgpu`` /
    ``pallas_triton``) where the shape takes both; for MLA on Mosaic GPU also
    the other of its two kernels (``pallas_mgpu_heads`` beside the tokens-in-M
    kernel the op picks for at most 32 heads, ``pallas_mgpu_tokens`` beside
    the heads-in-M one where the heads allow it; ``pallas_mgpu_f16qk``, the
    heads-in-M kernel with f16 QK, beside its fp8 QK on an fp8 cache;
    ``pallas_mgpu_compute_loads``, the kernel the op picks with its page
    gathers issued by a compute warpgroup instead of a producer); for GQA on
    Mosaic GPU ``pallas_mgpu_producer``, the kernel with a producer warpgroup
    (one CTA per SM) beside the two-CTA default; JAX's
    Triton paged attention
    (``jax_paged_attention``, jax.experimental.pallas.ops.gpu.paged_attention,
    fp8 through its per-token scales) and JAX's decode attention over a
    contiguous cache (``jax_decode_attention``, bf16 only).

JAX's kernels take one head dim for K and V and no rope part, so for MLA they
run the latent-only job (K = V = the 512-wide latent, one KV head) and are
checked against our reference with a zero rope query (the same function); their
roofline counts the bytes that job reads. They take no softmax scale, so the
query is pre-scaled inside the timed call.

The sparse kernel has no JAX counterpart; its peer (``pallas_dense``) is our
dense ``paged_mla_decode`` over the whole context, the job the selection
replaces, checked against the dense reference and rated against the dense job.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import benchmark as bm
from pallas_kernels.paged_attention import ops
from pallas_kernels.paged_attention.block_sizes import SparseBlockSizes

FP8 = jnp.float8_e4m3fn
KERNELS = ("paged_mla_decode", "paged_gqa_decode", "paged_mla_sparse_decode")


@jax.jit(static_argnames=("shape", "kv"))
def random_pages(key, *, shape, kv):
  """Random pages [N, ps, ...] (bf16) or fp8 pages with per-token f32 scales."""
  k1, k2 = jax.random.split(key)
  if kv == "bf16":
    return jax.random.normal(k1, shape, jnp.bfloat16), None
  x = jax.random.normal(k1, shape, jnp.float32)
  # amax / 448 per token (e4m3 never overflows), varied by [1, 2).
  s = jnp.max(jnp.abs(x), axis=-1) / 448.0 * jax.random.uniform(k2, shape[:-1], jnp.float32,
                                                                 1.0, 2.0)
  return (x / s[..., None]).astype(FP8), s


def _mla_operands(ks, b, h, c, r, n, ps, p, ctx, kv) -> tuple:
  """Random MLA decode operands from keys ks[0..4]: queries [B, H, C] / [B, H, R], latent
  and rope pages (+ scales), a block table of distinct pages and full lengths."""
  lat, lat_s = random_pages(ks[2], shape=(n, ps, c), kv=kv)
  rope, rope_s = random_pages(ks[3], shape=(n, ps, r), kv=kv)
  bt, lengths = _table(ks[4], b, p, n, ctx)
  return (jax.random.normal(ks[0], (b, h, c), jnp.bfloat16),
          jax.random.normal(ks[1], (b, h, r), jnp.bfloat16), lat, rope, lat_s, rope_s, bt,
          lengths)


# Each input set is drawn by one program per case (op by op, every draw, split and
# permutation would compile a program of its own: a few seconds of a device run's budget).
@jax.jit(static_argnames=("dims",))
def _mla_set(key, *, dims):
  """``_mla_operands`` from one key: (b, h, c, r, n, ps, p, ctx, kv) = ``dims``."""
  return _mla_operands(jax.random.split(key, 5), *dims)


@jax.jit(static_argnames=("dims",))
def _gqa_set(key, *, dims):
  """Random GQA decode operands: queries [B, H, D], K and V pages (+ scales), a block table
  of distinct pages and full lengths; (b, h, nkv, hd, n, ps, p, ctx, kv) = ``dims``."""
  b, h, nkv, hd, n, ps, p, ctx, kv = dims
  ks = jax.random.split(key, 4)
  k, k_s = random_pages(ks[1], shape=(n, ps, nkv, hd), kv=kv)
  v, v_s = random_pages(ks[2], shape=(n, ps, nkv, hd), kv=kv)
  bt, lengths = _table(ks[3], b, p, n, ctx)
  return (jax.random.normal(ks[0], (b, h, hd), jnp.bfloat16), k, v, k_s, v_s, bt, lengths)


@jax.jit(static_argnames=("dims", "k"))
def _sparse_mla_set(key, *, dims, k):
  """``_mla_operands`` and a selection of ``k`` positions per request, from one key."""
  ks = jax.random.split(key, 6)
  return (*_mla_operands(ks, *dims), _selection(ks[5], b=dims[0], ctx=dims[7], k=k))


def _table(key, b, p, n, ctx):
  bt = jax.random.permutation(key, n)[: b * p].reshape(b, p).astype(jnp.int32)
  return bt, jnp.full((b,), ctx, jnp.int32)


def _pow2_splits(p: int, want: int = 16) -> int:
  """Largest power of two <= want dividing p (JAX's kernels split pages evenly)."""
  s = 1
  while s < want and p % (2 * s) == 0:
    s *= 2
  return s


def _upcast(args):
  """The query in f32: the reference computes in f32 already, so only its output widens."""
  return (args[0].astype(jnp.float32), *args[1:])


def job_cost(kernel: str, dims: dict) -> tuple[int, int]:
  """(bytes, FLOPs) one call of a decode-attention job must at least move and do.

  Bytes: every cached token of every request read once (entries, plus fp8 scales), the
  queries in and the outputs out (bf16) and the block tables; FLOPs: QK and PV. For
  the sparse kernel the cached tokens are the min(topk, context) selected rows of each
  request, plus its int32 indices, and of its block table only the entries those rows
  can hit (at most one per row, at most the table). Pure arithmetic on ``dims``
  (pallas_kernels.targets), so the roofline sheet needs no device and no arrays.

  Raises:
    ValueError: for an unknown kernel.
  """
  if kernel not in KERNELS:
    raise ValueError(f"unknown kernel {kernel!r}; known: {KERNELS}")
  b, ctx, kv, p = dims["batch"], dims["context"], dims["kv"], dims["max_pages"]
  item = 1 if kv == "fp8" else 2
  tokens = b * ctx
  if kernel == "paged_mla_sparse_decode":
    h, c, r = dims["heads"], dims["c"], dims["r"]
    k = min(dims["topk"], ctx)  # selected rows per request
    # Queries in, outputs out (bf16), the int32 indices, the table entries the rows hit.
    extra = b * h * (c + r) * 2 + b * h * c * 2 + b * dims["topk"] * 4 + b * min(k, p) * 4
    return (b * k * ((c + r) * item + (8 if kv == "fp8" else 0)) + extra,
            b * k * h * 2 * (2 * c + r))
  if kernel == "paged_mla_decode":
    h, c, r = dims["heads"], dims["c"], dims["r"]
    q_bytes = b * h * (c + r) * 2 + b * h * c * 2 + b * p * 4
    return (tokens * ((c + r) * item + (8 if kv == "fp8" else 0)) + q_bytes,
            tokens * h * 2 * (2 * c + r))
  nkv, hd = dims["kv_heads"], dims["head_dim"]
  h = nkv * dims["group"]
  return (tokens * 2 * nkv * (hd * item + (4 if kv == "fp8" else 0)) + 2 * b * h * hd * 2
          + b * p * 4, tokens * h * 4 * hd)


def _mla(dims, backend, peers, seed):
  b, h, c, r, ps, ctx, kv = (dims[k] for k in ("batch", "heads", "c", "r", "page_size",
                                                "context", "kv"))
  p, n = dims["max_pages"], dims["num_pages"]
  scale = 1.0 / math.sqrt(dims["qk_head_dim"])
  item = 1 if kv == "fp8" else 2
  tokens = b * ctx
  set_bytes = n * ps * (c + r) * item + (8 * n * ps if kv == "fp8" else 0) + b * h * (c + r) * 2

  def make(i):
    return _mla_set(jax.random.key(seed * 1000 + i), dims=(b, h, c, r, n, ps, p, ctx, kv))

  sets = bm.once(lambda: [make(i) for i in range(bm.rotation_sets(set_bytes))])
  q_bytes = b * h * (c + r) * 2 + b * h * c * 2 + b * p * 4
  nbytes, flops = job_cost("paged_mla_decode", dims)

  def call(bs=None, be=backend):
    return functools.partial(ops.paged_mla_decode, scale=scale, backend=be, block_sizes=bs)

  ref = bm.once(lambda: ops.paged_mla_decode(*_upcast(sets()[0]), scale=scale, backend="xla"))
  s0 = sets()[0]
  impls, info = _ours(call, sets, ref, peers, set_bytes,
                      lambda blk: ops.mla_kernel_choice(s0[0], s0[2], s0[3], s0[6], blk))
  if info["kernel_impl"] == "mgpu":
    bs = ops.mla_kernel_choice(s0[0], s0[2], s0[3], s0[6])[0]
    tokens = ops.mla_tokens_in_m(bs, s0[0], s0[2], s0[3])
    info["mla_m"] = "tokens" if tokens else "heads"
    qk8 = ops.mla_qk_fp8(bs, tokens, s0[2])
    info["mla_qk"] = "fp8" if qk8 else "f16"
    if peers and qk8:  # the same kernel converting the page for an f16 QK
      impls.append(bm.Impl("pallas_mgpu_f16qk", call(dataclasses.replace(bs, mla_qk="f16")),
                           sets, ref, note="our heads-in-M Mosaic GPU kernel with QK in "
                           "f16 (pages converted, f16 query)"))
    if peers:  # the same kernel without its memory warpgroup
      impls.append(bm.Impl("pallas_mgpu_compute_loads",
                           call(dataclasses.replace(bs, loads="compute")), sets, ref,
                           note=f"our {info['mla_m']}-in-M Mosaic GPU kernel with a compute "
                           "warpgroup issuing the page gathers (no producer warpgroup)"))
    if peers:  # the other Mosaic GPU MLA kernel, where it takes the shape
      other = "heads" if tokens else "tokens"
      alt = dataclasses.replace(bs, impl="mgpu", mla_m=other, mla_qk="auto")
      try:
        ops.mla_tokens_in_m(alt, s0[0], s0[2], s0[3])
        impls.append(bm.Impl(f"pallas_mgpu_{other}", call(alt), sets, ref,
                             note=f"our Mosaic GPU kernel with {other} in wgmma's M"))
      except ValueError:
        pass  # more heads than the tokens-in-M kernel takes
  if not peers:
    return bm.Bench(nbytes, flops, bm.TOL[kv], impls, info)
  # JAX's kernels: latent only (K = V = latent, one KV head), same as ours with q_rope = 0.
  ref_lat = bm.once(lambda: ops.paged_mla_decode(
      *_upcast((s0[0], jnp.zeros_like(s0[1]), *s0[2:])), scale=scale, backend="xla"))
  lat_bytes = tokens * (c * item + (4 if kv == "fp8" else 0)) + q_bytes
  lat_flops = tokens * h * 4 * c
  interpret = backend == "interpret"
  splits = _pow2_splits(p)
  from jax.experimental.pallas.ops.gpu import paged_attention as jpa  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import decode_attention as jda  # pylint: disable=g-import-not-at-top

  @jax.jit
  def jax_paged(q_lat, q_rope, lat, rope, lat_s, rope_s, bt, lengths):
    del q_rope, rope, rope_s
    q = (q_lat.astype(jnp.float32) * scale).astype(q_lat.dtype)
    s = None if lat_s is None else lat_s[None]
    return jpa.paged_attention(q, lat[None], lat[None], bt, lengths, s, s, block_h=16,
                               pages_per_compute_block=1, k_splits=splits, num_warps=4,
                               num_stages=1, interpret=interpret)

  impls.append(bm.Impl("jax_paged_attention", jax_paged, sets, ref_lat, nbytes=lat_bytes,
                       flops=lat_flops, note="JAX Triton paged attention, latent only "
                       "(K = V = latent, 1 KV head, rope dropped), query pre-scaled"))
  if kv == "bf16":
    def contiguous():
      # [B, P*ps, C]: the same tokens, gathered once outside the timed call.
      return [(s[0], s[2][s[6]].reshape(b, p * ps, c), s[7]) for s in sets()]

    @jax.jit
    def jax_decode(q_lat, lat, lengths):
      return jda.mqa(q_lat, lat, lat, None, lengths, sm_scale=scale, block_h=16, block_k=64,
                     k_splits=_pow2_splits(p * ps // 64), num_stages=1, interpret=interpret)

    impls.append(bm.Impl("jax_decode_attention", jax_decode, contiguous, ref_lat,
                         nbytes=lat_bytes, flops=lat_flops,
                         note="JAX decode attention (mqa) over a contiguous latent cache "
                         "(K = V = latent, rope dropped)"))
  return bm.Bench(nbytes, flops, bm.TOL[kv], impls, info)


# The Mosaic GPU decode kernel's other merges (BlockSizes.merge), each timed beside
# the default (merge_pieces_mgpu launched as a programmatic dependent).
MERGE_PEERS = (
    ("pallas_mgpu_serial_merge", "mgpu_serial",
     "by merge_pieces_mgpu launched as an ordinary kernel (no overlap)"),
    ("pallas_mgpu_triton_merge", "triton", "by merge_pieces on Pallas' Triton backend"),
    ("pallas_mgpu_xla_merge", "xla", "by XLA's one-hot product (reference.combine_pieces)"),
)


def _ours(call, sets, ref, peers, set_bytes, choice):
  """Our kernel (default block sizes), XLA's path and, with peers, our other kernel.

  ``choice(block_sizes)`` is the op's kernel choice for these inputs; the other
  kernel joins at the same block sizes where it takes the shape.
  """
  bs, chosen = choice(None)
  impls = [bm.Impl("pallas", call(), sets, ref, note=f"{chosen} kernel"),
           bm.Impl("xla", call(be="xla"), sets, ref, note="jnp reference, f32 math")]
  if peers:
    other = "triton" if chosen == "mgpu" else "mgpu"
    try:
      alt, _ = choice(dataclasses.replace(bs, impl=other))
      impls.append(bm.Impl(f"pallas_{other}", call(alt), sets, ref,
                           note=f"our {other} kernel, same block sizes"))
    except ValueError:
      pass  # our Mosaic GPU kernel does not take this shape
    if chosen == "mgpu":  # the same decode kernel, its pieces merged another way
      for name, merge, how in MERGE_PEERS:
        impls.append(bm.Impl(name, call(dataclasses.replace(bs, merge=merge)), sets, ref,
                             note=f"our Mosaic GPU kernel, pieces merged {how}"))
  return impls, {"kernel_impl": chosen, "block_sizes": dataclasses.asdict(bs),
                 "input_sets": bm.rotation_sets(set_bytes)}


def _gqa(dims, backend, peers, seed):
  b, nkv, g, hd, ps, ctx, kv = (dims[k] for k in ("batch", "kv_heads", "group", "head_dim",
                                                   "page_size", "context", "kv"))
  p, n = dims["max_pages"], dims["num_pages"]
  h = nkv * g
  scale = 1.0 / math.sqrt(hd)
  item = 1 if kv == "fp8" else 2
  set_bytes = 2 * n * ps * nkv * (hd * item + (4 if kv == "fp8" else 0)) + b * h * hd * 2

  def make(i):
    return _gqa_set(jax.random.key(seed * 1000 + i), dims=(b, h, nkv, hd, n, ps, p, ctx, kv))

  sets = bm.once(lambda: [make(i) for i in range(bm.rotation_sets(set_bytes))])
  nbytes, flops = job_cost("paged_gqa_decode", dims)

  def call(bs=None, be=backend):
    return functools.partial(ops.paged_gqa_decode, scale=scale, backend=be, block_sizes=bs)

  ref = bm.once(lambda: ops.paged_gqa_decode(*_upcast(sets()[0]), scale=scale, backend="xla"))
  s0 = sets()[0]
  impls, info = _ours(call, sets, ref, peers, set_bytes,
                      lambda blk: ops.gqa_kernel_choice(s0[0], s0[1], s0[5], blk))
  if peers and info["kernel_impl"] == "mgpu":  # one CTA per SM, with a producer warpgroup
    bs = ops.gqa_kernel_choice(s0[0], s0[1], s0[5])[0]
    impls.append(bm.Impl("pallas_mgpu_producer",
                         call(dataclasses.replace(bs, gqa_loads="producer")), sets, ref,
                         note="our Mosaic GPU GQA kernel with a producer warpgroup: one CTA "
                         "per SM, four staging slots"))
  if not peers:
    return bm.Bench(nbytes, flops, bm.TOL[kv], impls, info)
  interpret = backend == "interpret"
  splits = _pow2_splits(p)
  from jax.experimental.pallas.ops.gpu import paged_attention as jpa  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.gpu import decode_attention as jda  # pylint: disable=g-import-not-at-top

  def head_major():
    # JAX's layout: pages [KV, N, ps, hd], scales [KV, N, ps]; transposed once, outside timing.
    t = lambda x, perm: None if x is None else jnp.transpose(x, perm)  # noqa: E731
    return [(s[0], t(s[1], (2, 0, 1, 3)), t(s[2], (2, 0, 1, 3)), t(s[3], (2, 0, 1)),
             t(s[4], (2, 0, 1)), s[5], s[6]) for s in sets()]

  @jax.jit
  def jax_paged(q, k, v, k_s, v_s, bt, lengths):
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    return jpa.paged_attention(q, k, v, bt, lengths, k_s, v_s, block_h=16,
                               pages_per_compute_block=max(1, min(8, p // splits)),
                               k_splits=splits, interpret=interpret)

  impls.append(bm.Impl("jax_paged_attention", jax_paged, head_major, ref,
                       note="JAX Triton paged attention (head-major pages), query pre-scaled"))
  if kv == "bf16":
    def contiguous():
      return [(s[0], s[1][s[5]].reshape(b, p * ps, nkv, hd),
               s[2][s[5]].reshape(b, p * ps, nkv, hd), s[6]) for s in sets()]

    @jax.jit
    def jax_decode(q, k, v, lengths):
      return jda.gqa(q, k, v, None, lengths, sm_scale=scale, block_h=16, block_k=16 if interpret
                     else 128, k_splits=_pow2_splits(p * ps // (16 if interpret else 128)),
                     interpret=interpret)

    impls.append(bm.Impl("jax_decode_attention", jax_decode, contiguous, ref,
                         note="JAX decode attention (gqa) over a contiguous cache"))
  return bm.Bench(nbytes, flops, bm.TOL[kv], impls, info)


@jax.jit(static_argnames=("b", "ctx", "k"))
def _selection(key, *, b, ctx, k):
  """[b, k] int32: k distinct positions per request, uniform over [0, ctx), ascending."""
  _, idx = jax.lax.top_k(jax.random.uniform(key, (b, ctx)), k)
  return jnp.sort(idx, axis=-1).astype(jnp.int32)


def _sparse_mla(dims, backend, peers, seed):
  b, h, c, r, ps, ctx, kv, k = (dims[x] for x in ("batch", "heads", "c", "r", "page_size",
                                                   "context", "kv", "topk"))
  p, n = dims["max_pages"], dims["num_pages"]
  if k > ctx:
    raise ValueError(f"topk {k} > context {ctx}: the bench selects distinct positions")
  scale = 1.0 / math.sqrt(dims["qk_head_dim"])
  item = 1 if kv == "fp8" else 2
  # A call reads only the selected rows, so the rotation is sized by those: each input
  # set has its own pool, so that the rows one call reads are not in L2 from the last.
  touched = b * k * ((c + r) * item + (8 if kv == "fp8" else 0)) + b * h * (c + r) * 2

  def make(i):
    return _sparse_mla_set(jax.random.key(seed * 1000 + i),
                           dims=(b, h, c, r, n, ps, p, ctx, kv), k=k)

  sets = bm.once(lambda: [make(i) for i in range(bm.rotation_sets(touched))])
  nbytes, flops = job_cost("paged_mla_sparse_decode", dims)
  ref = bm.once(lambda: ops.paged_mla_sparse_decode(*_upcast(sets()[0]), scale=scale,
                                                    backend="xla"))
  bs = SparseBlockSizes.get_default(num_heads=h, num_indices=k, batch=b)
  impls = [
      bm.Impl("pallas", functools.partial(ops.paged_mla_sparse_decode, scale=scale,
                                          backend=backend), sets, ref,
              note="Triton kernel: gathers the selected rows"),
      bm.Impl("xla", functools.partial(ops.paged_mla_sparse_decode, scale=scale, backend="xla"),
              sets, ref, note="jnp reference: gather the selected rows, then attend (f32)")]
  info = {"kernel_impl": "triton", "block_sizes": dataclasses.asdict(bs),
          "input_sets": bm.rotation_sets(touched)}
  if peers:
    # The dense kernel over every cached token: what attending to the selection saves.
    dense_ref = bm.once(lambda: ops.paged_mla_decode(*_upcast(sets()[0][:8]), scale=scale,
                                                     backend="xla"))
    s0 = sets()[0]
    _, dense_impl = ops.mla_kernel_choice(s0[0], s0[2], s0[3], s0[6])

    @jax.jit
    def dense(*args):
      return ops.paged_mla_decode(*args[:8], scale=scale, backend=backend)

    dense_bytes, dense_flops = job_cost("paged_mla_decode", dims)
    impls.append(bm.Impl("pallas_dense", dense, sets, dense_ref, nbytes=dense_bytes,
                         flops=dense_flops,
                         note=f"paged_mla_decode ({dense_impl} kernel) over the whole context, "
                         "the dense job the selection replaces; checked against the dense "
                         "reference"))
  return bm.Bench(nbytes, flops, bm.TOL[kv], impls, info)


def bench_case(kernel: str, dims: dict, *, backend: str = "pallas", peers: bool = False,
               seed: int = 0) -> bm.Bench:
  """The Bench of one paged-attention case.

  Args:
    kernel: "paged_mla_decode", "paged_gqa_decode" or "paged_mla_sparse_decode".
    dims: the case's dims (pallas_kernels.targets), or smaller ones of the same kind.
    backend: "pallas" on a GPU, "interpret" on a CPU (JAX's kernels run in
      their interpreter too).
    peers: also time our other kernel and JAX's kernels (for the sparse kernel: the
      dense kernel over the whole context).
    seed: base seed of the random inputs.

  Returns:
    A Bench (its inputs are already on the device; peers' other layouts are
    made when they run).

  Raises:
    ValueError: for an unknown kernel.
  """
  if kernel == "paged_mla_decode":
    return _mla(dims, backend, peers, seed)
  if kernel == "paged_gqa_decode":
    return _gqa(dims, backend, peers, seed)
  if kernel == "paged_mla_sparse_decode":
    return _sparse_mla(dims, backend, peers, seed)
  raise ValueError(f"unknown kernel {kernel!r}; known: {KERNELS}")
