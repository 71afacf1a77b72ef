"""The OpenAI-compatible HTTP API of `python -m mlkit.serve --http`, with the official client.

A colocated server serves a Hugging Face checkpoint the test writes (a 2-layer
TINY_MLA with random weights and a byte-level BPE tokenizer trained here, with
a ChatML chat template), started as a real process on 127.0.0.1 with an API
key; the `openai` package talks to it. Greedy text must equal the in-process
engine's tokens decoded. A prefill/decode pair serving a Kimi-style
tiktoken.model checkpoint stands behind the same API. Request checking itself
is also tested in this process (OpenAiApiTest), where no server is needed.
"""

import dataclasses
import json
import os
import threading
import time

import httpx
import numpy as np
from absl.testing import absltest

from configs import TINY_MLA
from mlkit.sampling import SamplingParams
from mlkit.serve import launch
from mlkit.serve.http import openai_api as api
from mlkit.text import load_tokenizer

import tokenizer_fixtures as fixtures
from tempdirs import temp_dir

SERVE = ["--kv-dtype", "float32", "--num-pages", "96", "--max-running", "8",
         "--prefill-chunk", "16", "--max-pages-per-seq", "64", "--page-size", "4"]


def write_checkpoint(d: str, tokenizer: str, mtp: bool = False) -> str:
  """A Hugging Face checkpoint (config.json + safetensors, random 2-layer TINY_MLA, with its
  MTP layer when ``mtp``) with the tokenizer files of ``tokenizer`` ("bpe" or "kimi");
  returns its directory."""
  from mlkit.checkpoint import save_hf_checkpoint
  from mlkit.text import copy_tokenizer_files
  from numpy_params import init_params_np
  tok_dir, ckpt = os.path.join(d, "tokenizer"), os.path.join(d, "ckpt")
  os.makedirs(tok_dir)
  if tokenizer == "bpe":
    fixtures.write_byte_level_checkpoint(tok_dir)
  else:
    fixtures.write_kimi_checkpoint(tok_dir)
    # Kimi names its eos in config.json; the model's own config.json replaces that file.
    tok = load_tokenizer(tok_dir)
    fixtures._write_json(os.path.join(tok_dir, "generation_config.json"),
                         {"eos_token_id": list(tok.eos_token_ids)})
  tok = load_tokenizer(tok_dir)
  cfg = dataclasses.replace(TINY_MLA, vocab_size=tok.vocab_size, n_layers=2)
  # Drawn with numpy: the library's initialiser would compile a program per vocabulary size
  # (one per test class), and the server and the reference engine both load the saved file.
  save_hf_checkpoint(ckpt, init_params_np(cfg, mtp=() if mtp else None), cfg)
  copy_tokenizer_files(tok_dir, ckpt)
  return ckpt


def reference_engine(ckpt: str):
  """The engine the server builds, in this process (same params, same shapes)."""
  from mlkit.serve.model import ServeConfig, build_engine, load_model
  cfg = ServeConfig(role="colocated", checkpoint=ckpt, kv_dtype="float32", num_pages=96,
                    max_running=8, prefill_chunk=16, max_pages_per_seq=64, page_size=4)
  params, mcfg = load_model(cfg)
  return build_engine(cfg, params, mcfg)


def metric(text: str, name: str, default: float | None = None, **labels) -> float:
  """One sample's value from Prometheus text (``default`` when it has none yet)."""
  for line in text.splitlines():
    if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
      if line[len(name)] in " {":
        return float(line.rsplit(" ", 1)[1])
  if default is not None:
    return default
  raise KeyError(f"{name} {labels} not in the metrics")


class _Server(absltest.TestCase):
  """Starts servers for a test class and stops them at its end."""

  @classmethod
  def _launch(cls, role, listen, args, log):
    proc = launch.start(role, listen, args, log=log)
    cls.addClassCleanup(_stop, proc)
    return proc


def _stop(proc) -> None:
  proc.terminate()
  try:
    proc.wait(timeout=15)
  except Exception:  # noqa: BLE001
    proc.kill()
    proc.wait()


