"""A time model of the [N, K] int4 kernels on an H200: occupancy, then rounds of CTAs.

Used twice: ``tune.py`` ranks every candidate tile shape, depth and
split count with it to derive the ``TUNED_NK`` rows, and
``BlockSizes.get_default(layout="nk")`` picks each dense decode call's K split
count with it (the class's row fixes the tile; the split count that fills the
SMs depends on the projection's N and K). Modelled, not timed; the model is
described in docs/int4_matmul.md ("Block sizes of the [N, K] kernels").

A call's work items (output tiles times K splits) run in rounds of
SMS x occupancy CTAs. A round costs one HBM latency (the pipeline's fill) plus
the largest of:
  * its weight bytes at the bandwidth its loads in flight sustain (Little's
    law: CTAs x (depth - 1) steps of bytes over the latency, at most the copy
    bandwidth);
  * the busiest SM's MMA time;
  * its conversion time (instructions per weight at four warp instructions per
    clock).
Activations and outputs move once at the copy bandwidth, and the dense
kernel's f32 split partials twice (written, then read by the sum that casts
them).
"""

from __future__ import annotations

import dataclasses
import math

from pallas_kernels import benchmark as bm

SMS = 132
SM_SMEM_BYTES = 228 * 1024  # shared memory per SM
CTA_RESERVED_SMEM = 1024  # the SM reserves this much per resident CTA
SM_REGISTERS = 65536
REGISTER_STEP = 8  # registers are allocated per thread in steps of 8
MAX_CTAS_PER_SM = 32
MAX_THREADS_PER_SM = 2048
THREADS = 128  # the [N, K] kernels run one warpgroup per CTA
HBM_LATENCY_S = 1.0e-6  # a loaded HBM round trip, what a pipeline's loads must cover
CLOCK_HZ = 1.98e9  # H200 boost clock
SM_ISSUE_PER_CLOCK = 4 * 32  # four schedulers, one warp instruction each per clock
# Conversion instructions per weight in the [N, K] kernel's static PTX (ld.shared,
# prmt, lop3, sub.bf16x2 and mul.bf16x2 per pair, shifts and scale moves).
INSTRUCTIONS_PER_WEIGHT = 3.0
MAX_SPLITS = 16  # the dense decode model chooses among the K step count's divisors up to this


def occupancy(registers: int, smem_bytes: int, threads: int = THREADS) -> int:
  """CTAs one SM holds at once: the least of the register, shared-memory, thread and
  CTA limits (0 when one CTA does not fit)."""
  regs = -(-registers // REGISTER_STEP) * REGISTER_STEP * threads
  return min(SM_REGISTERS // regs, SM_SMEM_BYTES // (smem_bytes + CTA_RESERVED_SMEM),
             MAX_THREADS_PER_SM // threads, MAX_CTAS_PER_SM)


def seconds(bs, *, m: int, n: int, k: int, group_size: int, registers: int,
            grouped_tiles: int | None = None) -> float:
  """Modelled H200 time of one call under the resolved block sizes ``bs``.

  Args:
    bs: the kernel's BlockSizes, already fitted to the problem.
    m, n, k: the problem ([m, k] x [k, n]).
    group_size: the scales' group size.
    registers: per thread, from ptxas.
    grouped_tiles: the grouped kernel's row tiles (its schedule's count for the
      rows per expert); None for the dense kernel.

  Returns:
    Seconds; inf when one CTA does not fit an SM.
  """
  grouped = grouped_tiles is not None
  occ = occupancy(registers, bs.smem_bytes(group_size=group_size, scale_bytes=2,
                                           grouped=grouped, layout="nk"))
  if occ == 0:
    return math.inf
  n_tiles = n // bs.tile_n
  if grouped:
    items, k_item, splits = n_tiles * grouped_tiles, k, 1
  else:
    splits = bs.k_splits
    items, k_item = n_tiles * -(-m // bs.tile_m) * splits, k // splits
  steps = k_item // bs.tile_k
  depth = max(2, min(bs.max_concurrent_steps, steps)) if steps > 1 else 1
  step_bytes = (bs.tile_n * bs.tile_k // 2 + bs.tile_k // group_size * bs.tile_n * 2
                + bs.tile_m * bs.tile_k * 2)
  in_flight = max(1, depth - 1) * step_bytes  # per CTA
  weight_bytes = bs.tile_n * k_item // 2 + k_item // group_size * bs.tile_n * 2  # per item
  flops = 2 * bs.tile_n * bs.tile_m * k_item
  weights = bs.tile_n * k_item
  slots = SMS * occ
  total = 0.0
  for start in range(0, items, slots):
    c = min(slots, items - start)
    bw = min(bm.H200_COPY_BW, c * in_flight / HBM_LATENCY_S)
    per_sm = -(-c // SMS)
    mem = c * weight_bytes / bw
    mma = per_sm * flops / (bm.H200_BF16_FLOPS / SMS)
    alu = per_sm * weights * INSTRUCTIONS_PER_WEIGHT / (SM_ISSUE_PER_CLOCK * CLOCK_HZ)
    total += HBM_LATENCY_S + max(mem, mma, alu)
  m_pad = -(-m // bs.tile_m) * bs.tile_m
  io = m * k * 2 + m * n * 2
  if not grouped and splits > 1:  # f32 split partials written, then summed by XLA
    io += 2 * splits * n * m_pad * 4
  return total + io / bm.H200_COPY_BW


def best_splits(bs, *, m: int, n: int, k: int, group_size: int, registers: int) -> int:
  """The dense kernel's K split count (a divisor of its K steps, at most MAX_SPLITS)
  with the least modelled time for this problem and tile; ties go to fewer
  splits (fewer f32 partials)."""
  steps = k // bs.tile_k
  best, best_t = 1, math.inf
  for s in range(1, min(MAX_SPLITS, steps) + 1):
    if steps % s:
      continue
    t = seconds(dataclasses.replace(bs, k_splits=s), m=m, n=n, k=k,
                group_size=group_size, registers=registers)
    if t < best_t * (1 - 1e-9):
      best, best_t = s, t
  return best
