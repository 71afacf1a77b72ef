"""The transformers side of the peer comparison, as a worker process (torch + transformers only).

It imports nothing from this project, so it runs in any interpreter that has torch and
transformers: the one ``MLKIT_PEER_PYTHON`` names (a separate virtual environment), or
the project's own when the ``peer`` extra is installed. ``mlkit.peer.compare.PeerWorker``
starts it by its path; the project's tests import only its request loop (:func:`serve`),
against a stand-in model, never torch.

    python mlkit/peer/transformers_worker.py --checkpoint DIR --threads 2

loads the Hugging Face checkpoint in DIR (``AutoModelForCausalLM``, float32, eager
attention), sets torch's intra-op threads, replies one ``ready`` line, then serves one
request per line on stdin, replying one line each on stdout (JSON both ways):

    {"prompts": [[id, ...], ...], "new_tokens": 64}
 -> {"tokens": [[id, ...], ...], "seconds": 1.23}

Each request is one batched greedy ``generate`` with the KV cache, timed from the
call to its return (prefill included, as the engine's side is). Every prompt of a
request must have the same length, so the batch needs no padding and each row
computes exactly what it would alone. End-of-sequence stopping is off, so every row
generates ``new_tokens`` tokens, as the engine's requests (no stop tokens) do. A bad
request gets ``{"error": "..."}``; end of input ends the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def serve(model, torch, requests, reply) -> None:
  """Answers each JSON request line of ``requests`` with one ``reply`` (see the module docstring).

  Args:
    model: a transformers causal LM (anything with its ``generate``).
    torch: the torch module (or a stand-in with ``tensor``, ``long``, ``ones_like`` and
      ``inference_mode``).
    requests: an iterable of request lines.
    reply: called with one JSON-ready dict per request.
  """
  for line in requests:
    if not line.strip():
      continue
    try:
      req = json.loads(line)
      prompts, new_tokens = req["prompts"], int(req["new_tokens"])
      if len({len(p) for p in prompts}) != 1:
        raise ValueError("every prompt of a request must have the same length (no padding)")
      ids = torch.tensor(prompts, dtype=torch.long)  # [B, T]
      with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             use_cache=True, max_new_tokens=new_tokens, eos_token_id=None,
                             pad_token_id=0)
        seconds = time.perf_counter() - t0
      tokens = out[:, ids.shape[1]:].tolist()  # [B, new_tokens]
      if any(len(t) != new_tokens for t in tokens):
        raise RuntimeError(f"generate stopped early: {[len(t) for t in tokens]} tokens")
      reply({"tokens": tokens, "seconds": seconds})
    except Exception as e:  # one bad request must not end the worker
      reply({"error": f"{type(e).__name__}: {e}"})


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
  ap.add_argument("--threads", type=int, required=True, help="torch intra-op threads")
  args = ap.parse_args(argv)
  # Replies go to the original stdout; whatever the libraries print goes to stderr, so a
  # progress bar or warning can never be read as a reply.
  out = os.fdopen(os.dup(1), "w", buffering=1)
  os.dup2(2, 1)

  def reply(obj) -> None:
    out.write(json.dumps(obj) + "\n")

  import torch
  import transformers
  torch.set_num_threads(args.threads)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      args.checkpoint, dtype=torch.float32, attn_implementation="eager").eval()
  # The config's default end-of-sequence id would stop a row (and pad it) when it is drawn.
  model.generation_config.eos_token_id = None
  reply({"ready": True, "torch": torch.__version__, "transformers": transformers.__version__,
         "threads": torch.get_num_threads(), "model_class": type(model).__name__,
         "python": sys.version.split()[0]})
  serve(model, torch, sys.stdin, reply)
  return 0


if __name__ == "__main__":
  sys.exit(main())
