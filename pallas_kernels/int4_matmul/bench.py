"""Benchmark cases for the INT4 (W4A16) matmuls: the kernels, XLA's paths and JAX's kernels.

``bench_case(kernel, dims, ...)`` builds a :class:`pallas_kernels.benchmark.Bench`
for one shape of ``int4_matmul`` (dims m, k, n, group_size) or
``int4_grouped_matmul`` (also experts; rows spread as evenly as they go, so
every expert's weights are read, as at the target rows per expert).

Impls, in order:
  * ``pallas``: the kernel with its default block sizes;
  * ``pallas_overlap``: the same with dequantisation overlapped with the wgmmas;
  * ``pallas_nk``: the kernel on [N, K] int4 weights (``nk.py``: converted in
    registers, wgmma's A operand from registers), with its own table's block
    sizes (``TUNED_NK``, derived by ``tune.py``);
  * ``pallas_nk_kn_tiles``: the same kernel with the packed kernel's block sizes,
    where they differ: one device run says whether the derived table pays;
  * ``xla``: the pure-jnp INT4 reference compiled by XLA (dequantise, f32 dot);
  * ``xla_bf16_dot`` / ``xla_bf16_ragged_dot``: the bf16 twin, the same
    (dequantised) weights in bf16 through XLA's dot or ``lax.ragged_dot``:
    4x the weight bytes, the baseline INT4 has to beat in decode;
  * with ``peers``, on a GPU: JAX's Hopper mixed-type matmul
    (``jax_mixed_type_matmul``: int8 weights, no scales, 2x the INT4 weight
    bytes; weights as the wgmma M operand like ours, tokens padded to its
    tile) or JAX's ragged dot (``jax_ragged_dot_mgpu``, bf16 weights).

"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import benchmark as bm
from pallas_kernels import device
from pallas_kernels.int4_matmul import block_sizes
from pallas_kernels.int4_matmul import nk
from pallas_kernels.int4_matmul import reference
from pallas_kernels.int4_matmul.block_sizes import BlockSizes
from pallas_kernels.int4_matmul.int4_matmul import int4_grouped_matmul
from pallas_kernels.int4_matmul.int4_matmul import int4_matmul

KERNELS = ("int4_matmul", "int4_grouped_matmul")


@jax.jit(static_argnames=("shape", "group_size"))
def _weights(key, *, shape, group_size):
  """Random int4 weights [..., K, N] packed, with bf16 group scales."""
  kq, ks = jax.random.split(key)
  q = jax.random.randint(kq, shape, -8, 8, jnp.int8)
  sshape = shape[:-2] + (shape[-2] // group_size, shape[-1])
  s = jax.random.uniform(ks, sshape, jnp.float32, 0.25, 2.0) / 16
  return reference.pack_int4(q), s.astype(jnp.bfloat16)


# Module-level jits: cases of one shape (group-size twins, bf16 twins) share their compiles.
@jax.jit
def _bf16_dot(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@jax.jit
def _bf16_ragged_dot(x, w, group_sizes):
  return jax.lax.ragged_dot(x, w, group_sizes,
                            preferred_element_type=jnp.float32).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("config",))
def _jax_mixed_type_matmul(a, b, *, config):
  from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as hmm  # pylint: disable=g-import-not-at-top
  return hmm.mixed_matmul_kernel(a, b, out_dtype=jnp.bfloat16, config=config)


@jax.jit
def _jax_ragged_dot(x, w, group_sizes):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # pylint: disable=g-import-not-at-top
  return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes, block_m=64, block_n=128,
                                    block_k=64, max_concurrent_steps=4, grid_block_n=1)


def _make_dense(seed, m, k, n, group_size):
  kx, kw = jax.random.split(jax.random.key(seed))
  p, s = _weights(kw, shape=(k, n), group_size=group_size)
  return jax.random.normal(kx, (m, k), jnp.bfloat16), p, s


def balanced_group_sizes(m: int, e: int) -> jax.Array:
  """[E] int32 rows per expert summing to m, as even as possible."""
  return jnp.asarray(np.full(e, m // e) + (np.arange(e) < m % e), jnp.int32)


def job_cost(kernel: str, dims: dict, *, weights: str = "int4") -> tuple[int, int]:
  """(bytes, FLOPs) one call of an INT4 matmul job must at least move and do.

  Bytes: the weights read once (int4: packed values plus bf16 group scales; "bf16": the
  dequantised bf16 twin), for the grouped matmul only the experts that receive rows
  (rows spread as evenly as ``balanced_group_sizes``), activations in and outputs out
  in bf16; FLOPs: 2 M K N. Pure arithmetic on ``dims`` (pallas_kernels.targets).

  Raises:
    ValueError: for an unknown kernel or weight format.
  """
  if kernel not in KERNELS:
    raise ValueError(f"unknown kernel {kernel!r}; known: {KERNELS}")
  m, k, n, g = dims["m"], dims["k"], dims["n"], dims["group_size"]
  if weights == "int4":
    per_expert = k // 2 * n + k // g * n * 2
  elif weights == "bf16":
    per_expert = k * n * 2
  else:
    raise ValueError(f"weights must be 'int4' or 'bf16', got {weights!r}")
  # balanced_group_sizes gives min(M, E) experts rows.
  experts = 1 if kernel == "int4_matmul" else min(m, dims["experts"])
  return experts * per_expert + m * k * 2 + m * n * 2, 2 * m * k * n


def _dense(dims, backend, peers, seed):
  m, k, n, g = dims["m"], dims["k"], dims["n"], dims["group_size"]
  wbytes = k // 2 * n + k // g * n * 2
  io_bytes = m * k * 2 + m * n * 2
  sets = bm.once(lambda: [_make_dense(seed * 1000 + i, m, k, n, g)
                          for i in range(bm.rotation_sets(wbytes + io_bytes))])
  ref = bm.once(lambda: int4_matmul(sets()[0][0].astype(jnp.float32), *sets()[0][1:],
                                     group_size=g, backend="xla"))
  call = lambda be: functools.partial(int4_matmul, group_size=g, backend=be)  # noqa: E731
  bs = BlockSizes.get_default(m, n, k).fit(m, n, k)
  nk_bs = BlockSizes.get_default(m, n, k, layout="nk", group_size=g).fit(m, n, k)
  # Dense decode: the same tiles without K splits, against the count get_default
  # picks for the call (whether splitting pays at all).
  row = block_sizes.TUNED_NK.get((device.device_kind(), "dense", "decode"))
  one_split = (dataclasses.replace(row, k_splits=1).fit(m, n, k)
               if row and m <= block_sizes.DECODE_MAX_M else None)

  def bf16_sets():
    return [(x, reference.dequantize_int4(p, s, g, jnp.bfloat16)) for x, p, s in sets()]

  impls = [bm.Impl("pallas", call(backend), sets, ref, note="Mosaic GPU kernel"),
           _overlap_impl(int4_matmul, g, backend, bs, sets, ref),
           *_nk_impls(nk.int4_matmul_nk, g, backend, nk_bs, bs, sets, ref, one_split),
           bm.Impl("xla", call("xla"), sets, ref, note="jnp reference: dequantise, f32 dot"),
           bm.Impl("xla_bf16_dot", _bf16_dot, bf16_sets, ref,
                   nbytes=job_cost("int4_matmul", dims, weights="bf16")[0],
                   note="bf16 twin: dequantised weights, XLA dot")]
  if peers and backend == "pallas":
    impls.append(_mixed_type_peer(sets, m, k, n))
  return bm.Bench(*job_cost("int4_matmul", dims), bm.TOL["bf16"], impls,
                  {"block_sizes": dataclasses.asdict(bs),
                   "block_sizes_nk": dataclasses.asdict(nk_bs),
                   "input_sets": bm.rotation_sets(wbytes + io_bytes)})


def _overlap_impl(op, group_size, backend, bs, sets, ref) -> bm.Impl:
  """Our kernel with dequantisation overlapped with the wgmmas (BlockSizes.overlap_dequant),
  timed beside the default so that one device run says which the tuned table should take."""
  overlapped = dataclasses.replace(bs, overlap_dequant=True)
  fn = functools.partial(op, group_size=group_size, backend=backend, block_sizes=overlapped)
  smem = overlapped.smem_bytes(group_size, grouped=op is int4_grouped_matmul)
  return bm.Impl("pallas_overlap", fn, sets, ref,
                 note=f"Mosaic GPU kernel, dequantisation overlapped with the wgmmas "
                 f"(two scratch slots: {smem} B of shared memory per CTA)")


def _nk_impls(op, group_size, backend, nk_bs, kn_bs, sets, ref,
              one_split=None) -> list[bm.Impl]:
  """The kernel on [N, K] int4 weights (the same bytes, relaid once, outside the
  timing) with its own block sizes, with the packed kernel's, and (dense decode)
  with its own tiles and no K splits instead of the per-call count, each where it
  differs from the first."""
  grouped = op is nk.int4_grouped_matmul_nk

  def nk_sets():  # built when timed, like the bf16 twins' sets
    return [(x, nk.to_nk(p), *rest) for x, p, *rest in sets()]

  out = []
  for name, bs, which in (("pallas_nk", nk_bs, "TUNED_NK"),
                          ("pallas_nk_kn_tiles", kn_bs, "the packed kernel's"),
                          ("pallas_nk_one_split", one_split, "TUNED_NK's, one split:")):
    if out and (bs is None or bs == nk_bs):
      continue
    fn = functools.partial(op, group_size=group_size, backend=backend, block_sizes=bs)
    smem = bs.smem_bytes(group_size, grouped=grouped, layout="nk")
    out.append(bm.Impl(name, fn, nk_sets, ref,
                       note=f"Mosaic GPU kernel on [N, K] int4 weights: converted in "
                       f"registers, wgmma A from registers; {which} block sizes "
                       f"{bs.tile_n}x{bs.tile_m}x{bs.tile_k}, depth {bs.max_concurrent_steps}"
                       f"{f', {bs.k_splits} splits' if bs.k_splits > 1 else ''} "
                       f"({smem} B of shared memory per CTA)"))
  return out


def _mixed_type_peer(sets, m, k, n) -> bm.Impl:
  """JAX's Hopper mixed-type matmul, int8 weights [N, K] as lhs, x^T [K, M_pad] as rhs."""
  from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as hmm  # pylint: disable=g-import-not-at-top
  # Tokens per warpgroup (two warpgroups split the tokens); 64 keeps 4 pipeline stages in
  # shared memory for prefill token counts.
  tile_n = 32 if m <= 64 else 64
  m_pad = -(-m // (2 * tile_n)) * (2 * tile_n)
  cfg = hmm.TuningConfig(tile_m=128 if n % 128 == 0 else 64, tile_n=tile_n, tile_k=128,
                         max_concurrent_steps=4, epi_tile_n=None, epi_tile_m=64,
                         wg_dimension=hmm.MatmulDimension.N)

  def operands(x, p):
    xt = jnp.pad(x, ((0, m_pad - m), (0, 0))).T  # [K, M_pad]
    return reference.unpack_int4(p).T, xt  # [N, K] int8 (values in [-8, 7])

  def args():
    return [operands(x, p) for x, p, _ in sets()]

  def expected():
    a, b = operands(*sets()[0][:2])
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))[:, :m]

  fn = functools.partial(_jax_mixed_type_matmul, config=cfg)
  return bm.Impl("jax_mixed_type_matmul", fn, args, bm.once(expected),
                 output=lambda o: o[:, :m], nbytes=k * n + k * m_pad * 2 + n * m_pad * 2,
                 flops=2 * m_pad * k * n,
                 note=f"JAX Hopper mixed-type matmul: int8 weights, no scales, tokens padded "
                 f"to {m_pad}; checked against its own f32 dot")


