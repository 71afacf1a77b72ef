"""generate: greedy generation from a freshly initialised model, reporting tokens/s.

This is the smoke run of the whole model path (prefill, contiguous cache, decode,
sampling) on the local device. Weights are random, so the tokens are meaningless;
the point is that it runs and how fast.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from configs import SMALL_MLA, TINY_MLA
from experiments import common
from mlkit.generate import generate
from mlkit.measure import machine_info
from mlkit.model import count_params, init_params
from mlkit.sampling import SamplingParams


def _plot(path: str, runs, batch: int) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  xs = range(1, len(runs) + 1)
  ax.plot(xs, [r.decode_tokens_per_second for r in runs], marker="o", label="decode")
  ax.plot(xs, [batch * r.new_tokens / max(r.prefill_seconds + r.decode_seconds, 1e-9)
               for r in runs], marker="s", label="end to end (new tokens)")
  ax.set_xlabel("timed run (after warm-up)")
  ax.set_ylabel("tokens/s")
  ax.set_ylim(bottom=0)
  ax.set_title("Greedy generation, contiguous cache")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Generates from a random model; writes generate.{json,md,png}.

  Args:
    out_dir: folder for the results.
    quick: TINY_MLA (else SMALL_MLA in f32).
    smoke: TINY_MLA with a tiny batch, to test the experiment itself in seconds.

  Returns:
    The JSON record.
  """
  cfg = TINY_MLA if quick or smoke else dataclasses.replace(SMALL_MLA, dtype="float32",
                                                             param_dtype="float32")
  batch, prompt_len, new_tokens = (2, 8, 8) if smoke else (4, 16, 32) if quick else (8, 64, 64)
  common.progress(f"generate: {cfg.name} ({count_params(cfg) / 1e6:.2f}M params), batch {batch}, "
                  f"prompt {prompt_len}, {new_tokens} new tokens")
  params = init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
  sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
  common.progress("generate: warm-up (compiles prefill and decode)")
  generate(params, cfg, prompts, sp)
  runs = []
  for i in range(3):
    res = generate(params, cfg, prompts, sp)
    runs.append(res)
    common.progress(f"generate: run {i + 1}/3: {res.decode_tokens_per_second:,.1f} decode tok/s")
  decode_tps = float(np.median([r.decode_tokens_per_second for r in runs]))
  prefill_tps = float(np.median([batch * prompt_len / r.prefill_seconds for r in runs]))
  record = {
      "experiment": "generate",
      "machine": machine_info(),
      "config": cfg.to_dict(),
      "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
      "decode_tokens_per_second_median": decode_tps,
      "prefill_tokens_per_second_median": prefill_tps,
      "sample_output": runs[-1].tokens[0][:16],
  }
  common.write_json(out_dir, "generate", record)
  _plot(os.path.join(out_dir, "generate.png"), runs, batch)
  md = ("# generate\n\nGreedy generation from a randomly initialised "
        f"`{cfg.name}` on `{record['machine']['device_kind']}` (median of 3 runs after warm-up).\n\n"
        + common.markdown_table(["batch", "prompt", "new tokens", "decode tok/s", "prefill tok/s"],
                                [[batch, prompt_len, new_tokens, decode_tps, prefill_tps]])
        + "\n![generate](generate.png)\n")
  common.write_markdown(out_dir, "generate", md)
  print(f"decode: {decode_tps:,.1f} tok/s, prefill: {prefill_tps:,.1f} tok/s ({cfg.name}, batch {batch})")
  return record
