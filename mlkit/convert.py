"""``python -m mlkit.convert SRC DST --recipe NAME [--format F]``: a Hugging Face checkpoint ->
a quantised orbax one, or a Hugging Face one in a published quantised format.

The command line of :func:`mlkit.checkpoint.convert.convert_hf_checkpoint` (orbax)
and :func:`~mlkit.checkpoint.convert.export_hf_checkpoint` (Hugging Face); see
their docstrings and docs/checkpoints.md. Exit status: 0 done, 1 the conversion
failed (bad input, I/O; the message names the file), 2 a bad command line.
"""

from __future__ import annotations

import argparse
import errno
import sys

_DESCRIPTION = """\
Converts a Hugging Face checkpoint (DeepSeek-V3 / Kimi-K2 / GLM-5 layout: config.json and
*.safetensors) into a quantised orbax checkpoint that mlkit.checkpoint.load_checkpoint
loads directly, bit-identical to load_hf_checkpoint(SRC, recipe=...) and without
reading or quantising the source again.

SRC may be dense or quantised as publishers ship it (compressed-tensors INT4,
FP8 with 128x128 block scales): its formats are kept unless the recipe converts
them (FP8 -> INT4 experts; INT4 -> FP8 is refused).

Resumable (orbax output): converted tensors are staged in DST.convert-staging/, one
file set per tensor with its CRC-32. An interrupted run (killed, out of disk) leaves
no DST; running the same command again reuses the staged tensors that still match
their checksums and converts only the rest. DST appears only once complete.

--format compressed-tensors | fp8-block | dense writes a Hugging Face checkpoint
instead (INT4 weights pack-quantized, FP8 weights with block scales, the rest
dense), which engines that read those formats load; it holds the model in host
memory and is not resumable."""

_EPILOG = """\
recipes:
{recipes}

GPTQ ({gptq}) is not offered: it needs calibration activations from running the
loaded model, which a conversion does not have. Convert with round to nearest, or
load the dense checkpoint, collect calibration (mlkit.quant.collect_calibration)
and quantise with mlkit.quant.quantize_params.

examples:
  python -m mlkit.convert /ckpt/Kimi-K2 /ckpt/kimi-k2-int4 --recipe int4-experts-g32 \\
      --mesh tensor=8
  python -m mlkit.convert /ckpt/GLM-FP8 /ckpt/glm-int4-hf --recipe int4-experts-g32 \\
      --format compressed-tensors"""

_RECIPE_HELP = {
    "bf16": "nothing (re)quantised: dense weights in the source's or --dtype's dtype, "
            "published INT4/FP8 ones as stored",
    "int4-experts-g32": "routed experts INT4 (RTN, group 32, bf16 scales); the rest dense",
    "int4-experts-g32-fp8-rest": "routed experts INT4 (RTN, group 32); attention, shared experts and "
                                 "dense FFNs FP8 (128x128 blocks)",
    "fp8-all": "every attention/FFN/expert projection FP8 (128x128 block scales)",
}


_HF_FORMATS = ("compressed-tensors", "fp8-block", "dense")


def _recipes() -> tuple[list[str], list[str]]:
  """(round-to-nearest recipe names, GPTQ recipe names) in mlkit.quant.RECIPES."""
  from mlkit.quant import RECIPES, Int4Spec
  def gptq(r):
    return any(isinstance(rule.spec, Int4Spec) and rule.spec.method == "gptq" for rule in r.rules)
  return ([n for n, r in RECIPES.items() if not gptq(r)], [n for n, r in RECIPES.items() if gptq(r)])


def _parse_mesh(text: str):
  """"tensor=8,expert=2" -> a device-free AbstractMesh of those mlkit.parallel axes."""
  from jax.sharding import AbstractMesh
  from mlkit.parallel import AXES, MeshConfig
  sizes = {}
  for part in text.split(","):
    key, sep, value = part.partition("=")
    if not sep or key.strip() not in AXES or not value.strip().isdigit():
      raise argparse.ArgumentTypeError(f"expected AXIS=N[,AXIS=N...] with AXIS in {AXES}, got {text!r}")
    sizes[key.strip()] = int(value)
  try:
    config = MeshConfig(**sizes)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return AbstractMesh(config.shape, AXES)


