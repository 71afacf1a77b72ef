"""mlkit.text: tokenizers from checkpoint files, chat templates, streaming text and stop strings.

The checkpoints' tokenizer files are written here (nothing is downloaded): a
byte-level BPE trained with ``tokenizers`` on a small corpus with emoji and
CJK (tokenizer.json, as DeepSeek-V3 and GLM 5 ship), a Kimi-style
``tiktoken.model`` with BPE ranks trained here over bytes, and a Llama-style
byte-fallback tokenizer.json. The detokenizer's invariant (deltas + flush ==
decode) is checked on thousands of random id sequences, many of which split
or corrupt multi-byte characters.
"""

import json
import os
import random
import shutil
import subprocess
import sys
import time
from unittest import mock

import regex
import tiktoken
import tiktoken.load
from absl.testing import absltest
from tokenizers import Tokenizer as HFTokenizer

from mlkit import text
from mlkit.text import (KIMI_PAT_STR, ChatTemplateError, IncrementalDetokenizer, StopMatcher,
                        TokenizerError, copy_tokenizer_files, load_tokenizer)

from tempdirs import temp_dir

from tokenizer_fixtures import (CHATML, KIMI_DEFAULT, KIMI_SPECIALS, SAMPLES, TOOLS, _write_json,
                                byte_level_chars, write_byte_fallback_checkpoint,
                                write_byte_level_checkpoint, write_kimi_checkpoint)


def stream(detok: IncrementalDetokenizer, ids) -> tuple[list[str], str]:
  """Every add() delta, and flush()."""
  deltas = [detok.add(i) for i in ids]
  return deltas, detok.flush()