class HttpColocatedTest(_Server):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = temp_dir(cls, "mlkit-http-")
    cls.ckpt = write_checkpoint(cls.tmp, "bpe")
    cls.tok = load_tokenizer(cls.ckpt)
    cls.key = os.urandom(16).hex()
    key_file = os.path.join(cls.tmp, "api.key")
    with open(key_file, "w") as f:
      f.write(cls.key)
    cls.port = launch.free_port()
    cls.log = os.path.join(cls.tmp, "server.log")
    cls.control = f"127.0.0.1:{launch.free_port()}"
    cls.proc = cls._launch("colocated", cls.control,
                           ["--checkpoint", cls.ckpt, *SERVE, "--http", str(cls.port),
                            "--api-key-file", key_file, "--max-waiting", "40"], cls.log)
    cls.engine = reference_engine(cls.ckpt)  # compiles while the server starts
    launch.wait_ready(cls.proc, cls.log)
    cls.base = f"http://127.0.0.1:{cls.port}"
    # Imported where used: about a second, which each worker would pay collecting this file.
    import openai
    cls.client = openai.OpenAI(base_url=cls.base + "/v1", api_key=cls.key, max_retries=0,
                               timeout=120)
    cls.http = httpx.Client(base_url=cls.base, timeout=120,
                            headers={"Authorization": f"Bearer {cls.key}"})
    cls.model = cls.client.models.list().data[0].id

  def _ref(self, prompt_ids, max_tokens, **kw) -> list[int]:
    s = SamplingParams(max_new_tokens=max_tokens, stop_tokens=self.tok.eos_token_ids, **kw)
    return self.engine.generate([prompt_ids], s)[0]

  def _text(self, ids) -> str:
    return self.tok.decode(ids, skip_special_tokens=True)

  def test_local_load_drives_the_engine_thread_as_the_handlers_do(self):
    """mlkit.serve.local_load (serve_http's in-process way) on the server's engine, here: a
    closed and an open loop serve every request whole, the engine's own TTFT within the
    client's; and the server's histograms read from /metrics."""
    from mlkit.serve import local_load
    prompts = [self.tok.encode(t) for t in ("one two", "three", "four five six", "seven")]
    s = SamplingParams(max_new_tokens=4)  # no stop tokens: 4 tokens each
    for load in (dict(concurrency=2), dict(rate=40.0, seed=3)):
      r = local_load.drive(self.engine, prompts, s, **load)
      self.assertEqual((r["requests"], r["output_tokens"]), (4, 16), load)
      self.assertGreater(r["steps"], 0)
      self.assertGreater(r["device_ms_per_step"], 0.0)
      self.assertGreater(r["engine_mean_ttft_ms"], 0.0)
      self.assertLessEqual(r["engine_mean_ttft_ms"], r["mean_ttft_ms"])
    self.assertFalse(self.engine.has_unfinished())
    # serve_http's third way, the engine's own loop on the same workload.

    class Watched:  # the engine, counting requests in flight at each step; optionally the
      # request submitted `cancel`-th is cancelled as it is submitted (a real abort)
      def __init__(self, engine, cancel=None):
        self.engine, self.cancel, self.ids, self.in_flight = engine, cancel, [], []

      def submit(self, prompt, sampling):
        self.ids.append(self.engine.submit(prompt, sampling))
        if len(self.ids) == self.cancel:
          self.engine.cancel(self.ids[-1])
        return self.ids[-1]

      def get(self, rid):
        return self.engine.get(rid)

      def step(self):
        self.in_flight.append(sum(not self.engine.get(i).done for i in self.ids))
        return self.engine.step()

    # Three run together and end together; the fourth starts only then, and runs alone.
    watched = Watched(self.engine)
    r = local_load.engine_loop(watched, prompts, s, concurrency=3)
    self.assertEqual((r["requests"], r["output_tokens"]), (4, 16))
    self.assertEqual(max(watched.in_flight), 3)
    self.assertEqual(watched.in_flight[-1], 1)
    self.assertGreater(r["median_ttft_ms"], 0.0)
    self.assertGreater(r["median_tpot_ms"], 0.0)
    self.assertFalse(self.engine.has_unfinished())
    for bad, msg in ((dict(concurrency=0), "concurrency"), (dict(concurrency=1, prompts=[]),
                                                            "no prompts")):
      with self.assertRaisesRegex(ValueError, msg):
        local_load.engine_loop(self.engine, bad.pop("prompts", prompts), s, **bad)
    with self.assertRaisesRegex(RuntimeError, "aborted request .*cancelled"):
      local_load.engine_loop(Watched(self.engine, cancel=2), prompts, s, concurrency=2)
    self.engine.run_until_done()
    for bad in (dict(), dict(concurrency=2, rate=1.0), dict(concurrency=0), dict(rate=0.0)):
      with self.assertRaises(ValueError, msg=str(bad)):
        local_load.drive(self.engine, prompts, s, **bad)
    with self.assertRaisesRegex(ValueError, "no prompts"):
      local_load.drive(self.engine, [], s, concurrency=1)
    # The server's own figures over a window (serve_http's HTTP way): its engine's steps
    # through the control channel, its TTFT histogram from /metrics.
    from mlkit.serve.client import Client
    with Client(self.control) as control:
      before = local_load.server_snapshot(self.base, control.metrics(), api_key=self.key)
      for prompt in ([1, 2, 3], [4, 5]):
        self.client.completions.create(model=self.model, prompt=prompt, max_tokens=2)
      after = local_load.server_snapshot(self.base, control.metrics(), api_key=self.key)
    self.assertEqual(after["ttft_count"] - before["ttft_count"], 2)
    self.assertGreater(after["ttft_sum_s"], before["ttft_sum_s"])
    figures = local_load.server_figures(before, after)
    self.assertGreaterEqual(figures["steps"], 2)  # each request's prefill step at least
    self.assertGreater(figures["device_ms_per_step"], 0.0)
    self.assertAlmostEqual(figures["engine_mean_ttft_ms"], 1e3 * (
        after["ttft_sum_s"] - before["ttft_sum_s"]) / 2)
    self.assertEqual(local_load.server_figures(after, after)["engine_mean_ttft_ms"], 0.0)
    with self.assertRaisesRegex(KeyError, "no histogram"):
      local_load.served_histogram(self.base, "mlkit:no_such_histogram", api_key=self.key)

  def test_arrival_window_prefills_a_burst_in_one_step(self):
    """The front door's arrival window (mlkit.serve.decode.ArrivalWindow), on the server's
    engine here: requests that arrive less than its gap apart are all in the turn's one step;
    with the window off the first steps alone; it does not wait once the engine is full, and
    it closes at its max however many keep arriving."""
    import asyncio

    from mlkit.serve.decode import ArrivalWindow, ColocatedServer
    from mlkit.serve.http.calls import HTTP, Call
    loop = asyncio.new_event_loop()  # the calls' updates are queued there, never read
    self.addCleanup(loop.close)
    prompt, s = self.tok.encode("one two three"), SamplingParams(max_new_tokens=2)
    max_running = self.engine.config.max_running

    def turn(window, at_once: int, later: int = 0, spacing_s: float = 0.1):
      """One turn of a fresh front door: ``at_once`` requests queued before it, ``later`` more
      ``spacing_s`` apart while it runs. Returns (requests in its step, its seconds)."""
      server = ColocatedServer(self.engine, None, model_name="t", arrival_window=window)
      submit = lambda: server.inbox.queue.put(  # noqa: E731
          (HTTP, {"kind": "http_submit", "call": Call([prompt], [s], loop)}))
      for _ in range(at_once):
        submit()
      stop = threading.Event()

      def trickle():
        for _ in range(later):
          if stop.wait(spacing_s):
            return
          submit()
      thread = threading.Thread(target=trickle)
      thread.start()
      steps, t0 = self.engine.metrics()["steps"], time.monotonic()
      server.poll(0.0)
      took = time.monotonic() - t0
      taken = len(self.engine.running_ids()) + self.engine.num_waiting()
      self.assertEqual(self.engine.metrics()["steps"], steps + 1)
      stop.set()
      thread.join()
      while self.engine.has_unfinished() or not server.inbox.queue.empty():
        server.poll(0.0)  # the rest served, so the next turn starts from an idle engine
      return taken, took

    # Four arrivals 0.1 s apart: one step for all of them with a 2 s gap, the first alone
    # without the window.
    self.assertEqual(turn(ArrivalWindow(2.0, 30.0), 1, later=3)[0], 4)
    self.assertEqual(turn(ArrivalWindow(0.0, 0.0), 1, later=3)[0], 1)
    # A full engine steps at once: a 30 s gap would otherwise hold the turn.
    taken, took = turn(ArrivalWindow(30.0, 60.0), max_running)
    self.assertEqual(taken, max_running)
    self.assertLess(took, 20.0)
    # The window's max closes it: 0.5 s of arrivals 0.1 s apart, fewer than the engine takes.
    taken, took = turn(ArrivalWindow(0.4, 0.5), 1, later=max_running + 4)
    self.assertGreaterEqual(taken, 2)
    self.assertLess(taken, max_running)
    self.assertLess(took, 20.0)
    for bad in (dict(gap_s=-1.0), dict(max_s=-1.0), dict(gap_s=0.01, max_s=0.001)):
      with self.assertRaises(ValueError, msg=str(bad)):
        ArrivalWindow(**bad)

  def test_health_models_metrics_and_auth(self):
    self.assertEqual(httpx.get(self.base + "/health").status_code, 200)  # no key needed
    r = httpx.get(self.base + "/v1/models")
    self.assertEqual(r.status_code, 401)
    self.assertEqual(r.json()["error"]["type"], "authentication_error")
    self.assertEqual(httpx.get(self.base + "/v1/models",
                               headers={"Authorization": "Bearer wrong"}).status_code, 401)
    models = self.client.models.list().data
    self.assertEqual([m.id for m in models], ["ckpt"])
    self.client.completions.create(model=self.model, prompt="Hello", max_tokens=2)
    text = self.http.get("/metrics").text
    for name in ("mlkit:time_to_first_token_seconds_bucket", "mlkit:time_per_output_token_seconds",
                 "mlkit:e2e_request_latency_seconds", "mlkit:num_requests_running",
                 "mlkit:num_requests_waiting", "mlkit:kv_pages_used", "mlkit:kv_pages_free",
                 "mlkit:kv_pages_cached", "mlkit:kv_pages_quarantined",
                 "mlkit:prefix_cache_hit_rate", "mlkit:request_success_total"):
      self.assertIn(name, text)
    self.assertGreaterEqual(metric(text, "mlkit:e2e_request_latency_seconds_count"), 1)

  def test_completion_text_is_the_engines_tokens_decoded(self):
    prompt = "Hello world, the quick brown fox"
    ids = self.tok.encode(prompt, add_special_tokens=True)
    want = self._ref(ids, 12)
    r = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=12,
                                       temperature=0)
    (c,) = r.choices
    self.assertEqual(c.text, self._text(want))
    self.assertEqual(c.finish_reason, "stop" if want[-1] in self.tok.eos_token_ids else "length")
    self.assertEqual((r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens),
                     (len(ids), len(want), len(ids) + len(want)))
    # Streamed: the deltas add up to the same text; the last chunk carries the usage.
    chunks = list(self.client.completions.create(
        model=self.model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    self.assertEqual("".join(ch.choices[0].text for ch in chunks if ch.choices), c.text)
    self.assertEqual(chunks[-1].choices, [])
    self.assertEqual(chunks[-1].usage.completion_tokens, len(want))
    self.assertEqual(chunks[-2].choices[0].finish_reason, c.finish_reason)

  def test_token_id_prompts_and_n(self):
    prompts = [[5, 17, 99, 3], [7, 8, 9, 10, 11]]
    r = self.client.completions.create(model=self.model, prompt=prompts, max_tokens=6,
                                       temperature=0, n=2, extra_body={"ignore_eos": True})
    self.assertLen(r.choices, 4)
    for i, c in enumerate(r.choices):  # choice i*n + j is prompt i's j-th
      want = self.engine.generate([prompts[i // 2]], SamplingParams(max_new_tokens=6))[0]
      self.assertEqual(c.index, i)
      self.assertEqual(c.text, self._text(want))
    self.assertEqual(r.usage.prompt_tokens, 9)
    self.assertEqual(r.usage.completion_tokens, 24)
    # Sampled with a seed: reproducible, and the choices differ from one another.
    kw = dict(model=self.model, prompt="Hello", max_tokens=8, temperature=1.0, n=3, seed=11,
              extra_body={"ignore_eos": True})
    a = [c.text for c in self.client.completions.create(**kw).choices]
    b = [c.text for c in self.client.completions.create(**kw).choices]
    self.assertEqual(a, b)
    self.assertGreater(len(set(a)), 1)

  def test_chat_streamed_and_not(self):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello 🙂 你好"}]
    ids = self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True))
    want = self._ref(ids, 10)
    r = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=10,
                                            temperature=0)
    self.assertEqual(r.choices[0].message.role, "assistant")
    self.assertEqual(r.choices[0].message.content, self._text(want))
    self.assertEqual(r.usage.prompt_tokens, len(ids))
    chunks = list(self.client.chat.completions.create(
        model=self.model, messages=messages, max_tokens=10, temperature=0, stream=True))
    self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
    self.assertEqual("".join(ch.choices[0].delta.content or "" for ch in chunks),
                     r.choices[0].message.content)
    # max_completion_tokens is the chat name of max_tokens.
    r = self.client.chat.completions.create(model=self.model, messages=messages, temperature=0,
                                            max_completion_tokens=3,
                                            extra_body={"ignore_eos": True})
    self.assertEqual(r.usage.completion_tokens, 3)

  def test_stop_strings_are_never_emitted(self):
    ids = [9, 8, 7, 6, 5, 4]
    want_ids = self.engine.generate([ids], SamplingParams(max_new_tokens=24))[0]
    want = self._text(want_ids)
    self.assertGreater(len(want), 6, want)
    stop = want[3:6]  # text in the middle of the output
    cut = want[:want.index(stop)]
    for stream in (False, True):
      out = self.client.completions.create(model=self.model, prompt=ids, max_tokens=24,
                                           temperature=0, stop=[stop, "never-seen"],
                                           stream=stream, extra_body={"ignore_eos": True})
      if stream:
        chunks = list(out)
        text = "".join(ch.choices[0].text for ch in chunks)
        finish = chunks[-1].choices[0].finish_reason
      else:
        text, finish = out.choices[0].text, out.choices[0].finish_reason
      self.assertEqual(text, cut, stream)
      self.assertEqual(finish, "stop")
    out = self.client.completions.create(model=self.model, prompt=ids, max_tokens=24,
                                         temperature=0, extra_body={"stop_token_ids": [want_ids[1]]})
    self.assertEqual(out.choices[0].finish_reason, "stop")

  def test_logprobs(self):
    r = self.client.completions.create(model=self.model, prompt=[1, 2, 3], max_tokens=5,
                                       temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    self.assertLen(lp.tokens, 5)
    self.assertLen(lp.token_logprobs, 5)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
      self.assertLen(top, 3)
      self.assertLessEqual(chosen, 0.0)
      self.assertAlmostEqual(chosen, max(top.values()), places=5)  # greedy: the top-1
    r = self.client.chat.completions.create(
        model=self.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0.8, seed=3, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    self.assertLen(content, 4)
    for e in content:
      self.assertLen(e.top_logprobs, 2)
      self.assertGreaterEqual(e.top_logprobs[0].logprob, e.top_logprobs[1].logprob)

  def test_errors_are_openai_shaped(self):
    def post(path, body, **kw):
      return self.http.post(path, content=body if isinstance(body, bytes) else json.dumps(body),
                            headers={"Content-Type": "application/json"}, **kw)

    cases = [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {"model": self.model, "prompt": "x", "temperature": -1}, 400,
         "temperature"),
        ("/v1/completions", {"model": self.model, "prompt": [1, 300]}, 400, "prompt"),
        ("/v1/completions", {"model": self.model, "prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"model": self.model, "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": self.model, "prompt": "x", "stop": [""]}, 400, "stop"),
        ("/v1/completions", {"model": self.model, "prompt": "x", "logprobs": 21}, 400,
         "logprobs"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": self.model, "prompt": list(range(1, 290)) * 2}, 400,
         "prompt"),
        ("/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": 10_000}, 400,
         "max_tokens"),
        ("/v1/completions", {"model": self.model, "prompt": "x", "presence_penalty": 1}, 400,
         "presence_penalty"),
        ("/v1/chat/completions", {"model": self.model, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": self.model, "messages": [{"role": "alien",
                                                                     "content": "x"}]},
         400, "messages"),
        ("/v1/chat/completions", {"model": self.model, "messages": [{"role": "user",
                                                                     "content": "x"}],
                                  "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/completions", {"model": self.model, "prompt": [[1, 2]] * 41}, 503, None),
        ("/v1/nothing", {}, 404, None),
    ]
    for path, body, status, param in cases:
      r = post(path, body)
      self.assertEqual(r.status_code, status, (body, r.text))
      err = r.json()["error"]
      self.assertEqual(set(err), {"message", "type", "param", "code"})
      self.assertEqual(err["param"], param, (body, err))
      if status == 503:
        self.assertEqual(r.headers["retry-after"], "1")
    import openai
    with self.assertRaises(openai.BadRequestError):
      self.client.completions.create(model=self.model, prompt="x", top_p=0)
    # The server is unharmed: a normal request still works.
    self.client.completions.create(model=self.model, prompt="Hello", max_tokens=2)

  def test_the_control_socket_refuses_code_and_bad_frames(self):
    # The colocated server's control channel (mlkit.wire) beside its HTTP API: a pickle
    # payload never runs, bad frames get an error and a closed connection, strangers no
    # connection; the server then serves on.
    from mlkit import wire
    from mlkit.serve import protocol as proto
    from test_wire import pickle_bytes
    marker = os.path.join(self.tmp, "ran")
    for body in (pickle_bytes(marker), wire.encode({"kind": "exec"}), b"\xc1"):
      conn = wire.connect(proto.parse_address(self.control), wire.client_key())
      conn.send_frame(body)
      self.assertEqual(conn.recv(proto.reply_kinds())["kind"], "error")
      with self.assertRaises((EOFError, ConnectionError)):
        conn.recv_frame()
      conn.close()
    with self.assertRaises(wire.AuthenticationError):
      wire.connect(proto.parse_address(self.control), os.urandom(32))
    self.assertFalse(os.path.exists(marker))
    self.client.completions.create(model=self.model, prompt="Hello", max_tokens=2)

  def test_a_client_that_disconnects_frees_its_pages(self):
    # 16 choices of 250 tokens on 8 running slots: long enough that the client is gone
    # well before the last one would end, even on a loaded machine.
    body = {"model": self.model, "prompt": [3, 4, 5], "max_tokens": 250, "stream": True,
            "ignore_eos": True, "n": 16}
    before = metric(self.http.get("/metrics").text, "mlkit:request_aborts_total", 0.0,
                    reason="cancelled")
    with httpx.Client(base_url=self.base, timeout=60,
                      headers={"Authorization": f"Bearer {self.key}"}) as c:
      with c.stream("POST", "/v1/completions", json=body) as r:
        self.assertEqual(r.status_code, 200)
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        self.assertTrue(any(line.startswith("data: {") for line in got))
    text = self._wait_idle(before + 8)
    before = metric(text, "mlkit:request_aborts_total", reason="cancelled")
    # Waiting for a whole (not streamed) response, then gone: cancelled the same way.
    with httpx.Client(base_url=self.base, timeout=httpx.Timeout(60, read=0.1),
                      headers={"Authorization": f"Bearer {self.key}"}) as c:
      with self.assertRaises(httpx.ReadTimeout):
        c.post("/v1/completions", json=dict(body, stream=False))
    self._wait_idle(before + 8)

  def _wait_idle(self, cancelled: float) -> str:
    """Waits until no page is used, nothing runs, and at least ``cancelled`` requests were
    cancelled (the gauges refresh every half second); returns the metrics text."""
    deadline = time.monotonic() + 15
    while True:
      text = self.http.get("/metrics").text
      if (metric(text, "mlkit:kv_pages_used") == 0
          and metric(text, "mlkit:num_requests_running") == 0
          and metric(text, "mlkit:request_aborts_total", 0.0, reason="cancelled") >= cancelled):
        return text
      self.assertLess(time.monotonic(), deadline, text[-2000:])
      time.sleep(0.1)

  def test_32_concurrent_streams_match_one_alone(self):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 290, int(rng.integers(3, 20))).tolist() for _ in range(32)]

    def stream(p) -> str:
      chunks = self.client.completions.create(model=self.model, prompt=p, max_tokens=8,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
      return "".join(ch.choices[0].text for ch in chunks)

    alone = [stream(p) for p in prompts[:4]]
    results = [None] * 32
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream(prompts[i])))
               for i in range(32)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
    self.assertEqual(results[:4], alone)
    for p, text in zip(prompts, results):
      want = self.engine.generate([p], SamplingParams(max_new_tokens=8))[0]
      self.assertEqual(text, self._text(want))


  def test_bench_client_against_the_server(self):
    from mlkit.serve import bench
    out = os.path.join(temp_dir(self, "mlkit-bench-"), "bench.json")
    cfg = bench.BenchConfig(base_url=self.base, api_key=self.key, num_prompts=8,
                            max_concurrency=4, random_input_len=12, random_output_len=6,
                            random_vocab_size=256, ignore_eos=True, output_json=out,
                            progress_interval_s=0)
    result = bench.benchmark(cfg)
    m = result["metrics"]
    self.assertEqual((m["completed"], m["failed"]), (8, 0))
    self.assertEqual(m["total_output_tokens"], 48)
    self.assertEqual(m["total_input_tokens"], 96)
    for k in ("median_ttft_ms", "p99_itl_ms", "median_tpot_ms", "output_throughput"):
      self.assertGreater(m[k], 0, k)
    with open(out) as f:
      self.assertEqual(json.load(f)["metrics"]["completed"], 8)


