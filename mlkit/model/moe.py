"""Mixture-of-experts FFN: DeepSeek-V3 routing and grouped-matmul dispatch.

Tokens are sorted by expert and run through one ragged grouped matmul per
projection, so no [tokens, experts, hidden] tensor is ever built.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mlkit.config import ModelConfig
from mlkit.model.layers import decode_splits, swiglu
from mlkit.quant import grouped_matmul, grouped_matmuls
from mlkit.quant.dispatch import schedule_spec
from pallas_kernels import dispatch as kernel_dispatch
from pallas_kernels.moe_router import select_experts, sort_by_expert, sort_by_expert_local


def route(p: dict, x: jax.Array, cfg: ModelConfig, *, backend: str | None = None):
  """Chooses top-k experts per token.

  Sigmoid routers (DeepSeek-V3) pick experts by score + ``router_bias`` (the
  auxiliary-loss-free balancing bias) but weight them by the unbiased score;
  with ``n_group > 1`` only the ``topk_group`` best groups (scored by the sum of
  their two best experts) are eligible. Softmax routers pick by probability.
  After the logits' matmul, the choice is ``pallas_kernels.moe_router``'s: one
  Pallas launch on the kernel backends, its jnp reference on "xla".

  Args:
    p: MoE params (``router`` [D, E], optional ``router_bias`` [E]).
    x: tokens [N, D].
    backend: kernel backend ("pallas" | "interpret" | "xla" | None: the platform's).

  Returns:
    (expert_ids [N, k] int32, weights [N, k] f32 including routed_scaling_factor,
     scores [N, E] f32: the router's sigmoid scores or softmax probabilities).
  """
  xf, w = x.astype(jnp.float32), p["router"].astype(jnp.float32)
  kernels = kernel_dispatch.resolve_backend(backend) != "xla"
  n, d = xf.shape
  splits = decode_splits(n, d, backend)
  if splits:  # partial sums over slices of D, which the expert-choice kernel adds
    logits = jnp.einsum("nsd,sde->sne", xf.reshape(n, splits, d // splits),
                        w.reshape(splits, d // splits, -1))  # [S, N, E]
  else:
    logits = jnp.dot(xf, w)  # [N, E]
  bias = None
  if cfg.router == "sigmoid":
    bias = p["router_bias"].astype(jnp.float32)
    if not kernels:
      # The bias is tied to this layer's logits: broadcast to [N, E] from the params
      # alone, XLA would build every layer's at the start of the step and hold them all
      # (12 MiB a layer in Kimi K2.6's 8192-token prefill; docs/serving_step_memory.md).
      # Tied to the logits rather than the scores, the sigmoid and the bias add fuse
      # into one kernel. The kernel reads the [E] bias as it is.
      logits, bias = jax.lax.optimization_barrier((logits, bias))
  return select_experts(logits, bias, top_k=cfg.top_k, router=cfg.router, n_group=cfg.n_group,
                        topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                        scaling=cfg.routed_scaling_factor, backend=backend)


def _run_experts(p: dict, x: jax.Array, token_of: jax.Array, group_sizes: jax.Array,
                 row_weights: jax.Array, slot: jax.Array, backend: str | None,
                 schedule=None) -> jax.Array:
  """Expert FFNs over token rows sorted by expert, combined back into their tokens.

  The combine gathers each token's k rows and adds them, rather than scatter-adding
  rows into a zero-initialised [N, D] buffer: XLA merges identical zero buffers
  across layers and hoists each layer's copy of it to the start of the step, so a
  scatter target would hold N x D x 4 bytes per MoE layer for the whole step.

  Args:
    p: expert weights ``w_gate``/``w_up`` [G, D, F] and ``w_down`` [G, F, D] (any format).
    x: tokens [N, D].
    token_of: [R] the token of each row, rows sorted by expert; rows past
      sum(group_sizes) give zero expert outputs.
    group_sizes: rows per expert [G].
    row_weights: [R] combine weight of each row.
    slot: [N, k] the row holding each (token, choice), -1 where no row here does.
    schedule: None, or the grouped matmuls' tile schedule table for ``group_sizes``
      (written by the sort; ``mlkit.quant.dispatch.schedule_spec``), handed to all three.

  Returns:
    [N, D] f32: sum over the rows r of token n of row_weights[r] * expert(x[n]).
  """
  xs = x[token_of]  # [R, D]
  # Gate and up read the same rows: int4 experts on the kernel backends run both in one
  # launch (docs/int4_matmul.md, "Gate and up in one launch"); other formats, and "xla",
  # one grouped matmul each.
  gate, up = grouped_matmuls(xs, (p["w_gate"], p["w_up"]), group_sizes,
                             backend=backend, schedule=schedule)  # [R, F] each
  h = jax.nn.silu(gate) * up  # [R, F]
  ys = grouped_matmul(h, p["w_down"], group_sizes, out_dtype=jnp.float32,
                      backend=backend, schedule=schedule)  # [R, D]
  ys = ys * row_weights[:, None].astype(jnp.float32)
  R = ys.shape[0]
  out = None
  for j in range(slot.shape[1]):
    s = slot[:, j]  # [N]
    term = jnp.where((s >= 0)[:, None], ys[jnp.clip(s, 0, R - 1)], 0.0)  # [N, D]
    out = term if out is None else out + term
  return out


# Expert-parallel row passes (docs/serving_step_memory.md, "Expert-parallel prefill in
# passes"). A device's experts can receive every one of the R = tokens x top-k rows, so a
# single pass sizes every per-row buffer (the gathered tokens, the three projections'
# outputs) at R, though a balanced router sends each of S devices about R / S. From
# EP_PASS_MIN_ROWS rows on, a device runs its rows in passes of EP_PASS_CAPACITY x R / S
# (at most R): one pass when routing is balanced to within that factor, more only when
# its experts drew more rows. Below it (decode: 64 requests x 8 = 512 rows) one pass of R
# rows is cheap, and a data-dependent loop can cost a device-to-host read of its
# predicate per pass (XLA's GPU while loop, outside a CUDA-graph conditional).
EP_PASS_MIN_ROWS = 4096
EP_PASS_CAPACITY = 1.25


def ep_pass_rows(rows: int, shards: int) -> int:
  """Rows per expert-parallel pass for ``rows`` routed rows over ``shards`` devices."""
  if rows < EP_PASS_MIN_ROWS or shards <= 1:
    return rows
  per = -(-int(rows * EP_PASS_CAPACITY) // shards)
  return min(rows, -(-per // 64) * 64)  # whole 64-row tiles


def _expert_axes(expert_sharding) -> tuple[str, ...] | None:
  """Mesh axes the experts' leading axis is split over (None: not split, or no sharding)."""
  if expert_sharding is None:
    return None
  spec = expert_sharding.spec
  lead = spec[0] if len(spec) else None
  if lead is None:
    return None
  axes = (lead,) if isinstance(lead, str) else tuple(lead)
  return axes if math.prod(expert_sharding.mesh.shape[a] for a in axes) > 1 else None


def _local_experts(experts: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                   shard: jax.Array, n_experts: int, shards: int,
                   backend: str | None) -> jax.Array:
  """Device ``shard``'s part of the expert-parallel routed experts in one pass (a decode
  step's rows, on the kernel backends): its own rows sorted by expert
  (``sort_by_expert_local``, one Pallas launch) through its local experts.

  Args:
    experts: the device's ``w_gate``/``w_up`` [E / shards, D, F] and ``w_down``
      [E / shards, F, D] (any format).
    x: tokens [N, D]; expert_ids, weights: [N, k] int32 and f32.
    shard: int32 scalar, the device's index along the expert axes.

  Returns:
    [N, D] f32: the sum over this device's experts, before the all-reduce.
  """
  # Int4 experts: the sort also writes the tile schedule that the three grouped matmuls
  # share (their tile_m agree), in its own launch, where the grouped calls computed it in
  # one more (docs/moe_router.md, "The sort writes the schedule"). Other formats, or
  # calls that would not share one, get None.
  spec = schedule_spec(expert_ids.size, (experts["w_gate"], experts["w_up"], experts["w_down"]),
                       backend=backend)
  token_of, row_weights, slot, sizes, *table = sort_by_expert_local(
      expert_ids, weights, n_experts, shard, shards, backend=backend, schedule=spec)
  return _run_experts(experts, x, token_of, sizes, row_weights, slot, backend,
                      schedule=table[0] if table else None)


def dispatch_experts(p: dict, x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                     n_experts: int, *, backend: str | None = None,
                     expert_sharding: NamedSharding | None = None, out_dtype=None) -> jax.Array:
  """Runs each token through its chosen experts and combines the results.

  With ``expert_sharding`` (experts split over mesh axes), the expert FFNs run
  expert-parallel inside a ``shard_map``: each device takes the contiguous run of
  sorted rows that belongs to its own experts, runs only its local weights (so
  the kernels see per-device shapes and no device gathers another's experts),
  combines them into a partial [N, D] and one all-reduce sums the partials.
  Every row belongs to exactly one device, so the result equals the unsharded one
  up to f32 summation order. With many rows (prefill) a device runs its rows in
  passes of :func:`ep_pass_rows`, so its buffers are sized for a balanced share
  rather than for every row; a device whose experts drew more loops over more
  passes, so no row is dropped.

  Args:
    p: expert weights ``w_gate``/``w_up`` [E, D, F] and ``w_down`` [E, F, D] (any format).
    x: tokens [N, D] (replicated over the expert axes when sharded).
    expert_ids: [N, k] int32.
    weights: [N, k] combine weights.
    n_experts: E.
    backend: kernel backend for quantised expert weights.
    expert_sharding: None, or a NamedSharding whose spec's first entry names the
      mesh axes the experts' leading axis is split over (as the params are placed).
    out_dtype: the result's dtype (default x's). ``moe_ffn`` takes f32, so that the
      shared expert's output adds to it before any cast: XLA's GPU compiler then sums the
      two partial sums on each device and all-reduces once, where it combined two
      all-reduces into one over their concatenation (a launch, and twice the bytes).

  Returns:
    [N, D] in ``out_dtype``: sum_k weights[n, k] * expert_{ids[n, k]}(x[n]).

  Raises:
    ValueError: if the expert axes do not split E into whole experts.
  """
  expert_ids, weights = expert_ids.astype(jnp.int32), weights.astype(jnp.float32)
  experts = {name: p[name] for name in ("w_gate", "w_up", "w_down")}
  axes = _expert_axes(expert_sharding)
  out_dtype = out_dtype or x.dtype

  def expert_spec(a):
    return PartitionSpec(axes, *(None,) * (a.ndim - 1))

  if axes is not None:
    mesh = expert_sharding.mesh
    shards = math.prod(mesh.shape[a] for a in axes)
    if n_experts % shards:
      raise ValueError(f"dispatch_experts: {n_experts} experts do not split into whole "
                       f"experts over mesh axes {axes} of size {shards}")
    local_experts = n_experts // shards
    R = expert_ids.size
    pass_rows = ep_pass_rows(R, shards)
    if pass_rows == R and kernel_dispatch.resolve_backend(backend) != "xla":
      # One pass (a decode step's rows) on the kernel backends: each device sorts the
      # rows with its own experts' first and their row counts (sort_by_expert_local, one
      # Pallas launch), where slicing them out of the global sort took launches of its
      # own (docs/moe_router.md, "One device's rows").
      def local_sorted(experts, x, expert_ids, weights):
        out = _local_experts(experts, x, expert_ids, weights,
                             jax.lax.axis_index(axes).astype(jnp.int32), n_experts, shards,
                             backend)
        return jax.lax.psum(out, axes)  # [N, D] f32

      in_specs = (jax.tree_util.tree_map(expert_spec, experts),) + (PartitionSpec(),) * 3
      run = jax.shard_map(local_sorted, mesh=mesh, in_specs=in_specs,
                          out_specs=PartitionSpec(), check_vma=False)
      return run(experts, x, expert_ids, weights).astype(out_dtype)

  # The rows sorted by expert, and every expert's row offsets (cum [E + 1]): one Pallas
  # launch for a decode step's few rows on the kernel backends (docs/moe_router.md), the
  # jnp sort for a prefill's and on "xla".
  token_of, row_weights, slot, cum = sort_by_expert(expert_ids, weights, n_experts,
                                                    backend=backend)
  if axes is None:
    out = _run_experts(experts, x, token_of, cum[1:] - cum[:-1], row_weights, slot, backend)
    return out.astype(out_dtype)

  def local(experts, x, token_of, cum, row_weights, slot):
    first = jax.lax.axis_index(axes) * local_experts
    # This device's offsets, sliced from the row offsets: no kernel of their own, where
    # a sum for the start, one for the count and a cumsum ran three.
    sizes = jax.lax.dynamic_slice_in_dim(cum[1:] - cum[:-1], first, local_experts)  # [E_local]
    start = cum[first]
    ends = jax.lax.dynamic_slice_in_dim(cum, first + 1, local_experts) - start  # [E_local]
    count = ends[-1]  # this device's rows: [start, start + count) of the sorted rows

    def run_pass(lo):
      """Local rows [lo, lo + pass_rows): their experts' FFNs, combined into [N, D] f32."""
      def rows(a):  # entries [start + lo, ...) of a per-row array [R], zero past the end
        return jax.lax.dynamic_slice_in_dim(jnp.concatenate([a, jnp.zeros_like(a)]),
                                            start + lo, pass_rows)
      pass_sizes = (jnp.clip(ends - lo, 0, pass_rows)
                    - jnp.clip(ends - sizes - lo, 0, pass_rows))  # [E_local]
      # Rows of other devices' experts, or of other passes, fall outside [0, rows here).
      here = jnp.clip(count - lo, 0, pass_rows)
      local_slot = slot - start - lo
      local_slot = jnp.where((local_slot >= 0) & (local_slot < here), local_slot, -1)
      return _run_experts(experts, x, rows(token_of), pass_sizes, rows(row_weights),
                          local_slot, backend)

    out = run_pass(0)
    if pass_rows < R:  # the rows past the first pass, if this device's experts drew them
      passes = (count + pass_rows - 1) // pass_rows
      out = jax.lax.fori_loop(1, passes, lambda i, acc: acc + run_pass(i * pass_rows), out)
    return jax.lax.psum(out, axes)  # [N, D] f32

  in_specs = (jax.tree_util.tree_map(expert_spec, experts),) + (PartitionSpec(),) * 5
  run = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(),
                      check_vma=False)
  return run(experts, x, token_of, cum, row_weights, slot).astype(out_dtype)


def moe_ffn(p: dict, x: jax.Array, cfg: ModelConfig, *, backend: str | None = None,
            expert_sharding: NamedSharding | None = None, out_dtype=None):
  """MoE FFN over tokens x [..., D]: routed experts plus shared expert(s).

  ``expert_sharding``: see :func:`dispatch_experts` (expert-parallel routed experts).
  ``out_dtype``: the output's dtype (default x's); f32 hands on the f32 sum.

  Returns:
    (out [..., D], aux) where aux holds ``expert_load`` [E] (fraction of routed
    assignments per expert) and ``router_prob`` [E] (mean router score), the
    statistics load-balancing losses and bias updates need.
  """
  shape = x.shape
  xf = x.reshape(-1, shape[-1])  # [N, D]
  expert_ids, weights, scores = route(p, xf, cfg, backend=backend)
  out = dispatch_experts(p, xf, expert_ids, weights, cfg.n_routed_experts, backend=backend,
                         expert_sharding=expert_sharding, out_dtype=jnp.float32)
  if "shared" in p:
    out = out + swiglu(p["shared"], xf, backend=backend, out_dtype=jnp.float32)
  out = out.astype(out_dtype or x.dtype)
  load = jnp.bincount(expert_ids.reshape(-1), length=cfg.n_routed_experts) / expert_ids.size
  aux = {"expert_load": load.astype(jnp.float32), "router_prob": jnp.mean(scores, axis=0)}
  return out.reshape(shape), aux
