"""Tokenizer files the tests write themselves (nothing is downloaded).

- :func:`write_byte_level_checkpoint`: a byte-level BPE trained with ``tokenizers``
  (tokenizer.json, as DeepSeek-V3 and GLM 5 ship) with a ChatML chat template and
  a list of eos ids in generation_config.json;
- :func:`write_kimi_checkpoint`: a Kimi K2-style ``tiktoken.model`` (BPE ranks
  trained here over bytes) with ``added_tokens_decoder`` special tokens and named
  chat templates;
- :func:`write_byte_fallback_checkpoint`: a Llama-style byte-fallback tokenizer.json.

Used by tests/test_text.py and tests/test_http.py.
"""

import base64
import collections
import json
import os
import re

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

CORPUS = [
    "Hello world, hello tokenizer! The quick brown fox jumps over the lazy dog.",
    "你好，世界。我们在测试分词器。日本語のテキストも少し。",
    "Emoji: 🙂🚀🎉 and more 🙂🙂, flags 🇫🇷 and a family 👨‍👩‍👧.",
    "Ünïcödé façade naïve café — «quotes» and numbers 12345 67890.",
    "def main():\n    return {'key': [1, 2, 3]}\n",
] * 4

SAMPLES = ["Hello world", "🙂🚀 emoji", "你好，世界", "mixed: café 🙂 日本語 x=42\n\ttabs  ",
           "", " ", "🇫🇷👨‍👩‍👧"]

# The ChatML template (Qwen's shape): a tools branch, a generation prompt, raise_exception.
CHATML = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if loop.index > 50 %}{% break %}{% endif %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- elif not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
{%- if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}{% endif %}
"""

# Kimi's shape: [BOS] from bos_token, role tokens, tools as compact JSON.
KIMI_DEFAULT = """\
{{- bos_token -}}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>
  {%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
  {%- else -%}{{ raise_exception('unknown role ' + message['role']) }}
  {%- endif -%}
  {{- message['content'] -}}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""
KIMI_TOOL_USE = ("<|im_system|>tool_declare<|im_middle|>"
                 "{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}<|im_end|>"
                 + KIMI_DEFAULT)
KIMI_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                 "<|im_system|>", "<|im_middle|>", "<|reserved_token_7|>"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "天気を調べる 🌦",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _write_json(path, value):
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, ensure_ascii=False)


def byte_level_chars() -> dict[int, str]:
  """GPT-2's byte -> printable character map, which ByteLevel tokenizers use for byte tokens."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def write_byte_level_checkpoint(d: str) -> None:
  """A trained byte-level BPE (tokenizer.json) with a ChatML template and list eos ids."""
  tok = HFTokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(CORPUS, trainer)
  tok.save(os.path.join(d, "tokenizer.json"))
  _write_json(os.path.join(d, "tokenizer_config.json"), {
      "bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHATML,
      "tokenizer_class": "Qwen2Tokenizer"})
  _write_json(os.path.join(d, "generation_config.json"), {
      "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]})


def train_byte_bpe(texts, merges: int) -> dict[bytes, int]:
  """tiktoken ranks: the 256 bytes (rank = byte value), then ``merges`` BPE merges over bytes."""
  words = collections.Counter(tuple(bytes([b]) for b in w.encode())
                              for t in texts for w in re.findall(r" ?\S+|\s+", t))
  ranks = {bytes([b]): b for b in range(256)}
  for _ in range(merges):
    pairs = collections.Counter()
    for w, c in words.items():
      for pair in zip(w, w[1:]):
        pairs[pair] += c
    if not pairs:
      break
    (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
    ranks.setdefault(a + b, len(ranks))
    merged = collections.Counter()
    for w, c in words.items():
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
          out.append(a + b)
          i += 2
        else:
          out.append(w[i])
          i += 1
      merged[tuple(out)] += c
    words = merged
  return ranks


def write_tiktoken_model(path: str, ranks: dict[bytes, int]) -> None:
  with open(path, "wb") as f:
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
      f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def write_kimi_checkpoint(d: str) -> int:
  """A Kimi-style tiktoken.model + added_tokens_decoder; returns the number of BPE ranks."""
  ranks = train_byte_bpe(CORPUS, 120)
  write_tiktoken_model(os.path.join(d, "tiktoken.model"), ranks)
  n = len(ranks)
  added = {str(n + k): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True}
           for k, c in enumerate(KIMI_SPECIALS)}
  _write_json(os.path.join(d, "tokenizer_config.json"), {
      "added_tokens_decoder": added,
      "bos_token": {"__type": "AddedToken", "content": "[BOS]", "special": True},
      "eos_token": "[EOS]",
      "chat_template": [{"name": "default", "template": KIMI_DEFAULT},
                        {"name": "tool_use", "template": KIMI_TOOL_USE}]})
  _write_json(os.path.join(d, "config.json"), {"model_type": "kimi_k2",
                                               "eos_token_id": n + KIMI_SPECIALS.index("[EOS]")})
  return n


def write_byte_fallback_checkpoint(d: str) -> None:
  """A Llama-style tokenizer.json: Metaspace pieces, <0xNN> byte fallback, a stripped space."""
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
  for b in range(256):
    vocab[f"<0x{b:02X}>"] = len(vocab)
  for w in ["▁", "H", "e", "l", "o", "▁H", "▁He", "ll", "llo", "▁Hello", "w", "r", "d", "▁w",
            "▁world", ",", "!", "你", "好"]:
    vocab.setdefault(w, len(vocab))
  tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>",
                               fuse_unk=True))
  tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  tok.add_special_tokens(["<s>", "</s>"])
  tok.save(os.path.join(d, "tokenizer.json"))
  _write_json(os.path.join(d, "tokenizer_config.json"), {"bos_token": "<s>", "eos_token": "</s>"})