class HttpDisaggregatedTest(_Server):
  """A prefill/decode pair behind the API, serving a Kimi-style tiktoken.model checkpoint that
  ships an MTP layer, with speculative decoding on (two drafts per step): its greedy text
  is the plain engine's."""

  def test_pair_serves_the_api(self):
    tmp = temp_dir(self, "mlkit-http-pair-")
    ckpt = write_checkpoint(tmp, "kimi", mtp=True)
    tok = load_tokenizer(ckpt)
    self.assertEqual(tok.backend, "tiktoken")
    pre_addr, dec_addr = (f"127.0.0.1:{launch.free_port()}" for _ in range(2))
    port = launch.free_port()
    logs = [os.path.join(tmp, f"{r}.log") for r in ("prefill", "decode")]
    common = ["--checkpoint", ckpt, *SERVE, "--speculative-tokens", "2"]
    procs = [self._launch("prefill", pre_addr, common, logs[0]),
             self._launch("decode", dec_addr, [*common, "--prefill", pre_addr, "--http",
                                               str(port), "--connect-timeout", "120"], logs[1])]
    engine = reference_engine(ckpt)
    for proc, log in zip(procs, logs):
      launch.wait_ready(proc, log)
    with open(logs[1]) as f:
      log = f.read()
    self.assertIn("tokenizer from", log)
    self.assertRegex(log, r"weights: .*attention")
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Hello world 你好"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    self.assertEqual(ids[0], tok.encode("[BOS]")[0])
    want = engine.generate([ids], SamplingParams(max_new_tokens=8,
                                                 stop_tokens=tok.eos_token_ids))[0]
    r = client.chat.completions.create(model="ckpt", messages=messages, max_tokens=8,
                                       temperature=0)
    self.assertEqual(r.choices[0].message.content, tok.decode(want))
    chunks = list(client.chat.completions.create(model="ckpt", messages=messages, max_tokens=8,
                                                 temperature=0, stream=True, logprobs=True))
    self.assertEqual("".join(c.choices[0].delta.content or "" for c in chunks),
                     r.choices[0].message.content)
    self.assertLen([e for c in chunks if c.choices and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content], len(want))
    deadline = time.monotonic() + 10  # the gauges refresh every half second
    while metric(httpx.get(f"http://127.0.0.1:{port}/metrics").text,
                 "mlkit:kv_transfers_total", 0.0) < 2:
      self.assertLess(time.monotonic(), deadline)
      time.sleep(0.1)
    # The decode server verified drafts, up to two per row (fewer where max_tokens is near).
    self.assertIn("speculative decoding: 2 drafts", log)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    rows = metric(text, "mlkit:spec_decode_num_drafts_total")
    drafts = metric(text, "mlkit:spec_decode_num_draft_tokens_total")
    self.assertGreater(rows, 0)
    self.assertTrue(0 < drafts <= 2 * rows, (rows, drafts))
    self.assertLessEqual(metric(text, "mlkit:spec_decode_num_accepted_tokens_total"), drafts)


