"""speculative: MTP speculative decoding on the MTP-trained model: acceptance and decode speed.

The accuracy experiment's model (MINI_MLA trained with its multi-token-prediction
loss; trained first if not cached, ~1 h) is served in f32 through the Engine
(``mlkit.evals.speculation.serve``), greedy, with EOS stops:

* **acceptance by task**: each task's evaluation prompts at concurrency 8, with
  k = 1, 2, 3 drafts per step: the acceptance length (tokens per verify row:
  accepted drafts plus one), its histogram, and whether the outputs equal those
  of k = 0;
* **decode speed**: the tool-call prompts (64-token answers) at concurrency 1, 8
  and 32, k = 0 against the best k of the acceptance runs: output tok/s on this
  machine and the ratio;
* **modelled** at the report's GLM 5.2 deployment (``mlkit.perfmodel.
  speculative_decode_step``: bytes read per step by the verify pass and the
  drafter against a plain decode step) with the acceptance measured here and with
  vLLM's GLM 5 figure.

Writes speculative.{json,md,png}.
"""

from __future__ import annotations

import dataclasses

from experiments import common

TASKS = ("arithmetic", "retrieval", "tool_call")
# vLLM's GLM 5 recipe: three MTP drafts, average acceptance length 1.64.
VLLM_GLM5_ACCEPTANCE = 1.64
SHAPES = {
    "smoke": dict(setup="smoke", items=3, ks=(2,), concurrency=(2,), accept_concurrency=2),
    "quick": dict(setup="main", items=24, ks=(1, 2, 3), concurrency=(1, 8, 32),
                  accept_concurrency=8),
    "full": dict(setup="main", items=64, ks=(1, 2, 3), concurrency=(1, 8, 32),
                 accept_concurrency=8),
}


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  from mlkit.evals import setups
  from mlkit.evals.harness import MAX_NEW_TOKENS
  from mlkit.evals.speculation import serve
  from mlkit.evals.tasks import make_examples
  from mlkit.evals.tokenizer import EOS, CharTokenizer
  from mlkit.sampling import SamplingParams

  shape = SHAPES["smoke" if smoke else ("quick" if quick else "full")]
  setup = setups.TRAIN_SETUPS[shape["setup"]]
  params, _ = setups.train_or_load(setup, progress=common.progress)
  # f32, so that every k picks the same greedy tokens.
  cfg = dataclasses.replace(setup.model, dtype="float32", param_dtype="float32")
  backend = common.local_backend()
  tok = CharTokenizer()
  tc = setups.EVAL_SETUPS["quick"].tasks
  prompts, samplings = {}, {}
  for task in TASKS:
    examples = make_examples(task, shape["items"], seed=1234, tc=tc)
    prompts[task] = [tok.encode(ex.prompt, bos=True) for ex in examples]
    samplings[task] = SamplingParams(max_new_tokens=MAX_NEW_TOKENS[task], stop_tokens=(EOS,))

  acceptance = {}
  c = shape["accept_concurrency"]
  for task in TASKS:
    base = serve(params, cfg, prompts[task], samplings[task], k=0, concurrency=c,
                 backend=backend)
    acceptance[task] = {}
    for k in shape["ks"]:
      r = serve(params, cfg, prompts[task], samplings[task], k=k, concurrency=c, backend=backend)
      spec = r.speculation
      acceptance[task][k] = dict(r.to_json(), identical=r.outputs == base.outputs,
                                 base_decode_steps=base.decode_steps)
      common.progress(f"speculative: {task}, k={k}: acceptance length "
                      f"{spec.get('acceptance_length', 1.0):.2f}, histogram "
                      f"{spec.get('accepted_histogram')}, outputs "
                      f"{'identical' if r.outputs == base.outputs else 'DIFFER'} to k=0")
  # The k whose mean acceptance length over the tasks is highest.
  best_k = max(shape["ks"], key=lambda k: sum(
      acceptance[t][k]["speculation"].get("acceptance_length", 1.0) for t in TASKS))

  speed = []
  task = "tool_call"
  for conc in shape["concurrency"]:
    n = max(len(prompts[task]), conc)
    ps = (prompts[task] * (-(-n // len(prompts[task]))))[:n]
    runs = {k: serve(params, cfg, ps, samplings[task], k=k, concurrency=conc, backend=backend)
            for k in (0, best_k)}
    row = {"concurrency": conc, "k": best_k, "tok_s_off": runs[0].tok_s,
           "tok_s_on": runs[best_k].tok_s, "speedup": runs[best_k].tok_s / runs[0].tok_s,
           "identical": runs[best_k].outputs == runs[0].outputs,
           "acceptance_length": runs[best_k].speculation.get("acceptance_length", 1.0)}
    speed.append(row)
    common.progress(f"speculative: concurrency {conc}: {row['tok_s_off']:.0f} tok/s without, "
                    f"{row['tok_s_on']:.0f} with k={best_k} ({row['speedup']:.2f}x)")

  # Modelled at the report's GLM 5.2 deployment (GLM ships one MTP layer): the acceptance
  # measured here per k (mean over the tasks), and vLLM's GLM 5 recipe figure (k = 3, 1.64).
  from mlkit import perfmodel as pm
  from mlkit.report.deployments import GLM, GLM_WORK
  cases = [(k, sum(acceptance[t][k]["speculation"].get("acceptance_length", 1.0)
                   for t in TASKS) / len(TASKS), "measured here") for k in shape["ks"]]
  cases.append((3, VLLM_GLM5_ACCEPTANCE, "vLLM GLM 5 recipe"))
  modelled = []
  for k, al, source in cases:
    for conc in (1, 8, 32):
      m = pm.speculative_decode_step(GLM, conc, GLM_WORK, k, al)
      modelled.append({"k": k, "acceptance_length": al, "source": source, "concurrency": conc,
                       "plain_tok_s": m["plain_tok_s"], "tok_s": m["tok_s"],
                       "speedup": m["speedup"], "verify_gb": m["verify"]["bytes"] / 1e9,
                       "draft_gb": m["draft"]["bytes"] / 1e9})

  record = common.record_header("speculative", quick=quick, smoke=smoke, config={
      "model": cfg.name, "setup": shape["setup"], "items_per_task": shape["items"],
      "ks": list(shape["ks"]), "acceptance_concurrency": c,
      "speed_concurrency": list(shape["concurrency"]), "speed_task": task, "best_k": best_k})
  record["acceptance"] = {t: {str(k): v for k, v in ks.items()} for t, ks in acceptance.items()}
  record["speed"] = speed
  record["modelled"] = {"deployment": GLM.name, "workload": dataclasses.asdict(GLM_WORK),
                        "rows": modelled}
  common.write_json(out_dir, "speculative", record)
  common.plot_lines(f"{out_dir}/speculative.png", {
      "k = 0": ([r["concurrency"] for r in speed], [r["tok_s_off"] for r in speed]),
      f"k = {best_k}": ([r["concurrency"] for r in speed], [r["tok_s_on"] for r in speed])},
      xlabel="concurrency", ylabel="output tok/s", logx=True,
      title=f"MTP speculative decoding, {cfg.name} on {common.local_backend()}")
  rows = [[t, k, f"{v['speculation'].get('acceptance_length', 1.0):.2f}",
           str(v["speculation"].get("accepted_histogram")), v["decode_steps"],
           v["base_decode_steps"], "yes" if v["identical"] else "NO"]
          for t, ks in acceptance.items() for k, v in ks.items()]
  md = (f"# speculative: MTP drafts on {cfg.name}\n\n"
        f"Greedy, f32, EOS stops, {shape['items']} evaluation prompts per task. "
        "`python -m experiments speculative`.\n\n"
        f"## Acceptance by task (concurrency {c})\n\n"
        + common.markdown_table(["task", "k", "acceptance length", "rows by drafts accepted",
                                 "decode steps", "decode steps (k=0)", "same tokens as k=0"],
                                rows)
        + f"\n\n## Decode speed ({task} prompts)\n\n"
        + common.markdown_table(["concurrency", "k", "tok/s (k=0)", "tok/s (speculative)",
                                 "speedup", "acceptance length", "same tokens"],
                                [[r["concurrency"], r["k"], f"{r['tok_s_off']:.0f}",
                                  f"{r['tok_s_on']:.0f}", f"{r['speedup']:.2f}",
                                  f"{r['acceptance_length']:.2f}",
                                  "yes" if r["identical"] else "NO"] for r in speed])
        + f"\n\n## Modelled on the report's {GLM.name} (8x H200, `mlkit.perfmodel`)\n\n"
        "Bytes each GPU reads per step (verify pass + k drafter passes) against a plain "
        "decode step; not calibrated.\n\n"
        + common.markdown_table(["k", "acceptance length", "source", "concurrency",
                                 "plain tok/s", "speculative tok/s", "speedup",
                                 "verify GB/GPU", "draft GB/GPU"],
                                [[r["k"], f"{r['acceptance_length']:.2f}", r["source"],
                                  r["concurrency"], f"{r['plain_tok_s']:.0f}",
                                  f"{r['tok_s']:.0f}", f"{r['speedup']:.2f}",
                                  f"{r['verify_gb']:.1f}", f"{r['draft_gb']:.2f}"]
                                 for r in modelled])
        + "\n\n![speculative](speculative.png)\n")
  common.write_markdown(out_dir, "speculative", md)
  return record
