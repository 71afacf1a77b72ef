"""The files a checkpoint ships for its tokenizer, and copying them beside converted weights.

A converted checkpoint is served on its own: the HTTP server reads the
tokenizer, the chat template and the stop ids from the checkpoint directory
(:func:`mlkit.text.load_tokenizer`). So the converter copies these files from
the source checkpoint unchanged rather than re-deriving them.

Imports no JAX.
"""

from __future__ import annotations

import os
import shutil

# Every file a Hugging Face checkpoint may ship for its tokenizer and text generation.
TOKENIZER_FILES = (
    "tokenizer.json",  # tokenizers' serialised tokenizer (DeepSeek-V3, GLM 5)
    "tokenizer_config.json",  # special tokens, chat template, added tokens (Kimi's specials)
    "tiktoken.model",  # Kimi K2's BPE ranks: `base64token rank` per line
    "chat_template.jinja",  # the chat template, when kept out of tokenizer_config.json
    "special_tokens_map.json",  # bos/eos/pad token strings
    "generation_config.json",  # eos_token_id(s) used to stop generation
    "tokenizer.model",  # a SentencePiece model (copied; not read by load_tokenizer)
)


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
  """Copies the tokenizer files ``src_dir`` has into ``dst_dir`` (created if missing).

  Symbolic links (a Hugging Face cache's blobs) are followed: the copies are
  regular files.

  Args:
    src_dir: the source checkpoint directory.
    dst_dir: the converted checkpoint directory.

  Returns:
    The names of the files copied, in :data:`TOKENIZER_FILES` order.

  Raises:
    FileNotFoundError: ``src_dir`` is not a directory.
  """
  if not os.path.isdir(src_dir):
    raise FileNotFoundError(f"checkpoint directory {src_dir} does not exist")
  copied = []
  for name in TOKENIZER_FILES:
    src = os.path.join(src_dir, name)
    if not os.path.isfile(src):
      continue
    dst = os.path.join(dst_dir, name)
    if os.path.exists(dst) and os.path.samefile(src, dst):
      continue  # converting in place
    os.makedirs(dst_dir, exist_ok=True)
    shutil.copyfile(src, dst)
    copied.append(name)
  return copied
