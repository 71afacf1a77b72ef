"""Generated tasks with fixed seeds, their checkers, and packed training batches.

Each task stresses something quantisation can break:

* ``arithmetic``: multi-digit addition with an exact-match answer (a GSM8K-like
  signal: one wrong digit is a wrong answer). Prompt ``"347+58="``, answer ``"405"``.
* ``retrieval``: key->value lookup over a long context; the answer sits many
  tokens back, so KV precision matters. Prompt ``"kqz=41,abc=07,...|abc="``, answer ``"07"``.
* ``tool_call``: a request mapped to a JSON tool call whose validity is checked
  against a schema (the report's tool-call validity metric) and whose content is
  checked for exact match. Prompt ``"weather in oslo for 3 days>"``, answer
  ``'{"tool":"weather","city":"oslo","days":3}'``.

A sequence is ``BOS prompt answer EOS``; generation stops at EOS. Nothing here
imports the engine: backends live in :mod:`mlkit.evals.backends`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Callable, Sequence

import numpy as np

from mlkit.evals.tokenizer import BOS, EOS, PAD, CharTokenizer

TASKS = ("arithmetic", "retrieval", "tool_call")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_CITIES = ("oslo", "paris", "lima", "cairo", "tokyo", "delhi", "rome", "quito", "seoul", "accra",
           "dubai", "perth", "milan", "lagos", "hanoi", "bern")
_CURRENCIES = ("usd", "eur", "gbp", "jpy", "chf", "inr", "brl", "cad")
_WORDS = ("red", "blue", "shoes", "lamp", "cheap", "used", "bike", "desk", "chair", "green",
          "phone", "case", "tent", "book", "small", "oak")
# name -> {arg: type}; every argument is required and no other key is allowed.
TOOL_SCHEMAS: dict[str, dict[str, type]] = {
    "weather": {"city": str, "days": int},
    "convert": {"amount": int, "from": str, "to": str},
    "search": {"query": str},
}


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Difficulty knobs of the generated tasks (training and evaluation share them)."""

  # Digits per addend, inclusive range.
  arith_digits: tuple[int, int] = (1, 3)
  # Key/value pairs in a retrieval context, inclusive range (each pair is key_letters + 4
  # characters).
  retrieval_pairs: tuple[int, int] = (4, 24)
  # Letters per retrieval key (1..3). One-letter keys need a two-hop lookup (find the key,
  # read the two tokens after it); longer keys also need each key's letters gathered first.
  key_letters: int = 3
  # Ask for the key before the context (``k?c=41,k=07|`` -> ``07``) instead of after it
  # (``c=41,k=07|k=`` -> ``07``). The value still sits many tokens back, but each pair can be
  # compared with the query as it is read.
  query_first: bool = False

  def __post_init__(self):
    for name in ("arith_digits", "retrieval_pairs"):
      lo, hi = getattr(self, name)
      if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"TaskConfig.{name} must be (lo, hi) ints with 1 <= lo <= hi, "
                         f"got {getattr(self, name)!r}")
    if not isinstance(self.key_letters, int) or not 1 <= self.key_letters <= 3:
      raise ValueError(f"TaskConfig.key_letters must be 1, 2 or 3, got {self.key_letters!r}")
    if self.retrieval_pairs[1] > 26 ** self.key_letters:
      raise ValueError(f"TaskConfig.retrieval_pairs allows at most {26 ** self.key_letters} "
                       f"distinct keys of {self.key_letters} letters")


@dataclasses.dataclass(frozen=True)
class Example:
  """One task instance: the model sees ``prompt`` and must produce ``answer``."""

  task: str
  prompt: str
  answer: str


# ----------------------------------------------------------------------------- generators

def _number(rng: np.random.Generator, digits: int) -> int:
  lo = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(lo, 10 ** digits))


def gen_arithmetic(rng: np.random.Generator, tc: TaskConfig = TaskConfig()) -> Example:
  """``a+b=`` -> ``str(a + b)`` with a, b of arith_digits digits each."""
  a = _number(rng, int(rng.integers(tc.arith_digits[0], tc.arith_digits[1] + 1)))
  b = _number(rng, int(rng.integers(tc.arith_digits[0], tc.arith_digits[1] + 1)))
  return Example("arithmetic", f"{a}+{b}=", str(a + b))


