"""Text for the OpenAI-compatible server: tokenizers, chat templates, streaming and stop strings.

- :mod:`mlkit.text.tokenizer`: :func:`load_tokenizer` reads a checkpoint's
  tokenizer.json or Kimi's tiktoken.model into one :class:`Tokenizer`, with its
  stop ids and chat template (rendered as transformers renders it).
- :mod:`mlkit.text.detok`: :class:`IncrementalDetokenizer` streams text that
  never has to be taken back; :class:`StopMatcher` cuts it at stop strings.
- :mod:`mlkit.text.files`: the tokenizer files a converter copies.

Imports no JAX, torch or transformers.
"""

from mlkit.text.detok import MAX_STOP_LENGTH, MAX_STOP_STRINGS, IncrementalDetokenizer, StopMatcher
from mlkit.text.files import TOKENIZER_FILES, copy_tokenizer_files
from mlkit.text.tokenizer import (KIMI_PAT_STR, ChatTemplateError, Tokenizer, TokenizerError,
                                  load_tokenizer)

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "KIMI_PAT_STR", "MAX_STOP_LENGTH",
           "MAX_STOP_STRINGS", "StopMatcher", "TOKENIZER_FILES", "Tokenizer", "TokenizerError",
           "copy_tokenizer_files", "load_tokenizer"]
