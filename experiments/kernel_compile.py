"""Every Pallas kernel at its H200 target shapes through XLA's GPU compiler and ptxas, by hand.

The command line around ``pallas_kernels.h200.kernel_readings`` (the builds, their
kernel keys, the compiles and the records; docs/h200_compile.md explains the
method): it sweeps the target cases (``pallas_kernels.targets``), writes the records
as JSON under ``results/h200_kernel_compile/`` (:data:`DEFAULT_DIR`, where the
deviceless compile tests write theirs and the ``kernels`` experiment reads them)
and prints the table; ``--verify`` compiles every build of a shared compile on its
own instead and writes the evidence for the dedup.

Run the whole sweep (``--other-impl``: 86 compiles, a few minutes on two busy
cores; ``--verify`` compiles every build of a shared compile on its own, 274,
about 12)::

    .venv/bin/python -m experiments.kernel_compile [--other-impl] [--verify] [substring ...]
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Sequence

if __name__ == "__main__":  # the CLI: XLA's ptxas logging must be on before jax loads
  from pallas_kernels.h200 import env as _env
  _env.prepare()

from pallas_kernels.h200 import kernel_readings as kr  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = os.path.join(_REPO, "results", "h200_kernel_compile")


def main(argv: Sequence[str] | None = None) -> int:
  """CLI: sweeps the target cases, writes JSON under results/, prints the table."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("only", nargs="*", help="case-name substrings to keep")
  ap.add_argument("--kernel", action="append", help="kernel names (default: all)")
  ap.add_argument("--other-impl", action="store_true",
                  help="also the attention kernel the engine does not pick")
  ap.add_argument("--verify", action="store_true",
                  help="compile every build separately and check each key group reads the same")
  ap.add_argument("--out", default=DEFAULT_DIR, help="folder for the JSON records")
  args = ap.parse_args(argv)
  groups = kr.target_groups(args.kernel, other_impl=args.other_impl, only=args.only)
  say = functools.partial(print, flush=True)
  say(f"{sum(len(g.builds) for g in groups)} builds, {len(groups)} distinct compiles")
  if args.verify:
    result = kr.verify_dedup(groups, progress=say)
    path = os.path.join(args.out, "verify", "dedup.json")
    kr.write_records(result, path)
    bad = [r["compiled_as"] for r in result if not r["agree"]]
    spread = max((r["register_spread"] or 0 for r in result), default=0)
    say(f"{len(result)} multi-case groups; largest register spread {spread}; "
        f"disagreeing: {bad or 'none'}; wrote {path}")
    return 1 if bad else 0
  records = kr.sweep(groups, progress=say)
  path = kr.write_records(records, os.path.join(args.out, "cli.json"))
  say(kr.markdown(records))
  say(f"wrote {path}")
  return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
  raise SystemExit(main())