def gen_retrieval(rng: np.random.Generator, tc: TaskConfig = TaskConfig()) -> Example:
  """``k1=v1,k2=v2,...|kq=`` (or ``kq?k1=v1,...|``) -> ``vq``: distinct ``key_letters``-letter
  keys, 2-digit values."""
  n = int(rng.integers(tc.retrieval_pairs[0], tc.retrieval_pairs[1] + 1))
  kl = tc.key_letters
  codes = rng.choice(26 ** kl, size=n, replace=False)
  keys = ["".join(_LETTERS[(c // 26 ** j) % 26] for j in range(kl)) for c in codes]
  values = [f"{int(v):02d}" for v in rng.integers(0, 100, size=n)]
  q = int(rng.integers(n))
  context = ",".join(f"{k}={v}" for k, v in zip(keys, values))
  if tc.query_first:
    return Example("retrieval", f"{keys[q]}?{context}|", values[q])
  return Example("retrieval", f"{context}|{keys[q]}=", values[q])


def gen_tool_call(rng: np.random.Generator, tc: TaskConfig = TaskConfig()) -> Example:
  """A short request -> the compact JSON call of one of ``TOOL_SCHEMAS``."""
  del tc
  tool = ("weather", "convert", "search")[int(rng.integers(3))]
  if tool == "weather":
    city, days = _CITIES[int(rng.integers(len(_CITIES)))], int(rng.integers(1, 8))
    prompt, args = f"weather in {city} for {days} days>", {"city": city, "days": days}
  elif tool == "convert":
    amount = int(rng.integers(1, 1000))
    src, dst = rng.choice(len(_CURRENCIES), size=2, replace=False)
    src, dst = _CURRENCIES[int(src)], _CURRENCIES[int(dst)]
    prompt, args = f"convert {amount} {src} to {dst}>", {"amount": amount, "from": src, "to": dst}
  else:
    words = rng.choice(len(_WORDS), size=int(rng.integers(1, 3)), replace=False)
    query = " ".join(_WORDS[int(w)] for w in words)
    prompt, args = f"search for {query}>", {"query": query}
  return Example("tool_call", prompt, format_tool_call(tool, args))


GENERATORS: dict[str, Callable[[np.random.Generator, TaskConfig], Example]] = {
    "arithmetic": gen_arithmetic, "retrieval": gen_retrieval, "tool_call": gen_tool_call}

# Seed offsets keep evaluation items disjoint in stream from training batches.
_TASK_SEED = {"arithmetic": 11, "retrieval": 23, "tool_call": 37}


def make_examples(task: str, n: int, seed: int = 0, tc: TaskConfig = TaskConfig()) -> list[Example]:
  """``n`` examples of ``task``; the same (task, n, seed, tc) always gives the same list.

  Raises:
    ValueError: unknown task or negative n.
  """
  if task not in GENERATORS:
    raise ValueError(f"make_examples: unknown task {task!r}; known: {TASKS}")
  if n < 0:
    raise ValueError(f"make_examples: n must be >= 0, got {n}")
  rng = np.random.default_rng([seed, _TASK_SEED[task]])
  return [GENERATORS[task](rng, tc) for _ in range(n)]


# ----------------------------------------------------------------------------- checkers

def format_tool_call(tool: str, args: dict) -> str:
  """The canonical compact JSON of a call: ``{"tool":name,<args in schema order>}``."""
  return json.dumps({"tool": tool, **args}, separators=(",", ":"))


def parse_tool_call(text: str) -> dict | None:
  """The call as a dict if ``text`` is a schema-valid tool call, else None.

  Valid means: one JSON object; ``"tool"`` names a known tool; the other keys are
  exactly that tool's arguments; ints are ints (not bools or floats) and strings
  are non-empty.
  """
  try:
    obj = json.loads(text)
  except (ValueError, RecursionError):
    return None
  if not isinstance(obj, dict) or obj.get("tool") not in TOOL_SCHEMAS:
    return None
  schema = TOOL_SCHEMAS[obj["tool"]]
  if set(obj) != {"tool", *schema}:
    return None
  for key, typ in schema.items():
    v = obj[key]
    if typ is int and (not isinstance(v, int) or isinstance(v, bool)):
      return None
    if typ is str and (not isinstance(v, str) or not v):
      return None
  return obj


def tool_call_valid(text: str) -> bool:
  """Whether ``text`` is a schema-valid tool call (the report's validity metric)."""
  return parse_tool_call(text) is not None


def is_correct(example: Example, output: str) -> bool:
  """Exact match of a decoded output (EOS already stripped) against the answer.

  Tool calls compare as parsed JSON (key order and spacing do not matter) and
  must also be schema-valid.
  """
  if example.task == "tool_call":
    got = parse_tool_call(output)
    return got is not None and got == json.loads(example.answer)
  return output == example.answer


def retrieval_pairs(example: Example) -> int:
  """The number of key/value pairs in a retrieval example's context."""
  return example.prompt.count(",") + 1


def chance_accuracy(example: Example) -> float:
  """Accuracy of a guesser that knows the answer's format but not the content.

  arithmetic: 0 (a uniform guess over the answer's digit strings is < 1e-3);
  retrieval: 1 / (number of pairs) (picking one of the context's values);
  tool_call: 1 / (number of distinct calls of that tool's template) is ~0, so 0.
  """
  if example.task == "retrieval":
    return 1.0 / retrieval_pairs(example)
  return 0.0


# ----------------------------------------------------------------------------- training data

def example_tokens(tok: CharTokenizer, ex: Example) -> tuple[list[int], list[int]]:
  """(ids, is_answer) for ``BOS prompt answer EOS``; is_answer marks the answer and EOS."""
  p = tok.encode(ex.prompt, bos=True)
  a = tok.encode(ex.answer, eos=True)
  return p + a, [0] * len(p) + [1] * len(a)


def packed_batch(rng: np.random.Generator, batch: int, seq_len: int, *,
                 tasks: Sequence[str] = TASKS, tc: TaskConfig = TaskConfig(),
                 prompt_weight: float = 0.1, mix: str = "examples", tok: CharTokenizer | None = None,
                 segments: bool = False) -> tuple[np.ndarray, ...]:
  """A training batch of whole examples packed into rows, uniformly mixing ``tasks``.

  Examples never straddle rows; the tail of a row is PAD with weight 0. Weights
  are per *target* position: ``weights[b, t]`` weighs predicting ``tokens[b, t]``
  from the tokens before it. Answer tokens (and EOS) weigh 1; prompt tokens weigh
  ``prompt_weight``, because keys, operands and cities are random and
  unpredictable; BOS weighs 0.

  Args:
    rng: the generator (the caller seeds it per step for reproducible resumes).
    batch: rows B.
    seq_len: row length T (the model sees T - 1 inputs).
    tasks: tasks to mix.
    tc: task difficulty.
    prompt_weight: loss weight of prompt tokens.
    mix: "examples" draws each task equally often; "tokens" draws tasks in inverse
      proportion to their mean length, so each task fills the same share of tokens
      (a 10-token sum then comes ~6x as often as a 60-token tool call).
    tok: the tokenizer (default CharTokenizer()).
    segments: also return segment ids, so training can keep each example's attention
      inside the example (``mlkit.train`` takes them third).

  Returns:
    (tokens [B, T] int32, weights [B, T] f32), plus segment_ids [B, T] int32 when
    ``segments``: 1, 2, ... for a row's examples in order, 0 for the PAD tail.

  Raises:
    ValueError: a generated example longer than seq_len (raise seq_len or shrink tc).
  """
  tok = tok or CharTokenizer()
  if mix not in ("examples", "tokens"):
    raise ValueError(f"packed_batch: mix must be 'examples' or 'tokens', got {mix!r}")
  probs = None if mix == "examples" else _token_mix(tuple(tasks), tc)
  tokens = np.full((batch, seq_len), PAD, np.int32)
  weights = np.zeros((batch, seq_len), np.float32)
  segment_ids = np.zeros((batch, seq_len), np.int32)
  for b in range(batch):
    t, seg = 0, 0
    while True:
      task = tasks[int(rng.integers(len(tasks)))] if probs is None else \
          tasks[int(rng.choice(len(tasks), p=probs))]
      ids, ans = example_tokens(tok, GENERATORS[task](rng, tc))
      if len(ids) > seq_len:
        raise ValueError(f"packed_batch: a {task} example has {len(ids)} tokens > seq_len {seq_len}")
      if t + len(ids) > seq_len:
        break
      tokens[b, t:t + len(ids)] = ids
      weights[b, t:t + len(ids)] = np.where(np.asarray(ans) == 1, 1.0, prompt_weight)
      weights[b, t] = 0.0  # BOS is never predicted
      seg += 1
      segment_ids[b, t:t + len(ids)] = seg
      t += len(ids)
  return (tokens, weights, segment_ids) if segments else (tokens, weights)


@functools.lru_cache(maxsize=64)
def _token_mix(tasks: tuple[str, ...], tc: TaskConfig) -> np.ndarray:
  """Task probabilities inversely proportional to mean example length (from a fixed sample)."""
  tok = CharTokenizer()
  rng = np.random.default_rng(0)
  mean_len = np.array([np.mean([len(example_tokens(tok, GENERATORS[t](rng, tc))[0])
                                for _ in range(64)]) for t in tasks])
  p = 1.0 / mean_len
  return p / p.sum()


def max_example_tokens(tc: TaskConfig = TaskConfig()) -> int:
  """An upper bound on ``len(BOS prompt answer EOS)`` for any task under ``tc``."""
  d = tc.arith_digits[1]
  arith = 2 * d + 2 + (d + 1) + 2
  retr = tc.retrieval_pairs[1] * (tc.key_letters + 4) + tc.key_letters + 2 + 2 + 2
  tool = 80
  return max(arith, retr, tool)


def eval_sequences(examples: Sequence[Example], tok: CharTokenizer | None = None
                   ) -> list[tuple[list[int], list[int]]]:
  """Teacher-forcing sequences for perplexity / KL: (ids, is_answer) per example."""
  tok = tok or CharTokenizer()
  return [example_tokens(tok, ex) for ex in examples]


__all__ = ["BOS", "EOS", "Example", "GENERATORS", "PAD", "TASKS", "TOOL_SCHEMAS", "TaskConfig",
           "chance_accuracy", "eval_sequences", "example_tokens", "format_tool_call",
           "gen_arithmetic", "gen_retrieval", "gen_tool_call", "is_correct", "make_examples",
           "max_example_tokens", "packed_batch", "parse_tool_call", "retrieval_pairs",
           "tool_call_valid"]