class OpenAiApiTest(absltest.TestCase):
  """Request checking without a server."""

  def test_a_checkpoint_without_tokenizer_takes_token_ids_only(self):
    ctx = api.Context(model="m", vocab_size=100, max_tokens=64, max_logprobs=5, tokenizer=None)
    plan = api.parse_completion({"prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "seed": 7}, ctx)
    self.assertEqual(plan.choice_prompts, [[1, 2, 3], [1, 2, 3]])
    self.assertEqual([s.seed for s in plan.samplings], [7, 8])
    self.assertEqual(plan.samplings[0].stop_tokens, ())
    for body, param in (({"prompt": "text"}, "prompt"),
                        ({"prompt": [1], "stop": "x"}, "stop"),
                        ({"messages": [{"role": "user", "content": "x"}]}, "messages")):
      with self.assertRaises(api.ApiError) as e:
        (api.parse_chat if "messages" in body else api.parse_completion)(body, ctx)
      self.assertEqual((e.exception.status, e.exception.param), (400, param))
      self.assertRegex(e.exception.message, "ships no tokenizer|ships none")
    plan = api.parse_completion({"prompt": [1], "logprobs": 5, "stop_token_ids": [9],
                                 "top_k": -1}, ctx)
    self.assertEqual((plan.samplings[0].logprobs, plan.samplings[0].stop_tokens,
                      plan.samplings[0].top_k), (5, (9,), 0))
    with self.assertRaisesRegex(api.ApiError, "at most 5 top"):
      api.parse_completion({"prompt": [1], "logprobs": 6}, ctx)

  def test_choice_text_holds_back_stop_strings(self):
    tmp = temp_dir(self, "mlkit-http-tok-")
    fixtures.write_byte_level_checkpoint(tmp)
    tok = load_tokenizer(tmp)
    ctx = api.Context(model="m", vocab_size=tok.vocab_size, max_tokens=256, max_logprobs=0,
                      tokenizer=tok)
    plan = api.parse_completion({"prompt": "x", "stop": "world"}, ctx)
    ids = tok.encode("Hello world, again")
    c = api.ChoiceText(plan, tok)
    out = "".join(c.feed([t], None)[0] for t in ids)
    self.assertEqual(c.feed([ids[0]], None), ("", [], []))  # past the stop: nothing
    self.assertEqual(out, "Hello ")
    self.assertTrue(c.stopped)
    self.assertEqual(c.finish(None), "")
    self.assertEqual(c.finish_reason, "stop")


if __name__ == "__main__":
  absltest.main()
