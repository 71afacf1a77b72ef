"""cpu_peer: the serving Engine beside Hugging Face transformers, on one checkpoint, on this CPU.

One Hugging Face checkpoint (DeepSeek-V3 layout, written by ``save_hf_checkpoint``) is
served twice with the same workload, in the same run: by ``mlkit.engine.Engine`` (loaded
back with ``load_hf_checkpoint``) and by transformers (``AutoModelForCausalLM``, eager
PyTorch, float32). Each side generates ``new_tokens`` greedy tokens for every prompt of a
batch; the report gives tokens/s for both (new tokens over the wall time from submitting
the batch to the last token, prefill included), their ratio, and whether the greedy
tokens are identical.

The transformers side runs in a worker process (``experiments/peer_transformers.py``,
torch and transformers only) started with the interpreter that ``MLKIT_PEER_PYTHON``
names, else this one. So the project's environment stays free of torch: install the peer
in a virtual environment of its own and point the variable at its python (see
docs/cpu_speed.md). Where that interpreter cannot import torch and transformers the peer
is skipped with a message saying so, and the report gives the engine's side alone.

Fairness: every prompt of a batch has the same length, so transformers runs each batch as
one batched ``generate`` with no padding (each row computes exactly what it would alone),
with the KV cache and with torch's intra-op threads set to this machine's cores. The
engine runs on ``jax.devices()[0]`` with one decode bucket the size of the batch. The two
sides alternate run by run, so both see the same machine load; medians are reported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from configs import SMALL_MLA
from experiments import common
from mlkit.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from mlkit.config import ModelConfig
from mlkit.engine import Engine, EngineConfig
from mlkit.kvcache import KVCacheConfig
from mlkit.model import count_params, init_params
from mlkit.sampling import SamplingParams

# The interpreter of the transformers worker (a virtual environment with torch and transformers).
PEER_PYTHON_ENV = "MLKIT_PEER_PYTHON"
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_transformers.py")
_TARGET_RATIO = 1.5  # the issue's target: the engine at >= 1.5x transformers' tok/s

# The checkpoint, SMALL_MLA's layout at 4 layers (the first dense) and hidden 512:
# DeepSeek-V3 layout, 8 MLA heads (nope 64, rope 32, v 64, q_lora and kv_lora 128), 16 routed
# experts of 256 top-4 plus a shared one, vocabulary 8192, float32: 32.6M params.
CPU_PEER_MLA = dataclasses.replace(
    SMALL_MLA, name="cpu-peer-mla", vocab_size=8192, d_model=512, n_layers=4,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
    dtype="float32", param_dtype="float32")


@dataclasses.dataclass(frozen=True)
class Workload:
  """What each side generates: every batch size, prompts of one length, greedy tokens."""

  # Requests per batch, one run of each.
  batches: tuple[int, ...]
  # Tokens per prompt (all prompts of a batch have this length: no padding anywhere).
  prompt_len: int
  # Greedy tokens generated per request.
  new_tokens: int
  # Timed runs per side and batch (after one warm-up each); medians are reported.
  repeats: int


def workload(quick: bool, smoke: bool) -> tuple[ModelConfig, Workload]:
  """The model and workload of a mode (smoke: TINY_MLA cut to one MoE layer, seconds)."""
  if smoke:
    return common.local_model(quick, smoke=True), Workload((2,), 8, 4, 1)
  return CPU_PEER_MLA, Workload((8, 32), 128, 64, 3 if quick else 7)


def engine_config(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> EngineConfig:
  """An engine that prefills the whole batch in one step, then decodes it in one bucket.

  The KV pool stores the model's dtype (float32 here, as transformers' cache does), so
  both sides compute the same numbers.
  """
  kv = KVCacheConfig(num_pages=1, dtype=cfg.dtype).resolve(cfg)
  pages = -(-(prompt_len + new_tokens) // kv.page_size)
  return EngineConfig(
      model=cfg, kv=dataclasses.replace(kv, num_pages=batch * pages + 1), max_running=batch,
      batch_buckets=(batch,), prefill_buckets=(prompt_len,),
      prefill_token_budget=batch * prompt_len, max_pages_per_seq=pages)


def run_engine(params, ecfg: EngineConfig, prompts: list[list[int]], new_tokens: int) -> dict:
  """One timed engine run: submit every prompt, step until done.

  Returns:
    {seconds, tokens [B][new_tokens], prefill_ms (the first step), decode_ms_median
     (the decode-only steps), host_ms_per_step, steps}.
  """
  eng = Engine(params, ecfg)
  sampling = SamplingParams(max_new_tokens=new_tokens)
  t0 = time.perf_counter()
  ids = [eng.submit(p, sampling) for p in prompts]
  steps = []
  while eng.has_unfinished():
    s = time.perf_counter()
    eng.step()
    steps.append(time.perf_counter() - s)
  seconds = time.perf_counter() - t0
  m = eng.metrics()
  return {"seconds": seconds, "tokens": [list(eng.get(i).output) for i in ids],
          "prefill_ms": 1e3 * steps[0], "steps": len(steps),
          "decode_ms_median": 1e3 * float(np.median(steps[1:])) if len(steps) > 1 else None,
          "host_ms_per_step": 1e3 * m["host_seconds"] / max(m["steps"], 1)}


class PeerWorker:
  """The transformers worker process (see ``experiments/peer_transformers.py``).

  Args:
    python: the interpreter to run it with (it must import torch and transformers).
    checkpoint: the HF checkpoint directory.
    threads: torch's intra-op threads.

  Raises:
    RuntimeError: the worker did not start (its stderr's tail in the message).
  """

  def __init__(self, python: str, checkpoint: str, threads: int):
    self._log = tempfile.TemporaryFile(mode="w+")  # the worker's stderr, for error messages
    # -I: neither the worker's folder (this package: its kernels.py would shadow the hub's
    # `kernels` package that transformers imports) nor PYTHONPATH goes on its sys.path.
    self.proc = subprocess.Popen([python, "-I", _WORKER, "--checkpoint", checkpoint,
                                  "--threads", str(threads)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=self._log, text=True)
    self.info = self._read()

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      self._log.seek(0)
      tail = self._log.read()[-2000:]
      raise RuntimeError(f"the transformers worker exited (code {self.proc.wait()}): {tail}")
    return json.loads(line)

  def generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
    """One batched greedy generate: {tokens [B][new_tokens], seconds}."""
    self.proc.stdin.write(json.dumps({"prompts": prompts, "new_tokens": new_tokens}) + "\n")
    self.proc.stdin.flush()
    reply = self._read()
    if "error" in reply:
      raise RuntimeError(f"transformers worker: {reply['error']}")
    return reply

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait(timeout=60)
    self._log.close()


def peer_python() -> str:
  """The worker's interpreter: ``$MLKIT_PEER_PYTHON``, else this one."""
  return os.environ.get(PEER_PYTHON_ENV) or sys.executable


def peer_unavailable(python: str) -> str | None:
  """None if ``python`` imports torch and transformers, else why the peer is skipped."""
  if not (os.path.isfile(python) and os.access(python, os.X_OK)):
    return f"the peer interpreter {python} is not an executable file (${PEER_PYTHON_ENV})"
  probe = subprocess.run([python, "-I", "-c", "import torch, transformers"], capture_output=True,
                         text=True, timeout=300)
  if probe.returncode == 0:
    return None
  last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
  return (f"transformers peer skipped: {python} cannot import torch and transformers ({last}). "
          f"Install them in a separate virtual environment and set {PEER_PYTHON_ENV} to its "
          f"python, or install this project's 'peer' extra (docs/cpu_speed.md).")


def _match(a: list[list[int]], b: list[list[int]]) -> dict:
  """Token agreement of two runs: {identical, fraction, first_mismatch (request, index) or None}."""
  x, y = np.asarray(a), np.asarray(b)
  diff = np.argwhere(x != y)
  return {"identical": bool(diff.size == 0), "fraction": float(np.mean(x == y)),
          "first_mismatch": None if diff.size == 0 else [int(v) for v in diff[0]]}


def _median(xs):
  return float(np.median(xs)) if len(xs) else None


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
        rows.append(_row(B, wl, eng_runs, peer_runs))
    finally:
      if peer:
        peer.close()
  record = common.record_header("cpu_peer", quick=quick, smoke=smoke, config=cfg.to_dict())
  record.update(
      workload=dataclasses.asdict(wl), params=count_params(cfg), rows=rows,
      peer_python=python, peer_skipped=skipped, peer=peer_info, torch_threads=threads,
      engine_device=str(jax.devices()[0]), xla_flags=os.environ.get("XLA_FLAGS", ""),
      jax_device_count=jax.device_count(), load_average_before=list(load_before),
      load_average_after=list(os.getloadavg()), target_ratio=_TARGET_RATIO,
      target_met=(all(r["ratio"] >= _TARGET_RATIO for r in rows) if not skipped else None),
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


def _row(B: int, wl: Workload, eng_runs: list[dict], peer_runs: list[dict]) -> dict:
  """One batch's summary: medians over the timed runs of both sides."""
  tokens = B * wl.new_tokens
  eng_s = _median([r["seconds"] for r in eng_runs])
  peer_s = _median([r["seconds"] for r in peer_runs])
  row = {"batch": B, "new_tokens": tokens,
         "engine_seconds": [r["seconds"] for r in eng_runs], "engine_tok_s": tokens / eng_s,
         "engine_prefill_ms": _median([r["prefill_ms"] for r in eng_runs]),
         "engine_decode_ms": _median([r["decode_ms_median"] for r in eng_runs
                                      if r["decode_ms_median"] is not None]),
         "engine_host_ms_per_step": _median([r["host_ms_per_step"] for r in eng_runs]),
         "peer_seconds": [r["seconds"] for r in peer_runs],
         "peer_tok_s": tokens / peer_s if peer_s else None}
  row["ratio"] = row["engine_tok_s"] / row["peer_tok_s"] if peer_s else None
  # Every engine run must give the same tokens; then they are compared with transformers'.
  row["engine_runs_agree"] = all(r["tokens"] == eng_runs[0]["tokens"] for r in eng_runs)
  row["tokens_match"] = _match(eng_runs[0]["tokens"], peer_runs[0]["tokens"]) if peer_runs else None
  return row


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
