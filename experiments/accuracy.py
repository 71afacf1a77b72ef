"""accuracy: train MINI_MLA on the generated tasks, then evaluate every precision
recipe through the serving engine (paged KV cache in bf16 or fp8; weights in bf16,
fp8, int4 round-to-nearest or int4 GPTQ), and the report's disaggregated recipe
through the two-pool engine, and compare with the report's claims.

The trained model and the evaluation sizes are ``mlkit.evals.setups``' (trained once,
then cached by fingerprint; smoke runs train TINY_MLA a few steps in two stages); the
scoring and the claims are ``mlkit.evals.precision``'s. This module runs them and
writes accuracy.{json,md,png} and the training-loss plot.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from experiments import common
from mlkit.evals.precision import (DISAGG, RECIPES, REFERENCE, compare_claims, evaluate_disagg,
                                   evaluate_recipe, quantised_params, serving_config,
                                   serving_params)
from mlkit.evals.setups import EVAL_SETUPS, TRAIN_SETUPS, train_or_load
from mlkit.evals.tasks import packed_batch
from mlkit.measure import machine_info
from mlkit.train import plot_loss


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Trains (or loads) the model, evaluates every recipe, writes JSON, markdown and PNGs.

  Args:
    out_dir: output folder.
    quick: fewer evaluation items (the same trained model as the full run).
    smoke: TINY_MLA trained a few steps in two stages, two recipes and the disaggregated
      one, a handful of items (tests; accuracies are meaningless).

  Returns:
    The JSON record.
  """
  import jax

  from mlkit.evals import EvalConfig
  from mlkit.evals.tasks import eval_sequences, make_examples
  mode = "smoke" if smoke else ("quick" if quick else "full")
  tsetup = TRAIN_SETUPS["smoke" if smoke else "main"]
  esetup = EVAL_SETUPS[mode]
  params_f32, train_info = train_or_load(tsetup, progress=common.progress)
  cfg = serving_config(tsetup.model)
  # The ablation measures the serving model: its multi-token-prediction layers (trained beside
  # it) are not run by the engine, so they are neither quantised nor calibrated here.
  params = serving_params({k: v for k, v in params_f32.items() if k != "mtp"})
  ecfg = EvalConfig(n_per_task=esetup.n_per_task, seed=1234, task_config=esetup.tasks)
  heldout = []
  for i, task in enumerate(ecfg.tasks):
    k = esetup.n_heldout // len(ecfg.tasks)
    heldout += eval_sequences(make_examples(task, k, seed=98765 + i, tc=esetup.tasks))
  calib, _ = packed_batch(np.random.default_rng([4321]), esetup.calib_rows, tsetup.train.seq_len,
                          tc=tsetup.tasks)
  # One prefill bucket and one batch bucket: three compilations per recipe (prefill, decode,
  # teacher forcing) dominate the CPU run time, so fewer shapes beat less padding.
  engine_kwargs = dict(max_seq_tokens=esetup.max_seq_tokens, max_running=esetup.max_running,
                       prefill_chunk=esetup.max_seq_tokens, backend=common.local_backend())
  records, results, ref_lps = {}, {}, None
  chosen = [r for r in RECIPES if esetup.recipes is None or r.name in esetup.recipes]
  order = [REFERENCE] + [r for r in chosen if r != REFERENCE]
  n_total = len(order) + 1
  qparams_cache = {}
  for i, rec in enumerate(order, 1):
    common.progress(f"accuracy: [{i}/{n_total}] {rec.name}")
    if rec.weights not in qparams_cache:
      qparams_cache = {rec.weights: quantised_params(params, rec.weights, cfg, calib)}
    r, lps, res = evaluate_recipe(qparams_cache[rec.weights], cfg, rec, ecfg, heldout,
                                  engine_kwargs=engine_kwargs, ref_logprobs=ref_lps)
    if rec == REFERENCE:
      ref_lps = lps
    records[rec.name], results[rec.name] = r, res
    common.progress("accuracy:   " + ", ".join(
        f"{t} {100 * s['accuracy']:.1f}%" for t, s in r["tasks"].items())
        + f", ppl {r['heldout_answer_ppl']:.3f}, KL {r['kl_mean']:.2e}")
  skipped = {}
  if len(jax.devices()) >= 2:
    common.progress(f"accuracy: [{n_total}/{n_total}] {DISAGG}")
    r, res = evaluate_disagg(params, cfg, ecfg, engine_kwargs=engine_kwargs)
    records[DISAGG], results[DISAGG] = r, res
    common.progress("accuracy:   " + ", ".join(
        f"{t} {100 * s['accuracy']:.1f}%" for t, s in r["tasks"].items()))
  else:
    skipped[DISAGG] = "needs two devices (one per pool)"
    common.progress(f"accuracy: skipping {DISAGG}: {skipped[DISAGG]}")
  claims = compare_claims(records, results)
  record = {
      "experiment": "accuracy", "mode": mode, "machine": machine_info(),
      "kernel_backend": common.local_backend(),
      "config": {"model": cfg.name, "train_fingerprint": tsetup.fingerprint(),
                 "eval_tasks": dataclasses.asdict(esetup.tasks)},
      "model": cfg.to_dict(), "train": {k: v for k, v in train_info.items() if k != "history"},
      "train_history": train_info.get("history", []),
      "eval": {"n_per_task": esetup.n_per_task, "n_heldout": esetup.n_heldout,
               "calib_rows": esetup.calib_rows, "seed": ecfg.seed,
               "task_config": dataclasses.asdict(ecfg.task_config),
               "backend": "mlkit.engine.Engine (paged KV, tag check on)",
               "teacher_forcing": "mlkit.model.apply through a paged pool in the recipe's KV dtype"},
      "recipes": records, "skipped": skipped, "claims": claims,
  }
  common.write_json(out_dir, "accuracy", record)
  _plot(record, os.path.join(out_dir, "accuracy.png"))
  if train_info.get("history"):
    plot_loss(train_info["history"], os.path.join(out_dir, "accuracy_loss.png"),
              title=f"{cfg.name} training loss ({train_info.get('steps')} steps)")
    record["loss_plot"] = "accuracy_loss.png"
  common.write_markdown(out_dir, "accuracy", _markdown(record))
  return record


