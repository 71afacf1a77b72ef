"""The decode ops compiled for an H200 with each merge of their pieces, side by side.

For each case, compiles ``paged_mla_decode`` / ``paged_gqa_decode`` on the Mosaic
GPU kernels with ``BlockSizes(merge="xla")`` (XLA's one-hot product),
``merge="triton"`` (``merge_pieces``) and ``merge="mgpu"`` (``merge_pieces_mgpu``,
the default), and prints what each compiled program launches (XLA's thunk
sequence), its temporaries (``memory_analysis()``) and, for the Mosaic GPU merge,
whether the decode kernel is the launch right before it (the kernel its
programmatic launch overlaps): the table in docs/paged_attention.md ("Merging the
pieces"). No GPU needed; about two minutes on two cores.

    .venv/bin/python scripts/merge_compare.py [case-name-substring ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.h200 import env  # noqa: E402

env.prepare()  # before jax is imported: XLA's GPU compiler settings

from pallas_kernels import targets as kt  # noqa: E402
from pallas_kernels.h200 import compile as hc  # noqa: E402
from pallas_kernels.paged_attention import BlockSizes  # noqa: E402
from pallas_kernels.paged_attention import ops  # noqa: E402

CASES = ("mla/dp/fp8/b64/ctx4096", "mla/dp/fp8/b8/ctx32768", "mla/dp/fp8/b1/ctx131072",
         "mla/tp8/fp8/b64/ctx32768", "mla/tp8/fp8/b1/ctx131072", "gqa/g8/fp8/b64/ctx4096",
         "gqa/g8/fp8/b1/ctx32768")


MERGES = ("xla", "triton", "mgpu")


def compare(name: str) -> dict:
  """{merge: (launches, temporaries in bytes, the launches' names)} for one target case."""
  case = {c.name: c for c in kt.target_cases(("paged_mla_decode", "paged_gqa_decode"))}[name]
  specs = [None if a is None else hc.spec(*a) for a in case.arg_shapes()]
  op = ops.paged_mla_decode if case.kernel == "paged_mla_decode" else ops.paged_gqa_decode
  out = {}
  for merge in MERGES:
    def fn(*args, merge=merge):
      return op(*args, backend="pallas", block_sizes=BlockSizes(impl="mgpu", merge=merge),
                **case.static_kwargs())
    rep = hc.compile_for_h200(fn, *specs, ptxas_report=False)
    out[merge] = (len(rep.launches), rep.memory.get("temp", 0), rep.launches)
  return out


def main(argv: list[str]) -> int:
  names = [c for c in CASES if not argv or any(a in c for a in argv)]
  print("| case | launches (xla -> triton -> mgpu) | temporaries (MB) | decode kernel "
        "right before the mgpu merge |\n|---|---|---|---|")
  for name in names:
    r = compare(name)
    launches = " -> ".join(str(r[m][0]) for m in MERGES)
    temps = " -> ".join(f"{r[m][1] / 2**20:.2f}" for m in MERGES)
    seq = r["mgpu"][2]
    # Both Pallas kernels are custom calls; the merge is the op's last launch.
    adjacent = seq[-2:] == ("kCustomCall", "kCustomCall")
    print(f"| {name} | {launches} | {temps} | {'yes' if adjacent else 'no: ' + str(seq)} |",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