class _Fixtures(absltest.TestCase):
  """Writes the three checkpoints once for the class."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.hf_dir = temp_dir(cls, prefix="mlkit_text_hf_")
    write_byte_level_checkpoint(cls.hf_dir)
    cls.kimi_dir = temp_dir(cls, prefix="mlkit_text_kimi_")
    cls.n_ranks = write_kimi_checkpoint(cls.kimi_dir)
    cls.bf_dir = temp_dir(cls, prefix="mlkit_text_bf_")
    write_byte_fallback_checkpoint(cls.bf_dir)
    cls.hf = load_tokenizer(cls.hf_dir)
    cls.kimi = load_tokenizer(cls.kimi_dir)
    cls.bf = load_tokenizer(cls.bf_dir)

  def copy_dir(self, src, drop=()):
    """A copy of a fixture directory without the files in ``drop``."""
    d = temp_dir(self)
    for name in os.listdir(src):
      if name not in drop:
        shutil.copyfile(os.path.join(src, name), os.path.join(d, name))
    return d


class TokenizerTest(_Fixtures):

  def test_backends_and_vocab_sizes(self):
    self.assertEqual(self.hf.backend, "tokenizers")
    self.assertEqual(self.hf.vocab_size, 300)
    self.assertEqual(self.kimi.backend, "tiktoken")
    self.assertEqual(self.kimi.vocab_size, self.n_ranks + len(KIMI_SPECIALS))
    for tok in (self.hf, self.kimi):
      self.assertLess(max(tok.encode("".join(SAMPLES) + "<|im_end|>")), tok.vocab_size)

  def test_round_trips(self):
    for tok in (self.hf, self.kimi, self.bf):
      for s in SAMPLES:
        with self.subTest(backend=tok.path, text=s):
          ids = tok.encode(s)
          self.assertEqual(tok.decode(ids), s)

  def test_special_tokens_in_text_are_special_ids(self):
    rendered = "<|im_start|>user\n你好 🙂<|im_end|>\n<|im_start|>assistant\n"
    ids = self.hf.encode(rendered)
    start, end = self.hf.token_to_id("<|im_start|>"), self.hf.token_to_id("<|im_end|>")
    self.assertEqual(ids.count(start), 2)
    self.assertEqual(ids.count(end), 1)
    self.assertEqual(self.hf.decode(ids, skip_special_tokens=False), rendered)
    self.assertEqual(self.hf.decode(ids), "user\n你好 🙂\nassistant\n")

    rendered = "[BOS]<|im_user|>user<|im_middle|>日本語 🚀<|im_end|>"
    ids = self.kimi.encode(rendered)
    self.assertEqual(ids[0], self.n_ranks)  # [BOS]
    self.assertEqual(ids[-1], self.n_ranks + KIMI_SPECIALS.index("<|im_end|>"))
    self.assertEqual(self.kimi.decode(ids, skip_special_tokens=False), rendered)
    self.assertEqual(self.kimi.decode(ids), "user日本語 🚀")

  def test_add_special_tokens_uses_the_post_processor(self):
    from tokenizers import processors  # pylint: disable=import-outside-toplevel
    d = self.copy_dir(self.hf_dir)
    hf = HFTokenizer.from_file(os.path.join(d, "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    hf.save(os.path.join(d, "tokenizer.json"))
    tok = load_tokenizer(d)
    self.assertEqual(tok.encode("Hi", add_special_tokens=True), [0] + tok.encode("Hi"))
    self.assertEqual(self.kimi.encode("Hi", add_special_tokens=True), self.kimi.encode("Hi"))

  def test_kimi_regex_splits_han_from_latin_in_tiktoken(self):
    # With only b"x\xe4" merged, "x世" keeps x apart only if the pre-tokeniser splits Han from
    # Latin, i.e. if tiktoken's engine reads `&&` as class intersection.
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"x\xe4"] = 256
    enc = tiktoken.Encoding(name="t", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                            special_tokens={})
    self.assertEqual(enc.encode("x世"), [ord("x"), 0xE4, 0xB8, 0x96])
    whole = tiktoken.Encoding(name="w", pat_str=r"(?s).+", mergeable_ranks=ranks,
                              special_tokens={})
    self.assertEqual(whole.encode("x世"), [256, 0xB8, 0x96])

  def test_kimi_pieces_match_python_regex_v1(self):
    # Python's `regex` reads `&&` as intersection only with V1: tiktoken's split must agree.
    enc = self.kimi._backend.enc  # pylint: disable=protected-access
    for s in SAMPLES + ["Hello世界 ABCdef's DON'T 12345 ÀÉcole 漢字かな\r\n\n  x", "a&&b [x]"]:
      pieces = regex.findall(KIMI_PAT_STR, s, flags=regex.V1)
      self.assertEqual("".join(pieces), s)
      self.assertEqual(enc.encode_ordinary(s),
                       [i for p in pieces for i in enc.encode_ordinary(p)], s)

  def test_tiktoken_file_reader_matches_tiktoken(self):
    path = os.path.join(self.kimi_dir, "tiktoken.model")
    with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):  # no cache in /tmp
      expected = tiktoken.load.load_tiktoken_bpe(path)
    enc = self.kimi._backend.enc  # pylint: disable=protected-access
    self.assertEqual(enc._mergeable_ranks, expected)  # pylint: disable=protected-access

  def test_special_token_strings(self):
    self.assertIsNone(self.hf.bos_token)
    self.assertEqual(self.hf.eos_token, "<|im_end|>")
    self.assertEqual(self.kimi.bos_token, "[BOS]")  # an AddedToken dict
    self.assertEqual(self.kimi.eos_token, "[EOS]")
    d = self.copy_dir(self.bf_dir)
    _write_json(os.path.join(d, "tokenizer_config.json"), {})
    _write_json(os.path.join(d, "special_tokens_map.json"),
                {"bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    tok = load_tokenizer(d)
    self.assertEqual((tok.bos_token, tok.eos_token), ("<s>", "</s>"))
    self.assertEqual(tok.eos_token_ids, (2,))

  def test_eos_ids_from_each_source(self):
    im_end, eot = self.hf.token_to_id("<|im_end|>"), self.hf.token_to_id("<|endoftext|>")
    self.assertEqual(self.hf.eos_token_ids, (im_end, eot))  # generation_config.json, a list
    self.assertEqual(self.kimi.eos_token_ids, (self.n_ranks + 1,))  # config.json, an int

    d = self.copy_dir(self.hf_dir)
    _write_json(os.path.join(d, "config.json"), {"eos_token_id": 7})
    self.assertEqual(load_tokenizer(d).eos_token_ids, (im_end, eot))  # generation_config first
    _write_json(os.path.join(d, "generation_config.json"), {"eos_token_id": 5})
    self.assertEqual(load_tokenizer(d).eos_token_ids, (5,))
    os.remove(os.path.join(d, "generation_config.json"))
    self.assertEqual(load_tokenizer(d).eos_token_ids, (7,))
    _write_json(os.path.join(d, "config.json"), {"text_config": {"eos_token_id": [8, 9]}})
    self.assertEqual(load_tokenizer(d).eos_token_ids, (8, 9))
    os.remove(os.path.join(d, "config.json"))
    self.assertEqual(load_tokenizer(d).eos_token_ids, (im_end,))  # the eos_token string

    d = self.copy_dir(self.kimi_dir, drop=["config.json"])
    self.assertEqual(load_tokenizer(d).eos_token_ids, (self.n_ranks + 1,))  # "[EOS]"

  def test_decode_refuses_unknown_ids(self):
    for tok in (self.hf, self.kimi):
      with self.assertRaisesRegex(ValueError, "not in the tokenizer"):
        tok.decode([1, tok.vocab_size])
      with self.assertRaisesRegex(ValueError, "not in the tokenizer"):
        tok.decode([-1])
    with self.assertRaises(TypeError):
      self.hf.decode([1.5])

  def test_no_tokenizer_is_none(self):
    d = temp_dir(self)
    self.assertIsNone(load_tokenizer(d))
    _write_json(os.path.join(d, "config.json"), {"eos_token_id": 1})
    _write_json(os.path.join(d, "tokenizer_config.json"), {"eos_token": "x"})
    self.assertIsNone(load_tokenizer(d))
    with self.assertRaises(FileNotFoundError):
      load_tokenizer(os.path.join(d, "missing"))

  def test_tokenizer_json_preferred_over_tiktoken(self):
    d = self.copy_dir(self.hf_dir)
    shutil.copyfile(os.path.join(self.kimi_dir, "tiktoken.model"),
                    os.path.join(d, "tiktoken.model"))
    self.assertEqual(load_tokenizer(d).backend, "tokenizers")

  def test_malformed_files_name_the_file(self):
    cases = [
        (self.hf_dir, "tokenizer.json", "{not json"),
        (self.hf_dir, "tokenizer.json", '{"model": 3}'),
        (self.hf_dir, "tokenizer_config.json", "[1, 2"),
        (self.hf_dir, "tokenizer_config.json", "[1, 2]"),
        (self.hf_dir, "generation_config.json", '{"eos_token_id": "two"}'),
        (self.hf_dir, "generation_config.json", '{"eos_token_id": [1, true]}'),
        (self.kimi_dir, "config.json", '{"eos_token_id": -1}'),
        (self.hf_dir, "tokenizer_config.json", '{"chat_template": 3}'),
        (self.hf_dir, "tokenizer_config.json", '{"eos_token": {"id": 3}}'),
        (self.kimi_dir, "tiktoken.model", "SGVsbG8= 0\nnot-base64! 1\n"),
        (self.kimi_dir, "tiktoken.model", "SGVsbG8= zero\n"),
        (self.kimi_dir, "tiktoken.model", "SGVsbG8= 0 extra\n"),
        (self.kimi_dir, "tiktoken.model", "SGVsbG8= 0\nSGk= 0\n"),
        (self.kimi_dir, "tiktoken.model", ""),
        (self.kimi_dir, "tokenizer_config.json",
         '{"added_tokens_decoder": {"5": {"content": "[BOS]", "special": true}}}'),
        (self.kimi_dir, "tokenizer_config.json", '{"added_tokens_decoder": {"x": {}}}'),
        (self.kimi_dir, "tokenizer_config.json", '{"added_tokens_decoder": {"999999": {}}}'),
    ]
    for src, name, content in cases:
      with self.subTest(name=name, content=content):
        d = self.copy_dir(src)
        with open(os.path.join(d, name), "w") as f:
          f.write(content)
        with self.assertRaises(TokenizerError) as cm:
          load_tokenizer(d)
        self.assertIn(os.path.join(d, name), str(cm.exception))

  def test_sentencepiece_only_is_refused(self):
    d = temp_dir(self)
    with open(os.path.join(d, "tokenizer.model"), "wb") as f:
      f.write(b"\x0a\x0b")
    with self.assertRaisesRegex(TokenizerError, "tokenizer.model"):
      load_tokenizer(d)

  def test_imports_no_jax_torch_or_transformers(self):
    code = ("import sys, mlkit.text; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'torch', 'transformers')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))


class ChatTemplateTest(_Fixtures):

  def test_chatml_generation_prompt_on_and_off(self):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    body = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n")
    self.assertEqual(self.hf.apply_chat_template(messages), body + "<|im_start|>assistant\n")
    self.assertEqual(self.hf.apply_chat_template(messages, add_generation_prompt=False), body)
    self.assertEqual(self.hf.chat_template, CHATML)

  def test_rendered_prompt_encodes_with_special_ids(self):
    prompt = self.hf.apply_chat_template([{"role": "user", "content": "你好"}])
    ids = self.hf.encode(prompt)
    self.assertEqual(ids[0], self.hf.token_to_id("<|im_start|>"))
    self.assertEqual(self.hf.decode(ids, skip_special_tokens=False), prompt)

  def test_tools_are_passed_through_as_json(self):
    messages = [{"role": "user", "content": "weather?"}]
    out = self.hf.apply_chat_template(messages, tools=TOOLS)
    self.assertIn("<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>", out)
    self.assertIn("天気を調べる 🌦", out)  # not \u-escaped, as transformers' tojson
    self.assertNotIn("<tools>", self.hf.apply_chat_template(messages))
    # A list of named templates: tool_use when tools are given, with tojson's options.
    out = self.kimi.apply_chat_template(messages, tools=TOOLS)
    self.assertTrue(out.startswith(
        "<|im_system|>tool_declare<|im_middle|>"
        + json.dumps(TOOLS, ensure_ascii=False, separators=(",", ":"), sort_keys=True)))
    self.assertEqual(self.kimi.chat_template, KIMI_DEFAULT)

  def test_bos_and_eos_variables(self):
    messages = [{"role": "user", "content": "hi"}]
    self.assertEqual(self.kimi.apply_chat_template(messages),
                     "[BOS]<|im_user|>user<|im_middle|>hi<|im_end|>"
                     "<|im_assistant|>assistant<|im_middle|>")
    self.assertTrue(self.kimi.apply_chat_template(messages, bos_token="<B>").startswith("<B><|"))
    d = self.copy_dir(self.hf_dir)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
      f.write("{{ bos_token }}|{{ eos_token }}|{{ messages | length }}|{{ strftime_now('%Y') }}")
    tok = load_tokenizer(d)  # chat_template.jinja wins over tokenizer_config.json's
    self.assertEqual(tok.apply_chat_template(messages),
                     f"None|<|im_end|>|1|{time.strftime('%Y')}")

  def test_extra_variables(self):
    messages = [{"role": "user", "content": "hi"}]
    self.assertTrue(self.hf.apply_chat_template(messages, enable_thinking=False)
                    .endswith("<|im_start|>assistant\n<think></think>"))
    self.assertTrue(self.hf.apply_chat_template(messages).endswith("<|im_start|>assistant\n"))

  def test_raise_exception(self):
    for tok in (self.hf, self.kimi):
      with self.assertRaisesRegex(ChatTemplateError, "(?i)unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])

  def test_template_errors(self):
    with self.assertRaisesRegex(ChatTemplateError, "ships no chat template"):
      self.bf.apply_chat_template([{"role": "user", "content": "hi"}])
    self.assertIsNone(self.bf.chat_template)
    d = self.copy_dir(self.hf_dir)
    for template, pattern in [("{% if %}", "does not compile"),
                              ("{{ messages.append(1) }}", "failed: SecurityError"),
                              ("{{ messages[0]['content'] + 1 }}", "failed: TypeError"),
                              ("{{ messages[5].content.upper() }}", "failed")]:
      with self.subTest(template=template):
        with open(os.path.join(d, "chat_template.jinja"), "w") as f:
          f.write(template)
        with self.assertRaisesRegex(ChatTemplateError, pattern) as cm:
          load_tokenizer(d).apply_chat_template([{"role": "user", "content": "hi"}])
        self.assertIn("chat_template.jinja", str(cm.exception))

  def test_list_without_default(self):
    d = self.copy_dir(self.kimi_dir)
    path = os.path.join(d, "tokenizer_config.json")
    with open(path) as f:
      config = json.load(f)
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    _write_json(path, config)
    tok = load_tokenizer(d)
    self.assertIsNone(tok.chat_template)
    self.assertEqual(tok.apply_chat_template([], tools=TOOLS), "T")
    with self.assertRaisesRegex(ChatTemplateError, "names no default chat template"):
      tok.apply_chat_template([])


class DetokenizerTest(_Fixtures):

  def random_sequences(self, tok, byte_ids, rng, count):
    """Random ids: any ids, multi-byte text as byte tokens (whole, cut, shuffled), mixtures."""
    text = "".join(SAMPLES) + "é漢🙂"
    for _ in range(count):
      kind = rng.randrange(4)
      if kind == 0:
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 16))]
      else:
        raw = "".join(rng.choice(text) for _ in range(rng.randint(1, 6))).encode()
        ids = [byte_ids[b] for b in raw]
        if kind == 2:
          ids = ids[rng.randrange(len(ids)):rng.randrange(len(ids) + 1)]
        elif kind == 3:
          rng.shuffle(ids)
          ids = ids + [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 4))]
      ids = [i for i in ids if tok._backend.valid[i]]  # pylint: disable=protected-access
      yield ids

  def check_invariant(self, tok, byte_ids, seed, count=1500):
    rng = random.Random(seed)
    for ids in self.random_sequences(tok, byte_ids, rng, count):
      for skip in (True, False):
        deltas, tail = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        self.assertEqual("".join(deltas) + tail, tok.decode(ids, skip_special_tokens=skip),
                         repr((ids, skip)))

  def test_invariant_byte_level_tokenizer_json(self):
    chars = byte_level_chars()
    self.check_invariant(self.hf, [self.hf.token_to_id(chars[b]) for b in range(256)], 0)

  def test_invariant_tiktoken(self):
    self.check_invariant(self.kimi, list(range(256)), 1)

  def test_invariant_byte_fallback_tokenizer_json(self):
    # DecodeStream alone breaks this one: ByteFallback turns a whole run of <0xNN> tokens into
    # U+FFFDs when any byte of it is invalid, so a run is given to the stream only when it ends.
    self.check_invariant(self.bf, [self.bf.token_to_id(f"<0x{b:02X}>") for b in range(256)], 2)

  def test_whole_characters_only(self):
    chars = byte_level_chars()
    for tok, byte_id in [(self.hf, lambda b: self.hf.token_to_id(chars[b])),
                         (self.kimi, lambda b: b),
                         (self.bf, lambda b: self.bf.token_to_id(f"<0x{b:02X}>"))]:
      with self.subTest(tok=tok.path):
        ids = [byte_id(b) for b in "a🙂漢!".encode()]
        if tok is self.bf:
          ids[-1] = self.bf.token_to_id("!")  # a piece, not a byte token
        deltas, tail = stream(IncrementalDetokenizer(tok), ids)
        if tok is self.bf:  # a byte run is released when a non-byte token ends it
          self.assertEqual(deltas, [""] * 8 + ["a🙂漢!"])
        else:
          self.assertEqual(deltas, ["a", "", "", "", "🙂", "", "", "漢", "!"])
        self.assertEqual(tail, "")

  def test_valid_streams_never_emit_replacement_characters(self):
    for tok in (self.hf, self.kimi, self.bf):
      for s in SAMPLES + ["".join(SAMPLES)]:
        deltas, tail = stream(IncrementalDetokenizer(tok), tok.encode(s))
        self.assertNotIn("\ufffd", "".join(deltas))
        self.assertEqual("".join(deltas) + tail, s)

  def test_incomplete_character_at_the_end(self):
    for tok, ids in [(self.kimi, [ord("a"), 0xF0, 0x9F]),
                     (self.hf, [self.hf.token_to_id(byte_level_chars()[b])
                                for b in (ord("a"), 0xF0, 0x9F)])]:
      deltas, tail = stream(IncrementalDetokenizer(tok), ids)
      self.assertEqual("".join(deltas), "a")
      self.assertEqual(tail, "\ufffd")  # one for the incomplete F0 9F, as decode has
      self.assertEqual(tok.decode(ids), "a\ufffd")

  def test_special_tokens(self):
    for tok, special in [(self.hf, "<|im_end|>"), (self.kimi, "<|im_end|>")]:
      ids = tok.encode("hi" + special + "🙂")
      for skip, expected in [(True, "hi🙂"), (False, "hi" + special + "🙂")]:
        deltas, tail = stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
        self.assertEqual("".join(deltas) + tail, expected)

  def test_add_checks_ids_and_flush_ends(self):
    detok = IncrementalDetokenizer(self.kimi)
    with self.assertRaisesRegex(ValueError, "not in the tokenizer"):
      detok.add(self.kimi.vocab_size)
    detok.add(ord("x"))
    self.assertEqual(detok.flush(), "")
    self.assertEqual(detok.flush(), "")
    with self.assertRaisesRegex(ValueError, "after flush"):
      detok.add(ord("x"))


class StopMatcherTest(absltest.TestCase):

  def test_stop_split_across_deltas(self):
    m = StopMatcher(["STOP"])
    self.assertEqual(m.feed("Hello ST"), ("Hello ", False))
    self.assertEqual(m.feed("O"), ("", False))
    self.assertEqual(m.feed("P and more"), ("", True))
    self.assertTrue(m.stopped)
    self.assertEqual(m.feed("more"), ("", True))
    self.assertEqual(m.flush(), "")

  def test_text_held_only_while_it_could_begin_a_stop(self):
    m = StopMatcher(["</answer>"])
    self.assertEqual(m.feed("a <"), ("a ", False))  # "<" might begin "</answer>"
    self.assertEqual(m.feed(" b and </an"), ("< b and ", False))
    self.assertEqual(m.feed("swer"), ("", False))
    self.assertEqual(m.feed("s"), ("</answers", False))  # turned out not to be the stop
    self.assertEqual(m.feed("plain"), ("plain", False))

  def test_released_at_the_end_without_a_stop(self):
    m = StopMatcher("END")
    self.assertEqual(m.feed("the EN"), ("the ", False))
    self.assertEqual(m.flush(), "EN")
    self.assertFalse(m.stopped)

  def test_stop_at_the_very_start(self):
    self.assertEqual(StopMatcher(["STOP"]).feed("STOP now"), ("", True))
    m = StopMatcher(["\n\n"])
    self.assertEqual(m.feed("\n"), ("", False))
    self.assertEqual(m.feed("\nrest"), ("", True))

  def test_earliest_stop_wins_and_overlaps(self):
    self.assertEqual(StopMatcher(["world", "lo w"]).feed("hello world"), ("hel", True))
    self.assertEqual(StopMatcher(["b", "ab"]).feed("xab"), ("x", True))  # end together
    m = StopMatcher(["aaba", "b"])  # "b" ends before "aaba" could: it counts, in any cuts
    self.assertEqual(m.feed("xaab"), ("xaa", True))
    self.assertEqual(StopMatcher(["aaba", "b"]).feed("xaaba"), ("xaa", True))
    m = StopMatcher(["aab"])
    self.assertEqual([m.feed(c) for c in "aaab"],
                     [("", False), ("", False), ("a", False), ("", True)])

  def test_no_stops_passes_through(self):
    for stops in (None, [], ()):
      m = StopMatcher(stops)
      self.assertEqual(m.feed("anything <|"), ("anything <|", False))
      self.assertEqual(m.flush(), "")

  def test_matches_a_reference_on_random_streams(self):
    rng = random.Random(3)
    for _ in range(3000):
      stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4)))
               for _ in range(rng.randint(1, 3))]
      full = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
      cuts = sorted(rng.sample(range(len(full) + 1), min(3, len(full) + 1)))
      deltas = [full[i:j] for i, j in zip([0] + cuts, cuts + [len(full)])]
      # The stop that ends first, whatever the cuts (of two ending together, the longer).
      hits = [(i + len(s), i) for s in stops if (i := full.find(s)) >= 0]
      expected = full[:min(hits)[1]] if hits else full
      m = StopMatcher(stops)
      out, seen = "", ""
      for delta in deltas:
        emit, stopped = m.feed(delta)
        out += emit
        seen += delta
        if stopped:
          break
        # Held back: exactly the longest tail of what was seen that begins a stop string.
        held = max((k for k in range(len(seen) + 1)
                    if any(s.startswith(seen[len(seen) - k:]) for s in stops)), default=0)
        self.assertEqual(out, seen[:len(seen) - held], repr((stops, deltas)))
      out += m.flush()
      self.assertEqual(out, expected, repr((stops, deltas)))
      self.assertEqual(m.stopped, bool(hits))

  def test_validation(self):
    StopMatcher(["x"] * text.MAX_STOP_STRINGS)
    StopMatcher(["y" * text.MAX_STOP_LENGTH])
    for bad in ([""], [3], ["ok", None], ["x"] * (text.MAX_STOP_STRINGS + 1),
                ["y" * (text.MAX_STOP_LENGTH + 1)], 5, {"a": 1}):
      with self.subTest(bad=bad):
        with self.assertRaises(ValueError):
          StopMatcher(bad)


class FilesTest(_Fixtures):

  def test_copy_tokenizer_files(self):
    for src in (self.hf_dir, self.kimi_dir):
      dst = os.path.join(temp_dir(self), "converted")
      copied = copy_tokenizer_files(src, dst)
      self.assertEqual(copied, [n for n in text.TOKENIZER_FILES if n in os.listdir(src)])
      self.assertNotIn("config.json", os.listdir(dst))
      for name in copied:
        with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "rb") as b:
          self.assertEqual(a.read(), b.read())
      a, b = load_tokenizer(src), load_tokenizer(dst)
      self.assertEqual(a.encode("".join(SAMPLES)), b.encode("".join(SAMPLES)))
      self.assertEqual(a.chat_template, b.chat_template)
    self.assertEqual(copy_tokenizer_files(temp_dir(self), temp_dir(self)), [])
    with self.assertRaises(FileNotFoundError):
      copy_tokenizer_files(os.path.join(temp_dir(self), "missing"), temp_dir(self))


if __name__ == "__main__":
  absltest.main()