def _markdown(record: dict) -> str:
  tr = record["train"]
  lines = [f"# accuracy ({record['mode']} mode)", ""]
  if record["mode"] == "smoke":
    lines += ["**Smoke mode**: a tiny model trained a few steps on a handful of items; the "
              "numbers only show that the pipeline runs.", ""]
  elif record["mode"] == "quick":
    lines += [f"**Quick mode**: {record['eval']['n_per_task']} items per task; intervals are "
              "wide. Run with `--full` for the reported numbers.", ""]
  hist = record.get("train_history") or []
  last = f", final loss {hist[-1]['loss']:.3f}" if hist else ""
  stages, st = [], tr
  while st:  # this stage, then its parent, ...
    secs = st.get("train_seconds_this_run")
    stages.append(f"{st.get('steps')} steps"
                  + (f" ({secs:.0f} s)" if secs and not st.get("resumed_from") else ""))
    st = st.get("parent")
  trained = (f"trained {stages[0]}" if len(stages) == 1 else
             f"trained in {len(stages)} stages, {' then '.join(reversed(stages))}")
  lines += [f"Model: `{record['model']['name']}` {trained}{last} "
            f"({'cached' if tr.get('cached') else 'trained in this run'}; train fingerprint "
            f"`{tr.get('fingerprint')}`). Evaluation through `{record['eval']['backend']}`; "
            f"perplexity and KL by teacher forcing through the paged pool. "
            f"Accuracy in %, 95% Wilson intervals; KL(bf16 ref || recipe) in nats per token, over "
            f"every predicted token (KL mean, p99) and over answer tokens only (KL answer mean, "
            f"what the tasks score; prompts hold random keys, operands and cities).", ""]
  if record.get("skipped"):
    lines += [f"Skipped: {', '.join(f'{k} ({v})' for k, v in record['skipped'].items())}.", ""]
  tasks = list(next(iter(record["recipes"].values()))["tasks"])
  headers = ["recipe"] + [f"{t} % [95% CI]" for t in tasks] + [
      "tool validity %", "answer top-1 % [95% CI]", "answer ppl", "KL mean", "KL answer mean",
      "KL p99"]
  rows = []
  for name, r in record["recipes"].items():
    row = [name]
    for t in tasks:
      s = r["tasks"][t]
      row.append(f"{100 * s['accuracy']:.1f} [{100 * s['ci95'][0]:.1f}, {100 * s['ci95'][1]:.1f}]")
    tc = r["tasks"].get("tool_call")
    row.append(f"{100 * tc['validity']:.1f}" if tc else "-")
    if "heldout_answer_top1" in r:
      lo, hi = r["heldout_answer_top1_ci95"]
      row.append(f"{100 * r['heldout_answer_top1']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]")
    else:
      row.append("-")
    row += ["-" if r[k] is None else fmt.format(r[k]) for k, fmt in
            (("heldout_answer_ppl", "{:.4f}"), ("kl_mean", "{:.2e}"),
             ("kl_answer_mean", "{:.2e}"), ("kl_p99", "{:.2e}"))]
    rows.append(row)
  lines += [common.markdown_table(headers, rows), "", "![accuracy per recipe](accuracy.png)", ""]
  sizes = sorted({n for r in record["recipes"].values() for n in r.get("retrieval_by_pairs", {})},
                 key=int)
  if sizes:
    lines += ["Retrieval accuracy (%) by context size (key/value pairs; chance is 1/pairs for "
              "a model that copies some value of the context):", "",
              common.markdown_table(
                  ["recipe"] + [f"{n} pairs" for n in sizes],
                  [[name] + [f"{100 * r['retrieval_by_pairs'][n]:.1f}"
                             if n in r.get("retrieval_by_pairs", {}) else "-" for n in sizes]
                   for name, r in record["recipes"].items()]), ""]
  if record.get("loss_plot"):
    lines += [f"![training loss]({record['loss_plot']})", ""]
  lines += ["## The report's claims", "",
            "Paired differences (b - a) on the same items, in points, with 95% intervals. "
            "`holds`: yes = the whole interval is inside the band; no = wholly outside; "
            "not resolved = the interval is wider than the band (more items needed).", ""]
  lines.append(common.markdown_table(
      ["claim", "task", "a", "b", "delta (pts)", "95% CI (pts)", "holds"],
      [[c["claim"], c["task"], c["a"], c["b"], f"{c['delta_points']:+.1f}",
        f"[{c['ci95_points'][0]:+.1f}, {c['ci95_points'][1]:+.1f}]", c["holds"]]
       for c in record["claims"]]))
  return "\n".join(lines) + "\n"


