"""How often a model's first MTP layer drafts the token its greedy decoding emits next.

Speculative decoding with one draft token per step (k = 1) accepts the draft when
it equals the target's greedy token, and then emits two tokens in one target step
instead of one (docs/speculative.md). Which drafts would be accepted is fixed by
the model alone, so it can be measured before the engine speculates, on the
model's own greedy continuations:

1. greedy-decode each prompt with the main model (``generate``), giving s[0..T-1],
   the prompt s[0..P-1] and the continuation s[P..T-1];
2. one cache-free forward over s gives the main model's hidden states h and its
   greedy choices g[j] = argmax logits[j] (g[j-1] must be s[j]: the forward agrees
   with decoding; where it does not, the row is counted, not used);
3. MTP depth 1 at position j-1 reads (h[j-1], s[j]) and drafts d[j] for s[j+1]: the
   draft a step whose newest token is s[j] would propose;
4. walk the continuation as the engine would: a step whose newest token is s[j]
   emits s[j+1], and also s[j+2] when d[j] == s[j+1] (when s[j+1] is not the last
   token); the next step's newest token is the last one emitted.

Drafts after an accepted one read the true tokens, which is what the engine's
draft reads there too (an accepted draft is the true token). Deeper drafts (k > 1,
the last MTP layer reused on its own outputs) read the MTP layer's own KV of the
earlier positions, which a cache-free pass does not reproduce, so only k = 1 is
measured here.

``python -m mlkit.evals.mtp_acceptance`` measures the accuracy experiment's trained
model (MINI_MLA, cached by ``mlkit.evals.setups``) on each task's evaluation items.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mlkit.config import ModelConfig
from mlkit.model import apply
from mlkit.model.mtp import mtp_forward


@dataclasses.dataclass(frozen=True)
class Acceptance:
  """Greedy speculative decoding with one MTP draft per step, walked over continuations.

  Attributes:
    drafts: positions with a draft and a true next token (teacher-forced).
    drafts_agreeing: of those, drafts equal to the true next token.
    steps: target steps the walk takes after prefill (each verifies one draft).
    tokens: tokens those steps emit (the continuation less its first token, which
      prefill emits).
    accepted_hist: steps by accepted drafts: [steps accepting 0, steps accepting 1].
    rows_used / rows_skipped: continuations walked, and those skipped because the
      forward's greedy choice differed from the decoded token somewhere (ties).
  """

  drafts: int
  drafts_agreeing: int
  steps: int
  tokens: int
  accepted_hist: tuple[int, int]
  rows_used: int
  rows_skipped: int

  @property
  def draft_accuracy(self) -> float:
    """Teacher-forced: the share of drafts equal to the next token."""
    return self.drafts_agreeing / self.drafts if self.drafts else float("nan")

  @property
  def acceptance_length(self) -> float:
    """Tokens per target step (1 + mean accepted drafts), as vLLM reports it."""
    return self.tokens / self.steps if self.steps else float("nan")

  def to_json(self) -> dict:
    return dict(dataclasses.asdict(self), draft_accuracy=self.draft_accuracy,
                acceptance_length=self.acceptance_length)


def walk(agree: Sequence[bool], prompt_len: int, total: int) -> tuple[int, int, int]:
  """The k = 1 walk over one continuation; returns (steps, tokens emitted, steps accepting).

  Args:
    agree: per position j (index j), whether the draft at j equals token j+1; only
      P <= j <= total - 2 is read.
    prompt_len: P, the prompt's length (the first continuation token is s[P]).
    total: T, the sequence's length (prompt plus continuation).
  """
  j, steps, tokens, accepted = prompt_len, 0, 0, 0
  while j < total - 1:  # a step can emit s[j+1]
    a = bool(agree[j]) and j + 2 <= total - 1  # the bonus s[j+2] exists
    steps += 1
    tokens += 1 + a
    accepted += a
    j += 1 + a
  return steps, tokens, accepted


@jax.jit(static_argnames=("cfg",))
def _forward_and_drafts(params, tokens, cfg: ModelConfig):
  """tokens [1, T] -> (greedy [T] int32: argmax at each position, drafts [T-1] int32: depth
  1's argmax at positions 0..T-2, drafting token j+2 from (h[j], tokens[j+1]))."""
  T = tokens.shape[1]
  positions = jnp.arange(T, dtype=jnp.int32)[None]
  logits, _, hidden = apply(params, tokens, positions, cfg=cfg, return_pre_norm=True)
  mtp_logits, _ = mtp_forward(params, hidden[:, :-1], tokens[:, 1:], cfg=cfg, depth=1,
                              positions=positions[:, :-1])
  return (jnp.argmax(logits[0], -1).astype(jnp.int32),
          jnp.argmax(mtp_logits[0], -1).astype(jnp.int32))


def measure(params, cfg: ModelConfig, sequences: Sequence[Sequence[int]],
            prompt_lens: Sequence[int]) -> Acceptance:
  """Acceptance of depth-1 MTP drafts over greedy continuations (module docstring).

  Args:
    params: the model's params with ``params["mtp"]`` (at least one layer).
    cfg: its config.
    sequences: prompt + greedy continuation per row (ids), as decoding produced them.
    prompt_lens: each row's prompt length (>= 1; the continuation has >= 1 token).

  Raises:
    ValueError: no MTP layer, or a row whose prompt length leaves no continuation.
  """
  if not params.get("mtp"):
    raise ValueError("mtp_acceptance: the params hold no MTP layer (params['mtp'])")
  if len(sequences) != len(prompt_lens):
    raise ValueError(f"mtp_acceptance: {len(sequences)} sequences, {len(prompt_lens)} "
                     "prompt lengths")
  drafts = agreeing = steps = tokens = accepted = used = skipped = 0
  for seq, P in zip(sequences, prompt_lens):
    T = len(seq)
    if not 1 <= P < T:
      raise ValueError(f"mtp_acceptance: prompt length {P} leaves no continuation in a "
                       f"sequence of {T} tokens")
    greedy, draft = map(np.asarray, _forward_and_drafts(params, jnp.asarray([seq], jnp.int32),
                                                        cfg))
    s = np.asarray(seq)
    if not np.array_equal(greedy[P - 1:T - 1], s[P:T]):  # a tie decided otherwise
      skipped += 1
      continue
    used += 1
    # agree[j]: the draft a step with newest token s[j] proposes (depth 1 at j-1) == s[j+1].
    agree = np.zeros(T, bool)
    j = np.arange(P, T - 1)
    agree[j] = draft[j - 1] == s[j + 1]
    drafts += len(j)
    agreeing += int(agree[j].sum())
    st, tk, ac = walk(agree, P, T)
    steps, tokens, accepted = steps + st, tokens + tk, accepted + ac
  return Acceptance(drafts=drafts, drafts_agreeing=agreeing, steps=steps, tokens=tokens,
                    accepted_hist=(steps - accepted, accepted), rows_used=used,
                    rows_skipped=skipped)


def main(argv=None) -> int:
  """Measures the accuracy experiment's trained model on each task's evaluation items."""
  import argparse
  import json

  from mlkit.evals import setups
  from mlkit.evals.harness import MAX_NEW_TOKENS
  from mlkit.evals.tasks import make_examples
  from mlkit.evals.tokenizer import EOS, CharTokenizer
  from mlkit.generate import generate
  from mlkit.sampling import SamplingParams
  p = argparse.ArgumentParser(prog="python -m mlkit.evals.mtp_acceptance", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--setup", default="main", choices=sorted(setups.TRAIN_SETUPS),
                 help="the trained model (trained first if not cached: main takes ~1 h)")
  p.add_argument("--items", type=int, default=64, help="evaluation items per task")
  p.add_argument("--out", help="also write the results as JSON here")
  args = p.parse_args(argv)
  params, _ = setups.train_or_load(setups.TRAIN_SETUPS[args.setup])
  # f32 throughout, so that decoding and the forward pick the same greedy tokens.
  cfg = dataclasses.replace(setups.TRAIN_SETUPS[args.setup].model, dtype="float32",
                            param_dtype="float32")
  tok = CharTokenizer()
  tasks = setups.EVAL_SETUPS["quick"].tasks
  results = {}
  for task in ("arithmetic", "retrieval", "tool_call"):
    examples = make_examples(task, args.items, seed=1234, tc=tasks)
    prompts = [tok.encode(ex.prompt, bos=True) for ex in examples]
    sp = SamplingParams(max_new_tokens=MAX_NEW_TOKENS[task], temperature=0.0, stop_tokens=(EOS,))
    outs = generate(params, cfg, prompts, sp).tokens
    seqs = [list(pr) + list(o) for pr, o in zip(prompts, outs)]
    r = measure(params, cfg, seqs, [len(pr) for pr in prompts])
    results[task] = r.to_json()
    print(f"{task:10s} draft accuracy {r.draft_accuracy:.3f} ({r.drafts_agreeing}/{r.drafts}), "
          f"acceptance length (k=1) {r.acceptance_length:.3f} ({r.tokens} tokens in {r.steps} "
          f"steps), rows {r.rows_used} used / {r.rows_skipped} skipped", flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"setup": args.setup, "items_per_task": args.items, "k": 1,
                 "tasks": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
