"""generate: greedy generation from a freshly initialised model, reporting tokens/s.

This is the smoke run of the whole model path (prefill, contiguous cache, decode,
sampling) on the local device. Weights are random, so the tokens are meaningless;
the point is that it runs and how fast.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from configs import SMALL_MLA, TINY_MLA
from experiments import common
from mlkit.generate import generate
from mlkit.model import count_params, init_params
from mlkit.sampling import SamplingParams


def run(out_dir: str, *, quick: bool = True) -> dict:
  cfg = TINY_MLA if quick else dataclasses.replace(SMALL_MLA, dtype="float32", param_dtype="float32")
  batch, prompt_len, new_tokens = (4, 16, 32) if quick else (8, 64, 64)
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
      "machine": common.machine_info(),
      "config": cfg.to_dict(),
      "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
      "decode_tokens_per_second_median": decode_tps,
      "prefill_tokens_per_second_median": prefill_tps,
      "sample_output": runs[-1].tokens[0][:16],
  }
  common.write_json(out_dir, "generate", record)
  md = ("# generate\n\nGreedy generation from a randomly initialised "
        f"`{cfg.name}` on `{record['machine']['device_kind']}` (median of 3 runs after warm-up).\n\n"
        + common.markdown_table(["batch", "prompt", "new tokens", "decode tok/s", "prefill tok/s"],
                                [[batch, prompt_len, new_tokens, decode_tps, prefill_tps]]))
  common.write_markdown(out_dir, "generate", md)
  print(f"decode: {decode_tps:,.1f} tok/s, prefill: {prefill_tps:,.1f} tok/s ({cfg.name}, batch {batch})")
  return record