def _plot(record: dict, path: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(record["recipes"])
  tasks = list(record["recipes"][names[0]]["tasks"])
  fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
  width = 0.8 / len(tasks)
  x = np.arange(len(names))
  for j, t in enumerate(tasks):
    acc = np.array([100 * record["recipes"][n]["tasks"][t]["accuracy"] for n in names])
    lo = np.array([100 * record["recipes"][n]["tasks"][t]["ci95"][0] for n in names])
    hi = np.array([100 * record["recipes"][n]["tasks"][t]["ci95"][1] for n in names])
    ax.bar(x + (j - (len(tasks) - 1) / 2) * width, acc, width, yerr=[acc - lo, hi - acc],
           capsize=2, label=t)
  ax.set_xticks(x)
  ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel("accuracy % (95% Wilson CI)")
  ax.set_title(f"accuracy per recipe ({record['mode']} mode)")
  ax.legend(fontsize=8)
  ax.grid(axis="y", alpha=0.3)
  kl_names = [n for n in names if record["recipes"][n]["kl_mean"] is not None]
  kl = [max(record["recipes"][n]["kl_mean"], 1e-12) for n in kl_names]
  ax2.barh(np.arange(len(kl_names)), kl, color="gray")
  ax2.set_yticks(np.arange(len(kl_names)))
  ax2.set_yticklabels(kl_names, fontsize=8)
  ax2.set_xscale("log")
  ax2.set_xlabel("mean KL vs bf16 (nats/token)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


if __name__ == "__main__":
  import sys
  args = [a for a in sys.argv[1:] if not a.startswith("--")]
  run(args[0] if args else "results", quick="--full" not in sys.argv)
