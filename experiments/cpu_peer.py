"""cpu_peer: the serving Engine beside Hugging Face transformers, on one checkpoint, on this CPU.

One Hugging Face checkpoint (DeepSeek-V3 layout, written by ``save_hf_checkpoint``) is
served twice with the same workload, in the same run: by ``mlkit.engine.Engine`` (loaded
back with ``load_hf_checkpoint``) and by transformers (eager PyTorch, float32) in a
worker process started with ``$MLKIT_PEER_PYTHON`` (``mlkit.peer.compare``; without
torch and transformers there, the peer is skipped and the report says why). Each side
generates ``new_tokens`` greedy tokens for every prompt of a batch; the report gives
tokens/s for both, their ratio, and whether the greedy tokens are identical. The two
sides alternate run by run, so both see the same machine load; medians are reported.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import jax
import numpy as np

from configs import SMALL_MLA
from experiments import common
from mlkit.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from mlkit.config import ModelConfig
from mlkit.model import count_params, init_params
from mlkit.peer.compare import (TARGET_RATIO, PeerWorker, Workload, batch_row, engine_config,
                                peer_python, peer_unavailable, run_engine)

# The checkpoint, SMALL_MLA's layout at 4 layers (the first dense) and hidden 512:
# DeepSeek-V3 layout, 8 MLA heads (nope 64, rope 32, v 64, q_lora and kv_lora 128), 16 routed
# experts of 256 top-4 plus a shared one, vocabulary 8192, float32: 32.6M params.
CPU_PEER_MLA = dataclasses.replace(
    SMALL_MLA, name="cpu-peer-mla", vocab_size=8192, d_model=512, n_layers=4,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
    dtype="float32", param_dtype="float32")


def workload(quick: bool, smoke: bool) -> tuple[ModelConfig, Workload]:
  """The model and workload of a mode (smoke: TINY_MLA cut to one MoE layer, seconds)."""
  if smoke:
    return common.local_model(quick, smoke=True), Workload((2,), 8, 4, 1)
  return CPU_PEER_MLA, Workload((8, 32), 128, 64, 3 if quick else 7)


def run(out_dir: str, *, quick: bool = True, smoke: bool = False) -> dict:
  """Serves one checkpoint through the Engine and through transformers; writes cpu_peer.*.

  Args:
    out_dir: folder for the results.
    quick: 3 timed runs per side and batch (full: 7).
    smoke: a one-layer tiny model, one batch of 2 and 4 tokens, to test the experiment.

  Returns:
    The JSON record (``peer_skipped`` holds the reason when transformers is unavailable).
  """
  cfg, wl = workload(quick, smoke)
  threads = os.cpu_count() or 1
  rng = np.random.default_rng(0)
  common.progress(f"cpu_peer: {cfg.name} ({count_params(cfg) / 1e6:.1f}M params, {cfg.dtype}), "
                  f"batches {list(wl.batches)} x {wl.prompt_len}-token prompts x "
                  f"{wl.new_tokens} greedy tokens, {wl.repeats} timed run(s) per side")
  python = peer_python()
  skipped = peer_unavailable(python)
  if skipped:
    common.progress(f"cpu_peer: {skipped}")
  rows, peer_info = [], None
  load_before = os.getloadavg()
  with tempfile.TemporaryDirectory(prefix="cpu_peer_ckpt_") as ckpt:
    save_hf_checkpoint(ckpt, init_params(cfg, jax.random.key(0)), cfg)
    params, cfg = load_hf_checkpoint(ckpt)  # the engine serves what transformers reads
    peer = None
    if not skipped:
      common.progress(f"cpu_peer: starting the transformers worker ({python}, {threads} threads)")
      peer = PeerWorker(python, ckpt, threads)
      peer_info = peer.info
    try:
      for B in wl.batches:
        prompts = rng.integers(0, cfg.vocab_size, (B, wl.prompt_len)).tolist()
        ecfg = engine_config(cfg, B, wl.prompt_len, wl.new_tokens)
        common.progress(f"cpu_peer: batch {B}: one warm-up run per side (compiles the engine's "
                        "steps)")
        run_engine(params, ecfg, prompts, wl.new_tokens)
        if peer:
          peer.generate(prompts, wl.new_tokens)  # the same warm-up run as the engine's
        eng_runs, peer_runs = [], []
        for r in range(wl.repeats):  # alternate the sides so both see the same load
          eng_runs.append(run_engine(params, ecfg, prompts, wl.new_tokens))
          if peer:
            peer_runs.append(peer.generate(prompts, wl.new_tokens))
          common.progress(
              f"cpu_peer: batch {B} run {r + 1}/{wl.repeats}: engine "
              f"{B * wl.new_tokens / eng_runs[-1]['seconds']:.0f} tok/s"
              + (f", transformers {B * wl.new_tokens / peer_runs[-1]['seconds']:.0f} tok/s"
                 if peer else ""))
        rows.append(batch_row(B, wl, eng_runs, peer_runs))
    finally:
      if peer:
        peer.close()
  record = common.record_header("cpu_peer", quick=quick, smoke=smoke, config=cfg.to_dict())
  record.update(
      workload=dataclasses.asdict(wl), params=count_params(cfg), rows=rows,
      peer_python=python, peer_skipped=skipped, peer=peer_info, torch_threads=threads,
      engine_device=str(jax.devices()[0]), xla_flags=os.environ.get("XLA_FLAGS", ""),
      jax_device_count=jax.device_count(), load_average_before=list(load_before),
      load_average_after=list(os.getloadavg()), target_ratio=TARGET_RATIO,
      target_met=(all(r["ratio"] >= TARGET_RATIO for r in rows) if not skipped else None),
      tokens_identical=(all(r["tokens_match"]["identical"] for r in rows) if not skipped
                        else None))
  common.write_json(out_dir, "cpu_peer", record)
  _write_markdown(out_dir, record)
  for r in rows:
    print(f"batch {r['batch']}: engine {r['engine_tok_s']:.0f} tok/s"
          + (f", transformers {r['peer_tok_s']:.0f} tok/s, ratio {r['ratio']:.2f}, tokens "
             f"{'identical' if r['tokens_match']['identical'] else 'differ'}"
             if r["peer_tok_s"] else " (transformers skipped)"))
  return record


def _write_markdown(out_dir: str, rec: dict) -> None:
  wl = rec["workload"]
  head = ["batch", "engine tok/s", "transformers tok/s", "engine / transformers",
          f">= {rec['target_ratio']}x", "greedy tokens", "engine prefill ms",
          "engine decode ms/step", "engine host ms/step"]
  rows = []
  for r in rec["rows"]:
    m = r["tokens_match"]
    rows.append([r["batch"], r["engine_tok_s"],
                 r["peer_tok_s"] if r["peer_tok_s"] else "skipped",
                 f"{r['ratio']:.2f}" if r["ratio"] else "-",
                 ("yes" if r["ratio"] >= rec["target_ratio"] else "no") if r["ratio"] else "-",
                 "-" if m is None else ("identical" if m["identical"] else
                                        f"{100 * m['fraction']:.1f}% equal, first differs at "
                                        f"{m['first_mismatch']}"),
                 r["engine_prefill_ms"], r["engine_decode_ms"], r["engine_host_ms_per_step"]])
  peer = rec["peer"]
  peer_line = (f"transformers {peer['transformers']} (torch {peer['torch']}, "
               f"{peer['threads']} threads, {peer['model_class']}, eager attention, float32) "
               f"in `{rec['peer_python']}`" if peer else f"**{rec['peer_skipped']}**")
  mach = rec["machine"]
  md = (f"# cpu_peer\n\n`{rec['config']['name']}` ({rec['params'] / 1e6:.1f}M params, "
        f"{rec['config']['dtype']}) from one Hugging Face checkpoint; {wl['prompt_len']}-token "
        f"prompts, {wl['new_tokens']} greedy tokens each. tok/s counts new tokens over the wall "
        f"time from submitting the batch to its last token (prefill included); medians of "
        f"{wl['repeats']} timed run(s) per side, the sides alternating.\n\n"
        + common.markdown_table(head, rows)
        + f"\n- Engine: `mlkit.engine.Engine` on `{rec['engine_device']}` "
        f"({mach['cpu_count']} cores, jax {mach['jax']}); XLA_FLAGS `{rec['xla_flags'] or '-'}` "
        f"({rec['jax_device_count']} host device(s); the engine uses the first).\n"
        + (f"- **{rec['jax_device_count']} host devices**: splitting the CPU this way slowed a "
           f"one-device engine's decode step by 25-40% on the 2-core machine (1 or 2 devices: "
           f"no difference; docs/cpu_speed.md).\n" if rec["jax_device_count"] > 2 else "")
        + f"- Peer: {peer_line}.\n"
        f"- Load average before/after: {rec['load_average_before'][0]:.2f} / "
        f"{rec['load_average_after'][0]:.2f} (another process on these cores slows both sides).\n"
        + ("\n![cpu_peer](cpu_peer.png)\n" if _plot(out_dir, rec) else ""))
  common.write_markdown(out_dir, "cpu_peer", md)


def _plot(out_dir: str, rec: dict) -> bool:
  """tok/s against the batch size for both sides (written only when transformers ran)."""
  if not rec["peer"]:
    return False
  xs = [r["batch"] for r in rec["rows"]]
  common.plot_lines(os.path.join(out_dir, "cpu_peer.png"),
                    {"mlkit Engine": (xs, [r["engine_tok_s"] for r in rec["rows"]]),
                     "transformers (eager)": (xs, [r["peer_tok_s"] for r in rec["rows"]])},
                    xlabel="requests in the batch", ylabel="new tokens/s (median)",
                    title=f"{rec['config']['name']} on {rec['machine']['cpu_count']} CPU cores",
                    logx=True)
  return True
