"""speculative: MTP speculative decoding on the MTP-trained model: acceptance and decode speed.

The accuracy experiment's model (MINI_MLA trained with its multi-token-prediction
loss; trained first if not cached) is served in f32 through the Engine, greedy,
with EOS stops (``mlkit.evals.speculation.measure``):

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
  vLLM's GLM 5 figure;
* **compiled for 8x H200** (``mlkit.plan.step_compile.speculative_plan``): the
  verify step with the best k beside the plain decode step at Kimi K2.6's shapes
  with one MTP layer: per-GPU memory and kernels per step, read at the full depth.

``python -m mlkit.evals.speculation --setup stage1`` measures the same on the main
model's first training stage (~20 min to train). Writes speculative.{json,md,png}.
"""

from __future__ import annotations

from experiments import common
from mlkit.plan import step_compile as sc
from mlkit.plan import step_memory as sm

SHAPES = {
    # The speed runs reuse the acceptance runs' engine configuration: no compiles of their own.
    "smoke": dict(setup="smoke", items=3, ks=(2,), concurrency=(2,), accept_concurrency=2,
                  one_engine_size=True),
    "quick": dict(setup="main", items=24, ks=(1, 2, 3), concurrency=(1, 8, 32),
                  accept_concurrency=8),
    "full": dict(setup="main", items=64, ks=(1, 2, 3), concurrency=(1, 8, 32),
                 accept_concurrency=8),
}


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  from mlkit.evals.speculation import measure

  shape = dict(SHAPES["smoke" if smoke else ("quick" if quick else "full")])
  res = measure(shape.pop("setup"), **shape, backend=common.local_backend(),
                progress=common.progress)
  record = common.record_header("speculative", quick=quick, smoke=smoke, config={
      "model": res["model"], "setup": res["setup"], "items_per_task": res["items_per_task"],
      "ks": list(shape["ks"]), "acceptance_concurrency": res["acceptance_concurrency"],
      "speed_concurrency": list(shape["concurrency"]), "speed_task": res["speed_task"],
      "best_k": res["best_k"]})
  record.update(acceptance=res["acceptance"], speed=res["speed"], modelled=res["modelled"])
  # The verify step beside the plain decode step, compiled for 8x H200 (no GPU needed).
  plan = sc.speculative_plan(smoke, k=res["best_k"])
  mesh = sc.h200_mesh()
  _, jobs = sc.plan_jobs(plan, mesh, common.progress)
  compiled = sm.kind_rows(plan, sc.compile_all(jobs, plan, mesh, common.progress))
  record["h200_compile"] = {"plan": plan.summary(), "rows": compiled}
  common.write_json(out_dir, "speculative", record)

  speed, best_k, modelled = res["speed"], res["best_k"], res["modelled"]
  unit = sm.unit_for(plan.hbm_bytes)
  scale = 1e9 if unit == "GB" else 1e6
  common.plot_lines(f"{out_dir}/speculative.png", {
      "k = 0": ([r["concurrency"] for r in speed], [r["tok_s_off"] for r in speed]),
      f"k = {best_k}": ([r["concurrency"] for r in speed], [r["tok_s_on"] for r in speed])},
      xlabel="concurrency", ylabel="output tok/s", logx=True,
      title=f"MTP speculative decoding, {res['model']} on {common.local_backend()}")
  rows = [[t, k, f"{v['speculation'].get('acceptance_length', 1.0):.2f}",
           str(v["speculation"].get("accepted_histogram")), v["decode_steps"],
           v["base_decode_steps"], "yes" if v["identical"] else "NO"]
          for t, ks in res["acceptance"].items() for k, v in ks.items()]
  md = (f"# speculative: MTP drafts on {res['model']}\n\n"
        f"Greedy, f32, EOS stops, {res['items_per_task']} evaluation prompts per task. "
        "`python -m experiments speculative`.\n\n"
        f"## Acceptance by task (concurrency {res['acceptance_concurrency']})\n\n"
        + common.markdown_table(["task", "k", "acceptance length", "rows by drafts accepted",
                                 "decode steps", "decode steps (k=0)", "same tokens as k=0"],
                                rows)
        + f"\n\n## Decode speed ({res['speed_task']} prompts)\n\n"
        + common.markdown_table(["concurrency", "k", "tok/s (k=0)", "tok/s (speculative)",
                                 "speedup", "acceptance length", "same tokens"],
                                [[r["concurrency"], r["k"], f"{r['tok_s_off']:.0f}",
                                  f"{r['tok_s_on']:.0f}", f"{r['speedup']:.2f}",
                                  f"{r['acceptance_length']:.2f}",
                                  "yes" if r["identical"] else "NO"] for r in speed])
        + f"\n\n## Modelled on the report's {modelled['deployment']} (8x H200, "
        "`mlkit.perfmodel`)\n\n"
        "Bytes each GPU reads per step (verify pass + k drafter passes) against a plain "
        "decode step; not calibrated.\n\n"
        + common.markdown_table(["k", "acceptance length", "source", "concurrency",
                                 "plain tok/s", "speculative tok/s", "speedup",
                                 "verify GB/GPU", "draft GB/GPU"],
                                [[r["k"], f"{r['acceptance_length']:.2f}", r["source"],
                                  r["concurrency"], f"{r['plain_tok_s']:.0f}",
                                  f"{r['tok_s']:.0f}", f"{r['speedup']:.2f}",
                                  f"{r['verify_gb']:.1f}", f"{r['draft_gb']:.2f}"]
                                 for r in modelled["rows"]])
        + f"\n\n## The verify step compiled for 8x H200 (k = {plan.speculative_tokens})\n\n"
        f"{compiled[0]['variant']}, {plan.kv_dtypes[0]} KV, {plan.concurrency} rows, "
        "compiled at the dense prefix plus "
        f"{' and '.join(map(str, plan.moe_depths))} MoE layers by XLA's GPU compiler on this "
        "CPU (`mlkit.plan.step_compile`, as `h200_compile`) and read at the full depth: "
        "per-GPU bytes from XLA's memory analysis, kernels from its thunk dump. The verify "
        "step runs the model over k + 1 tokens per row, then the MTP layer k times.\n\n"
        + common.markdown_table(
            ["step", "tokens per row", "args " + unit, "temporaries " + unit, "peak " + unit,
             "kernels per step", "kernels per MoE layer"],
            [[r["kind"], r["tokens"], f"{r['argument'] / scale:.2f}",
              f"{r['temp'] / scale:.2f}", f"{r['peak'] / scale:.2f}", f"{r['launches']:,}",
              f"{r['launches_per_moe_layer']:.0f}"] for r in compiled])
        + "\n\n![speculative](speculative.png)\n")
  common.write_markdown(out_dir, "speculative", md)
  return record
