"""The INT4 [N, K] kernels' H200 block sizes, derived from ptxas readings and occupancy, by hand.

The command line around ``pallas_kernels.int4_matmul.tune`` (the readings, the
occupancy and time model and the selection; docs/int4_matmul.md, "Block sizes of
the [N, K] kernels"): it reads the committed tile readings
(``pallas_kernels/int4_matmul/int4_nk_tiles_h200.json``), with ``--compile``
compiles the tiles they lack for sm_90a and writes them back, then prints each
shape class's pick, the dense decode row's K split scores, and how the packed
kernel's rows (TUNED) would do on the [N, K] kernel. Modelled, not timed.

Run (112 tile compiles with ``--compile``, about 2 minutes on two cores; without it,
the committed readings and no compiler)::

    .venv/bin/python -m experiments.int4_tune [--readings PATH] [--compile]
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

if __name__ == "__main__":  # the CLI compiles: ptxas logging must be on before jax loads
  from pallas_kernels.h200 import env as _env
  _env.prepare()

from pallas_kernels.int4_matmul import tune  # noqa: E402
from pallas_kernels.int4_matmul.block_sizes import TUNED  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--readings", default=tune.DATA_PATH,
                  help="tile readings JSON (read, and written after compiles)")
  ap.add_argument("--compile", action="store_true",
                  help="compile the tiles the readings lack (needs the H200 compile packages)")
  args = ap.parse_args(argv)
  readings = tune.load_readings(args.readings)
  keys = {}
  for op, cls in tune.CLASSES:
    keys.update(tune.needed_tiles(op, cls))
  missing = [k for k in keys if k not in readings]
  if missing and not args.compile:
    print(f"{len(missing)} tile readings missing from {args.readings}; "
          f"rerun with --compile", file=sys.stderr)
    return 2
  if missing:
    from pallas_kernels.h200 import kernel_readings
    print(f"compiling {len(missing)} tiles for sm_90a", flush=True)
    tune.compile_tiles(keys, readings, progress=lambda s: print(s, flush=True))
    tune.save_readings(readings, args.readings, ptxas=kernel_readings.ptxas_version())
    print(f"wrote {args.readings}")
  choices = [tune.select(readings, op, cls) for op, cls in tune.CLASSES]
  print(tune.markdown(choices))
  splits = tune.split_scores(
      readings, next(c for c in choices if (c.op, c.cls) == ("dense", "decode")))
  per_call = splits.pop("per call")
  print("\ndense decode, the row's tiles: score with the K split count get_default picks "
        f"per call (tile_model.best_splits) {per_call:.3f}; with a fixed count "
        + ", ".join(f"{ks}: {sc:.3f}" for ks, sc in splits.items()))
  print("\nThe packed kernel's rows (TUNED) on the [N, K] kernel, modelled time / the pick's:")
  for c in choices:
    kn = TUNED[(tune.H200, c.op, c.cls)]
    med, worst = tune.versus(readings, c.op, c.cls, c.block_sizes, kn)
    print(f"  {c.op} {c.cls}: {tune.format_block_sizes(kn)}: median {med:.2f}x, "
          f"worst {worst:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