def _grouped(dims, backend, peers, seed):
  m, k, n, g, e = dims["m"], dims["k"], dims["n"], dims["group_size"], dims["experts"]
  gs = balanced_group_sizes(m, e)
  active = int(np.sum(np.asarray(gs) > 0))
  wbytes = e * (k // 2 * n + k // g * n * 2)
  io_bytes = m * k * 2 + m * n * 2

  def make(i):
    kx, kw = jax.random.split(jax.random.key(seed * 1000 + i))
    p, s = _weights(kw, shape=(e, k, n), group_size=g)
    return jax.random.normal(kx, (m, k), jnp.bfloat16), p, s, gs

  sets = bm.once(lambda: [make(i) for i in range(bm.rotation_sets(wbytes + io_bytes))])
  ref = bm.once(lambda: int4_grouped_matmul(sets()[0][0].astype(jnp.float32), *sets()[0][1:],
                                             group_size=g, backend="xla"))
  call = lambda be: functools.partial(int4_grouped_matmul, group_size=g, backend=be)  # noqa: E731
  bs = BlockSizes.get_default(m, n, k, grouped=True, experts=e).fit(m, n, k)
  nk_bs = BlockSizes.get_default(m, n, k, grouped=True, experts=e, layout="nk",
                                 group_size=g).fit(m, n, k)

  def bf16_sets():
    return [(x, reference.dequantize_int4(p, s, g, jnp.bfloat16), c) for x, p, s, c in sets()]

  bf16_bytes = job_cost("int4_grouped_matmul", dims, weights="bf16")[0]
  impls = [bm.Impl("pallas", call(backend), sets, ref, note="Mosaic GPU kernel"),
           _overlap_impl(int4_grouped_matmul, g, backend, bs, sets, ref),
           *_nk_impls(nk.int4_grouped_matmul_nk, g, backend, nk_bs, bs, sets, ref),
           bm.Impl("xla", call("xla"), sets, ref, note="jnp reference: dequantise, f32 ragged_dot"),
           bm.Impl("xla_bf16_ragged_dot", _bf16_ragged_dot, bf16_sets, ref, nbytes=bf16_bytes,
                   note="bf16 twin: dequantised weights, lax.ragged_dot")]
  if peers and backend == "pallas":
    impls.append(bm.Impl("jax_ragged_dot_mgpu", _jax_ragged_dot, bf16_sets, ref, nbytes=bf16_bytes,
                         note="JAX Mosaic GPU ragged dot, bf16 weights"))
  return bm.Bench(*job_cost("int4_grouped_matmul", dims), bm.TOL["bf16"], impls,
                  {"block_sizes": dataclasses.asdict(bs),
                   "block_sizes_nk": dataclasses.asdict(nk_bs),
                   "active_experts": active,
                   "input_sets": bm.rotation_sets(wbytes + io_bytes)})


def bench_case(kernel: str, dims: dict, *, backend: str = "pallas", peers: bool = False,
               seed: int = 0) -> bm.Bench:
  """The Bench of one INT4 matmul case.

  Args:
    kernel: "int4_matmul" or "int4_grouped_matmul".
    dims: the case's dims (pallas_kernels.targets), or smaller ones of the same kind.
    backend: "pallas" on a GPU, "interpret" on a CPU (JAX's Mosaic GPU kernels
      have no interpreter, so they join only on a GPU).
    peers: also time JAX's kernel for the same job.
    seed: base seed of the random inputs.

  Returns:
    A Bench.

  Raises:
    ValueError: for an unknown kernel.
  """
  if kernel == "int4_matmul":
    return _dense(dims, backend, peers, seed)
  if kernel == "int4_grouped_matmul":
    return _grouped(dims, backend, peers, seed)
  raise ValueError(f"unknown kernel {kernel!r}; known: {KERNELS}")
