"""Evaluation: generated tasks with fixed seeds and their checkers (``tasks``), a
character tokenizer (``tokenizer``), binomial intervals (``stats``), generation
scoring (``harness``), teacher-forced perplexity and KL through the paged cache
(``teacher_forcing``) and generation backends, including the serving engine
(``backends``, imported on demand because it sits at the engine's level).

Imported on demand too, as they train models or sit on the engine: the accuracy
ablation's trained model and sizes (``setups``), precision recipes scored against the
bf16 reference and the report's claims (``precision``), and how fast an attention
layout learns the retrieval lookup (``lookup``).
"""

from mlkit.evals.harness import (MAX_NEW_TOKENS, Backend, EvalConfig, TaskResult, evaluate,
                                 evaluate_task, score_outputs)
from mlkit.evals.stats import paired_difference_interval, samples_for_halfwidth, wilson_interval
from mlkit.evals.tasks import (TASKS, TOOL_SCHEMAS, Example, TaskConfig, chance_accuracy,
                               is_correct, make_examples, packed_batch, parse_tool_call,
                               tool_call_valid)
from mlkit.evals.teacher_forcing import (paged_logprobs, perplexity, token_kl, token_nll,
                                        token_top1_correct)
from mlkit.evals.tokenizer import BOS, EOS, PAD, CharTokenizer

__all__ = ["BOS", "Backend", "CharTokenizer", "EOS", "EvalConfig", "Example", "MAX_NEW_TOKENS",
           "PAD", "TASKS", "TOOL_SCHEMAS", "TaskConfig", "TaskResult", "chance_accuracy",
           "evaluate", "evaluate_task", "is_correct", "make_examples", "packed_batch",
           "paged_logprobs", "paired_difference_interval", "parse_tool_call", "perplexity",
           "samples_for_halfwidth", "score_outputs", "token_kl", "token_nll", "token_top1_correct",
           "tool_call_valid",
           "wilson_interval"]
