"""Which kernels one GPU runs, at which shapes, in a serving step compiled for 8 H200s.

A Pallas kernel is one custom call that XLA cannot split; where its operands are
split over the mesh, XLA gathers them and every GPU runs the whole call. This
script compiles one decode or prefill step of a full-size model at a reduced
depth (``mlkit.plan.step_compile``'s set-up: 8 H200s, tensor parallelism 8,
the report's decode batch and pool) and prints, per GPU:

- every Mosaic GPU and Triton kernel call with its result shape;
- every all-gather XLA inserted (and its operand shapes);
- XLA's memory analysis: arguments and temporaries.

No GPU is needed (the compile is deviceless; docs/h200_compile.md).

    .venv/bin/python scripts/step_kernels.py [--model kimi|glm] [--recipe int4-all]
        [--kv float8_e4m3fn] [--kind decode] [--depth 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.h200 import env  # noqa: E402

env.prepare(ptxas_report=False)

from mlkit.plan import step_compile as sc  # noqa: E402
from mlkit.quant import RECIPES, int4_all  # noqa: E402
from pallas_kernels.h200.step_placement import kernel_rows, step_placement  # noqa: E402

# Recipes by name: the registry's, plus the all-INT4 ablation.
_RECIPES = dict(RECIPES, **{"int4-all": int4_all(32)})
_MODELS = {"kimi": sc.KIMI, "glm": sc.GLM_FP8}


def step_kernels(model: str, recipe: str, kv: str, kind: str, depth: int) -> dict:
  """Compiles the step and returns per GPU :func:`step_placement`'s fields and XLA's
  "argument_bytes" and "temp_bytes"."""
  plan = sc.plan_for(quick=False, smoke=False)
  mesh = sc.h200_mesh()
  v = dataclasses.replace(_MODELS[model], recipe=_RECIPES[recipe])
  pages = plan.concurrency * sc.pages_per_request(v.work)
  lowered, _ = sc.lower(v, kv, kind, depth, pages, plan, mesh)
  compiled = lowered.compile(sc.COMPILE_OPTIONS)
  ma = compiled.memory_analysis()
  return dict(step_placement(compiled.as_text()), argument_bytes=ma.argument_size_in_bytes,
              temp_bytes=ma.temp_size_in_bytes)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", choices=sorted(_MODELS), default="kimi")
  ap.add_argument("--recipe", choices=sorted(_RECIPES), default="int4-all")
  ap.add_argument("--kv", choices=sc.KV_DTYPES, default="float8_e4m3fn")
  ap.add_argument("--kind", choices=sc.KINDS, default="decode")
  ap.add_argument("--depth", type=int, default=1, help="MoE layers after the dense ones")
  args = ap.parse_args(argv)
  out = step_kernels(args.model, args.recipe, args.kv, args.kind, args.depth)
  print(f"{args.model} {args.recipe} {args.kv} {args.kind}, {args.depth} MoE layer(s), per GPU:")
  for name, target, result, layers, calls in kernel_rows(out["kernels"]):
    print(f"  kernel {name} ({target}): {result.strip('`')}, {calls} call(s) in {layers}")
  for g in out["all_gathers"]:
    print(f"  all-gather: {g['result']} ({g['bytes']:,} B)")
  print(f"  arguments {out['argument_bytes'] / 1e9:.2f} GB, temporaries "
        f"{out['temp_bytes'] / 1e9:.2f} GB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