def build_parser() -> argparse.ArgumentParser:
  rtn, gptq = _recipes()
  recipes = "\n".join(f"  {n:28s} {_RECIPE_HELP.get(n, '')}" for n in rtn)
  parser = argparse.ArgumentParser(
      prog="python -m mlkit.convert", description=_DESCRIPTION,
      epilog=_EPILOG.format(recipes=recipes, gptq=", ".join(gptq) or "none"),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("src", metavar="SRC", help="Hugging Face checkpoint directory")
  parser.add_argument("dst", metavar="DST", help="orbax checkpoint directory to write")
  parser.add_argument("--recipe", required=True, metavar="NAME",
                      help="weight formats, one of the recipes below")
  parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                      help="parameter dtype (default: config.json's torch_dtype, else the tensors'); "
                           "narrowing f32 tensors to bf16 must be asked for here")
  parser.add_argument("--format", default="orbax", choices=("orbax", *_HF_FORMATS),
                      help="output: an orbax checkpoint (default, resumable) or a Hugging Face "
                           "checkpoint: compressed-tensors (INT4 pack-quantized), fp8-block (FP8 "
                           "with 128x128 block scales) or dense")
  parser.add_argument("--mesh", type=_parse_mesh, metavar="AXIS=N,...",
                      help="serving mesh to plan for, e.g. tensor=8 or data=1,tensor=4,expert=2: "
                           "shardings checked before reading and bytes per device reported (no "
                           "devices needed; the checkpoint loads on any mesh)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace an existing DST (only once the new checkpoint is fully staged)")
  parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs the command; returns the exit status (0 done, 1 failed, 2 bad command line)."""
  parser = build_parser()
  args = parser.parse_args(argv)
  rtn, gptq = _recipes()
  if args.recipe in gptq:
    parser.error(f"recipe {args.recipe!r} uses GPTQ, which needs calibration activations that a "
                 f"conversion does not have; use a round-to-nearest recipe ({', '.join(rtn)})")
  if args.recipe not in rtn:
    parser.error(f"unknown recipe {args.recipe!r}; choose one of: {', '.join(rtn)}")
  if args.format != "orbax" and args.mesh is not None:
    parser.error("--mesh plans an orbax checkpoint's serving layout; it does not apply to "
                 f"--format {args.format}")
  from mlkit.checkpoint import CheckpointError
  from mlkit.checkpoint.convert import convert_hf_checkpoint, export_hf_checkpoint

  def say(line: str) -> None:
    if not args.quiet:
      print(line, file=sys.stderr, flush=True)

  try:
    if args.format == "orbax":
      convert_hf_checkpoint(args.src, args.dst, recipe=args.recipe, dtype=args.dtype,
                            mesh=args.mesh, overwrite=args.overwrite, progress=say)
    else:
      export_hf_checkpoint(args.src, args.dst, recipe=args.recipe, format=args.format,
                           dtype=args.dtype, overwrite=args.overwrite, progress=say)
  except (CheckpointError, FileNotFoundError, FileExistsError, ValueError) as e:
    print(f"mlkit.convert: error: {e}", file=sys.stderr)
    return 1
  except OSError as e:
    hint = " (no space left on device)" if e.errno == errno.ENOSPC else ""
    print(f"mlkit.convert: error{hint}: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  # Before jax loads its backends: the CPU on a machine without a GPU, so the CUDA plugin
  # (installed for deviceless H200 compiles) does not probe for a driver and print a
  # cuDNN traceback (docs/h200_compile.md).
  from pallas_kernels.h200 import env as h200_env
  h200_env.prepare(ptxas_report=False)
  sys.exit(main())
