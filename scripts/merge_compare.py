"""The decode ops compiled for an H200 with either merge of their pieces, side by side.

For each case, compiles ``paged_mla_decode`` / ``paged_gqa_decode`` on the Mosaic
GPU kernels with ``BlockSizes(merge="xla")`` (XLA's one-hot product) and
``merge="kernel"`` (``merge_pieces``), and prints what each compiled program
launches (XLA's thunk sequence) and its temporaries (``memory_analysis()``): the
table in docs/paged_attention.md ("Merging the pieces"). No GPU needed; about a
minute on two cores.

    .venv/bin/python scripts/merge_compare.py [case-name-substring ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.h200 import env  # noqa: E402

env.prepare()  # before jax is imported: XLA's GPU compiler settings

from experiments import kernel_targets as kt  # noqa: E402
from pallas_kernels.h200 import compile as hc  # noqa: E402
from pallas_kernels.paged_attention import BlockSizes  # noqa: E402
from pallas_kernels.paged_attention import ops  # noqa: E402

CASES = ("mla/dp/fp8/b64/ctx4096", "mla/dp/fp8/b8/ctx32768", "mla/dp/fp8/b1/ctx131072",
         "mla/tp8/fp8/b64/ctx32768", "mla/tp8/fp8/b1/ctx131072", "gqa/g8/fp8/b64/ctx4096",
         "gqa/g8/fp8/b1/ctx32768")


def compare(name: str) -> dict:
  """{merge: (launches, temporaries in bytes)} for one target case."""
  case = {c.name: c for c in kt.target_cases(("paged_mla_decode", "paged_gqa_decode"))}[name]
  specs = [None if a is None else hc.spec(*a) for a in case.arg_shapes()]
  op = ops.paged_mla_decode if case.kernel == "paged_mla_decode" else ops.paged_gqa_decode
  out = {}
  for merge in ("xla", "kernel"):
    def fn(*args, merge=merge):
      return op(*args, backend="pallas", block_sizes=BlockSizes(impl="mgpu", merge=merge),
                **case.static_kwargs())
    rep = hc.compile_for_h200(fn, *specs, ptxas_report=False)
    out[merge] = (len(rep.launches), rep.memory.get("temp", 0))
  return out


def main(argv: list[str]) -> int:
  names = [c for c in CASES if not argv or any(a in c for a in argv)]
  print("| case | launches | temporaries (MB) |\n|---|---|---|")
  for name in names:
    r = compare(name)
    (lx, tx), (lk, tk) = r["xla"], r["kernel"]
    print(f"| {name} | {lx} -> {lk} | {tx / 2**20:.2f} -> {tk / 2**20:.2f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
