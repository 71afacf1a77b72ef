"""The serving Engine beside a peer (Hugging Face transformers) on one checkpoint, same workload.

Both sides serve the same Hugging Face checkpoint (DeepSeek-V3 layout) and generate
``new_tokens`` greedy tokens for every prompt of a batch; tok/s counts new tokens over
the wall time from submitting the batch to its last token, prefill included
(:func:`run_engine`, :meth:`PeerWorker.generate`), and :func:`batch_row` sets the
medians side by side with whether the greedy tokens are identical.

The transformers side runs in a worker process (``mlkit/peer/transformers_worker.py``,
torch and transformers only) started with the interpreter that ``MLKIT_PEER_PYTHON``
names, else this one, so the project's environment stays free of torch
(docs/cpu_speed.md); :func:`peer_unavailable` says why a peer cannot run.

Fairness: every prompt of a batch has the same length, so transformers runs each batch
as one batched ``generate`` with no padding (each row computes exactly what it would
alone), with the KV cache. The engine prefills the whole batch in one step and decodes
it in one bucket (:func:`engine_config`), its KV pool in the model's dtype, as
transformers' cache is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from mlkit.config import ModelConfig
from mlkit.engine import Engine, EngineConfig
from mlkit.kvcache import KVCacheConfig
from mlkit.sampling import SamplingParams

# The interpreter of the transformers worker (a virtual environment with torch and transformers).
PEER_PYTHON_ENV = "MLKIT_PEER_PYTHON"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformers_worker.py")
# The target: the engine at >= 1.5x transformers' tok/s.
TARGET_RATIO = 1.5


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
  """The transformers worker process (``mlkit/peer/transformers_worker.py``).

  Args:
    python: the interpreter to run it with (it must import torch and transformers).
    checkpoint: the HF checkpoint directory.
    threads: torch's intra-op threads.

  Raises:
    RuntimeError: the worker did not start (its stderr's tail in the message).
  """

  def __init__(self, python: str, checkpoint: str, threads: int):
    self._log = tempfile.TemporaryFile(mode="w+")  # the worker's stderr, for error messages
    # -I: neither the worker's folder nor PYTHONPATH goes on its sys.path, so no module of
    # this project can shadow one that transformers imports.
    self.proc = subprocess.Popen([python, "-I", WORKER, "--checkpoint", checkpoint,
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


def match_tokens(a: list[list[int]], b: list[list[int]]) -> dict:
  """Token agreement of two runs: {identical, fraction, first_mismatch (request, index) or None}."""
  x, y = np.asarray(a), np.asarray(b)
  diff = np.argwhere(x != y)
  return {"identical": bool(diff.size == 0), "fraction": float(np.mean(x == y)),
          "first_mismatch": None if diff.size == 0 else [int(v) for v in diff[0]]}


def _median(xs):
  return float(np.median(xs)) if len(xs) else None


def batch_row(B: int, wl: Workload, eng_runs: list[dict], peer_runs: list[dict]) -> dict:
  """One batch's summary: medians over the timed runs of both sides (``peer_runs`` empty
  when the peer was skipped), their ratio, and whether the greedy tokens agree."""
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
  row["tokens_match"] = (match_tokens(eng_runs[0]["tokens"], peer_runs[0]["tokens"])
                         if peer_runs else None)
  return row
