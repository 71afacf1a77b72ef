"""mlkit.serve.bench's pure pieces, and its command line's failures, with no model server.

A benchmark's numbers are only as good as its parsing and its arithmetic, so
those are checked here on recorded bytes and synthetic records: the SSE parser
on streams split at awkward places, the metrics against hand-computed values,
the Poisson arrivals, the prompts (random and from files), the config's checks,
and the command line's exit statuses (2 for bad arguments, 1, at once, for a
server that is not there). The run against the real mlkit server is elsewhere.
"""

import contextlib
import io
import json
import math
import os
import socket
import subprocess
import sys
import time

import numpy as np
from absl.testing import absltest, parameterized

from mlkit.serve import bench

from tempdirs import temp_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A completions stream as a server sends it: three text chunks, the usage, then [DONE].
COMPLETION_STREAM = (
    b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"Hel",'
    b'"finish_reason":null}],"usage":null}\n\n'
    b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"lo \xc3\xbc",'
    b'"finish_reason":null}],"usage":null}\n\n'
    b': a comment line\n\n'
    b'data: {"id":"c1","object":"text_completion","choices":[{"index":0,"text":"!",'
    b'"finish_reason":"length"}],"usage":null}\n\n'
    b'data: {"id":"c1","object":"text_completion","choices":[],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n'
    b'data: [DONE]\n\n')


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]  # closed again when the with ends: nothing listens


def _feed_pieces(data: bytes, cuts) -> list[str]:
  p = bench.SSEParser()
  out, last = [], 0
  for c in (*cuts, len(data)):
    out += p.feed(data[last:c])
    last = c
  return out + p.close()


def _record(i, ttft=None, itl=(), latency=None, out=0, prompt=None, plen=None, error=None):
  r = bench.RequestRecord(i, plen, 16)
  r.ttft_s, r.itl_s, r.latency_s = ttft, list(itl), latency
  r.output_tokens, r.prompt_tokens, r.error = out, prompt, error
  r.success = error is None
  return r


class SSEParserTest(parameterized.TestCase):

  def test_whole_stream_at_once(self):
    events = _feed_pieces(COMPLETION_STREAM, ())
    self.assertLen(events, 5)
    self.assertEqual(events[-1], "[DONE]")
    self.assertEqual(json.loads(events[1])["choices"][0]["text"], "lo ü")

  def test_every_split_point_gives_the_same_events(self):
    whole = _feed_pieces(COMPLETION_STREAM, ())
    for cut in range(1, len(COMPLETION_STREAM)):  # mid-line, mid-"data:", mid-character
      self.assertEqual(_feed_pieces(COMPLETION_STREAM, (cut,)), whole, f"split at {cut}")

  def test_byte_by_byte(self):
    self.assertEqual(_feed_pieces(COMPLETION_STREAM, range(1, len(COMPLETION_STREAM))),
                     _feed_pieces(COMPLETION_STREAM, ()))

  @parameterized.parameters(b"\r\n", b"\r", b"\n")
  def test_line_endings(self, eol):
    data = COMPLETION_STREAM.replace(b"\n", eol)
    whole = _feed_pieces(data, ())
    self.assertEqual(whole, _feed_pieces(COMPLETION_STREAM, ()))
    # a CRLF split between its CR and its LF is one line end, not two
    for i in range(len(data)):
      if data[i:i + 1] == b"\r":
        self.assertEqual(_feed_pieces(data, (i + 1,)), whole)

  def test_multi_line_event_and_fields(self):
    data = (b"event: message\nid: 7\nretry: 100\ndata: first\ndata:second\ndata\n\n"
            b"data: [DONE]\n\n")
    self.assertEqual(_feed_pieces(data, (9, 30)), ["first\nsecond\n", "[DONE]"])

  def test_byte_order_mark_split(self):
    data = b"\xef\xbb\xbfdata: x\n\n"
    self.assertEqual(_feed_pieces(data, (1, 2)), ["x"])

  def test_end_without_blank_line(self):
    p = bench.SSEParser()
    self.assertEqual(p.feed(b'data: {"a": 1}\ndata: [DO'), [])
    self.assertEqual(p.close(), ['{"a": 1}\n[DO'])

  def test_no_event_before_its_blank_line(self):
    p = bench.SSEParser()
    self.assertEqual(p.feed(b"data: one\n"), [])
    self.assertEqual(p.feed(b"\n"), ["one"])


class EventTest(absltest.TestCase):

  def test_completion_chunks(self):
    ev = bench.parse_event('{"choices":[{"index":0,"text":"hi","finish_reason":null}]}')
    self.assertTrue(ev.is_content)
    self.assertEqual(ev.text, "hi")
    ev = bench.parse_event('{"choices":[{"index":0,"text":"","finish_reason":"stop"}]}')
    self.assertFalse(ev.is_content)
    self.assertEqual(ev.finish_reason, "stop")

  def test_chat_role_chunk_is_not_content(self):
    ev = bench.parse_event('{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}')
    self.assertFalse(ev.is_content)
    ev = bench.parse_event('{"choices":[{"index":0,"delta":{"content":"x"}}]}')
    self.assertEqual(ev.text, "x")
    ev = bench.parse_event('{"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}')
    self.assertTrue(ev.is_content)

  def test_token_ids_are_content(self):
    ev = bench.parse_event('{"choices":[{"index":0,"text":"","token_ids":[5,6]}]}')
    self.assertTrue(ev.is_content)
    self.assertEqual(ev.token_ids, 2)

  def test_done_usage_and_errors(self):
    self.assertTrue(bench.parse_event("[DONE]").done)
    ev = bench.parse_event('{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":9}}')
    self.assertEqual(ev.usage["completion_tokens"], 9)
    self.assertFalse(ev.is_content)
    ev = bench.parse_event('{"error":{"message":"the server aborted the request","type":'
                           '"server_error","param":null,"code":"aborted"}}')
    self.assertEqual(ev.error, "the server aborted the request")
    self.assertIn("malformed", bench.parse_event("{not json").error)

  def test_http_error_message(self):
    body = json.dumps({"error": {"message": "'max_tokens' must be >= 1", "type":
                                 "invalid_request_error", "param": "max_tokens"}}).encode()
    self.assertEqual(bench.http_error_message(400, body), "HTTP 400: 'max_tokens' must be >= 1")
    self.assertEqual(bench.http_error_message(422, b'{"detail": "bad"}'), "HTTP 422: bad")
    self.assertEqual(bench.http_error_message(502, b"Bad Gateway"), "HTTP 502: Bad Gateway")
    self.assertEqual(bench.http_error_message(503, b""), "HTTP 503: (empty body)")


class StreamRecorderTest(absltest.TestCase):

  def _recorded(self, data: bytes, times) -> bench.RequestRecord:
    rec, p = bench.StreamRecorder(), bench.SSEParser()
    for event, t in zip(p.feed(data) + p.close(), times):
      rec.add(event, t)
    r = bench.RequestRecord(0, 5, 3)
    rec.fill(r, 10.0, 10.5)
    return r

  def test_timings_and_usage(self):
    r = self._recorded(COMPLETION_STREAM, [10.1, 10.15, 10.3, 10.45, 10.5])
    self.assertTrue(r.success)
    self.assertIsNone(r.error)
    self.assertAlmostEqual(r.ttft_s, 0.1)
    np.testing.assert_allclose(r.itl_s, [0.05, 0.15])
    self.assertAlmostEqual(r.latency_s, 0.5)
    self.assertEqual((r.output_tokens, r.prompt_tokens, r.finish_reason), (3, 5, "length"))
    self.assertAlmostEqual(r.tpot_s, (0.5 - 0.1) / 2)

  def test_without_usage_counts_content_chunks(self):
    data = COMPLETION_STREAM.replace(b'"usage":{"prompt_tokens":5,"completion_tokens":3,'
                                     b'"total_tokens":8}', b'"usage":null')
    r = self._recorded(data, [10.1, 10.2, 10.3, 10.4, 10.5])
    self.assertEqual((r.output_tokens, r.prompt_tokens), (3, None))

  def test_error_event_fails_the_request(self):
    data = (b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
            b'data: {"error":{"message":"the server aborted the request: choice 0: transfer",'
            b'"type":"server_error"}}\n\ndata: [DONE]\n\n')
    r = self._recorded(data, [10.1, 10.2, 10.3])
    self.assertFalse(r.success)
    self.assertEqual(r.error, "the server aborted the request: choice 0: transfer")

  def test_truncated_stream_fails_the_request(self):
    r = self._recorded(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n', [10.1])
    self.assertFalse(r.success)
    self.assertIn("ended", r.error)


class MetricsTest(absltest.TestCase):

  def test_counts_throughput_and_percentiles(self):
    records = [
        _record(0, ttft=0.1, itl=[0.01, 0.03], latency=0.2, out=3, prompt=10),
        _record(1, ttft=0.3, itl=[0.02], latency=0.5, out=2, prompt=20),
        _record(2, ttft=0.2, itl=[], latency=0.4, out=1, plen=7),  # no usage: its prompt_len
        _record(3, error="HTTP 400: no", out=0, prompt=99),
    ]
    m = bench.compute_metrics(records, 2.0)
    self.assertEqual((m["completed"], m["failed"]), (3, 1))
    self.assertEqual((m["total_input_tokens"], m["total_output_tokens"]), (37, 6))
    self.assertAlmostEqual(m["request_throughput"], 1.5)
    self.assertAlmostEqual(m["output_throughput"], 3.0)
    self.assertAlmostEqual(m["total_token_throughput"], 21.5)
    self.assertAlmostEqual(m["mean_ttft_ms"], 200.0)
    self.assertAlmostEqual(m["median_ttft_ms"], 200.0)
    self.assertAlmostEqual(m["p90_ttft_ms"], 280.0)  # linear: 200 + 0.8 * 100
    self.assertAlmostEqual(m["p99_ttft_ms"], 298.0)
    tpots = [(0.2 - 0.1) / 2 * 1000, (0.5 - 0.3) / 1 * 1000]  # request 2 has one token
    self.assertAlmostEqual(m["mean_tpot_ms"], np.mean(tpots))
    self.assertAlmostEqual(m["p90_tpot_ms"], np.percentile(tpots, 90, method="linear"))
    itls = [10.0, 30.0, 20.0]
    self.assertAlmostEqual(m["mean_itl_ms"], 20.0)
    self.assertAlmostEqual(m["median_itl_ms"], 20.0)
    self.assertAlmostEqual(m["p99_itl_ms"], np.percentile(itls, 99, method="linear"))
    self.assertAlmostEqual(m["median_e2e_ms"], 400.0)
    self.assertAlmostEqual(m["p90_e2e_ms"], 480.0)

  def test_nothing_completed(self):
    m = bench.compute_metrics([_record(0, error="refused")], 1.0)
    self.assertEqual((m["completed"], m["failed"]), (0, 1))
    self.assertIsNone(m["median_ttft_ms"])
    self.assertIsNone(m["p99_itl_ms"])
    self.assertEqual(m["request_throughput"], 0.0)
    json.dumps(m, allow_nan=False)  # valid JSON
    bench.compute_metrics([], 0.0)

  def test_report_table_and_json(self):
    records = [_record(0, ttft=0.1, itl=[0.01], latency=0.2, out=2, prompt=3),
               _record(1, error="HTTP 503: busy")]
    result = {"base_url": "http://h:1", "endpoint": "completions", "model": "m",
              "request_rate": "inf", "max_concurrency": 4,
              "metrics": bench.compute_metrics(records, 1.0),
              "requests": [r.to_json() for r in records]}
    table = bench.format_result(result)
    self.assertIn("HTTP 503: busy", table)
    self.assertRegex(table, r"TTFT\s+100\.00\s+100\.00")
    self.assertIn("concurrency", bench.format_sweep([result, result]))
    self.assertEqual(result["requests"][0]["tpot_s"], 0.1)
    json.dumps(result, allow_nan=False)

  def test_summary_keys_as_the_in_process_loads(self):
    records = [_record(0, ttft=0.1, itl=[0.01, 0.03], latency=0.2, out=3, prompt=10),
               _record(1, ttft=0.3, itl=[0.02], latency=0.5, out=2, prompt=20)]
    result = {"metrics": bench.compute_metrics(records, 2.0),
              "requests": [r.to_json() for r in records]}
    self.assertEqual(bench.summary(result), {
        "requests": 2, "output_tokens": 5, "duration_s": 2.0, "output_tok_s": 2.5,
        "median_ttft_ms": 200.0, "mean_ttft_ms": 200.0,
        "median_tpot_ms": result["metrics"]["median_tpot_ms"]})
    records.append(_record(2, error="HTTP 503: busy"))
    records.append(_record(3, error="HTTP 400: no"))
    failed = {"metrics": bench.compute_metrics(records, 2.0),
              "requests": [r.to_json() for r in records]}
    with self.assertRaisesRegex(RuntimeError, "2 of 4 HTTP requests failed; the first: "
                                              "HTTP 503: busy"):
      bench.summary(failed)


class ArrivalsTest(absltest.TestCase):

  def test_poisson_mean_gap(self):
    for rate in (0.5, 4.0, 100.0):
      t = bench.arrival_times(20000, rate, seed=3)
      self.assertEqual(t[0], 0.0)
      gaps = np.diff(t)
      self.assertTrue(np.all(gaps >= 0))
      self.assertAlmostEqual(gaps.mean() * rate, 1.0, delta=0.03)
      self.assertAlmostEqual(gaps.std() * rate, 1.0, delta=0.05)  # exponential: std = mean

  def test_fixed_seed(self):
    np.testing.assert_array_equal(bench.arrival_times(50, 2.0, 7), bench.arrival_times(50, 2.0, 7))
    self.assertFalse(np.array_equal(bench.arrival_times(50, 2.0, 7),
                                    bench.arrival_times(50, 2.0, 8)))

  def test_inf_sends_all_at_once(self):
    np.testing.assert_array_equal(bench.arrival_times(10, math.inf, 0), np.zeros(10))
    self.assertLen(bench.arrival_times(0, 1.0, 0), 0)


class PromptsTest(absltest.TestCase):

  def test_random_token_prompts(self):
    cfg = bench.BenchConfig("http://127.0.0.1:1", num_prompts=12, random_input_len=37,
                            random_output_len=9, random_vocab_size=50, seed=1)
    prompts = bench.build_prompts(cfg)
    self.assertLen(prompts, 12)
    for p in prompts:
      self.assertLen(p.prompt, 37)
      self.assertTrue(all(isinstance(t, int) and 0 <= t < 50 for t in p.prompt))
      self.assertEqual((p.prompt_len, p.output_len), (37, 9))
    self.assertEqual(len({tuple(p.prompt) for p in prompts}), 12)  # all different
    self.assertEqual(bench.build_prompts(cfg), prompts)  # the seed fixes them
    body = bench.request_body(cfg, "m", prompts[0])
    self.assertEqual(body["prompt"], prompts[0].prompt)
    self.assertEqual((body["max_tokens"], body["stream"], body["stream_options"]),
                     (9, True, {"include_usage": True}))
    self.assertNotIn("ignore_eos", body)

  def test_chat_prompts_are_words(self):
    cfg = bench.BenchConfig("http://127.0.0.1:1", endpoint="chat", num_prompts=3,
                            random_input_len=20, ignore_eos=True, temperature=0.5)
    prompts = bench.build_prompts(cfg)
    self.assertTrue(all(isinstance(p.prompt, str) and len(p.prompt.split()) == 20
                        for p in prompts))
    body = bench.request_body(cfg, "m", prompts[0])
    self.assertEqual(body["messages"], [{"role": "user", "content": prompts[0].prompt}])
    self.assertEqual((body["max_completion_tokens"], body["ignore_eos"], body["temperature"]),
                     (128, True, 0.5))

  def test_jsonl_file(self):
    path = os.path.join(temp_dir(self), "prompts.jsonl")
    with open(path, "w") as f:
      f.write('{"prompt": [1, 2, 3], "output_len": 5}\n\n{"prompt": "hello ü"}\n')
    cfg = bench.BenchConfig("http://127.0.0.1:1", prompts_file=path, random_output_len=11)
    prompts = bench.build_prompts(cfg)
    self.assertEqual([(p.prompt, p.output_len, p.prompt_len) for p in prompts],
                     [([1, 2, 3], 5, 3), ("hello ü", 11, None)])
    # more prompts than the file holds: its prompts again, in order
    more = bench.build_prompts(bench.BenchConfig("http://127.0.0.1:1", prompts_file=path,
                                                 num_prompts=5))
    self.assertEqual([p.prompt for p in more], [[1, 2, 3], "hello ü"] * 2 + [[1, 2, 3]])
    with self.assertRaisesRegex(ValueError, "chat endpoint takes text"):
      bench.build_prompts(bench.BenchConfig("http://127.0.0.1:1", prompts_file=path,
                                            endpoint="chat"))

  def test_jsonl_errors_name_the_line(self):
    d = temp_dir(self)
    for name, text, msg in [("a.jsonl", '{"prompt": "x"}\n{"prompt": [1, -2]}\n', ":2: 'prompt'"),
                            ("b.jsonl", '{"prompt": "x", "output_len": 0}\n', ":1: 'output_len'"),
                            ("c.jsonl", '{"prompt": "x"}\nnope\n', ":2: not JSON"),
                            ("d.txt", "\n  \n", "no prompts")]:
      path = os.path.join(d, name)
      with open(path, "w") as f:
        f.write(text)
      with self.assertRaisesRegex(ValueError, msg):
        bench.load_prompts_file(path, 8)

  def test_text_file(self):
    path = os.path.join(temp_dir(self), "prompts.txt")
    with open(path, "w") as f:
      f.write("Tell me a story.\n\nWhat is {2 + 2}?\r\nlast line without newline")
    prompts = bench.build_prompts(bench.BenchConfig("http://127.0.0.1:1", prompts_file=path,
                                                    random_output_len=4, endpoint="chat"))
    self.assertEqual([(p.prompt, p.output_len) for p in prompts],
                     [("Tell me a story.", 4), ("What is {2 + 2}?", 4),
                      ("last line without newline", 4)])


class ConfigTest(parameterized.TestCase):

  @parameterized.parameters(
      ("base_url", "127.0.0.1:8000"), ("base_url", "ftp://h:1"), ("endpoint", "embeddings"),
      ("model", ""), ("num_prompts", 0), ("num_prompts", 2.5), ("request_rate", 0),
      ("request_rate", -1.0), ("request_rate", math.nan), ("max_concurrency", 0),
      ("concurrency_sweep", (1, 0)), ("concurrency_sweep", "1,4"), ("random_input_len", 0),
      ("random_output_len", True), ("random_vocab_size", -3), ("prompts_file", "/no/such/file"),
      ("ignore_eos", 1), ("temperature", -0.1), ("temperature", math.inf), ("seed", 1.5),
      ("seed", -1), ("timeout_s", 0), ("extra_body", [1]), ("progress_interval_s", -1))
  def test_bad_field_is_named(self, field, value):
    with self.assertRaisesRegex(ValueError, rf"BenchConfig\.{field}\b"):
      bench.BenchConfig(**{"base_url": "http://127.0.0.1:8000", field: value})

  def test_sweep_excludes_rate_and_concurrency(self):
    with self.assertRaisesRegex(ValueError, "concurrency_sweep"):
      bench.BenchConfig("http://h:1", concurrency_sweep=(1, 2), max_concurrency=4)
    with self.assertRaisesRegex(ValueError, "concurrency_sweep"):
      bench.BenchConfig("http://h:1", concurrency_sweep=(1, 2), request_rate=3.0)

  def test_normalised_and_frozen(self):
    cfg = bench.BenchConfig("http://h:1/v1/", concurrency_sweep=[1, 4], api_key="secret")
    self.assertEqual(cfg.base_url, "http://h:1")
    self.assertEqual(cfg.concurrency_sweep, (1, 4))
    with self.assertRaises(AttributeError):
      cfg.seed = 2
    settings = cfg.settings()
    self.assertNotIn("secret", json.dumps(settings))
    self.assertEqual((settings["request_rate"], settings["api_key_given"]), ("inf", True))


class CommandLineTest(parameterized.TestCase):

  @parameterized.parameters(
      [["--num-prompts", "0"]], [["--request-rate", "-2"]], [["--endpoint", "nope"]],
      [["--concurrency-sweep", "1,x"]], [["--concurrency-sweep", "1,4", "--max-concurrency", "2"]],
      [["--prompts-file", "/no/such/file"]], [["--extra-body", "[1]"]], [["--timeout", "0"]],
      [["--base-url", "localhost:8000"]], [["--unknown-flag"]], [["--random-vocab-size", "0"]])
  def test_bad_arguments_exit_2(self, args):
    if "--base-url" not in args:
      args = ["--base-url", "http://127.0.0.1:1", *args]
    self._exits_2(args)

  def test_missing_base_url_exits_2(self):
    self._exits_2([])

  def _exits_2(self, args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      self.assertEqual(bench.main(args), 2)
    self.assertLen(err.getvalue().strip().splitlines(), 1)
    self.assertTrue(err.getvalue().startswith("python -m mlkit.serve.bench: error: "))

  def test_unreachable_server_exits_1_at_once(self):
    port = _closed_port()
    t0 = time.perf_counter()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      rc = bench.main(["--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "4",
                       "--random-input-len", "8", "--model", "m"])
    self.assertEqual(rc, 1)
    self.assertLess(time.perf_counter() - t0, 5.0)
    self.assertIn(f"cannot reach http://127.0.0.1:{port}", err.getvalue())
    with self.assertRaises(bench.ServerUnreachable):
      bench.benchmark(bench.BenchConfig(f"http://127.0.0.1:{port}", num_prompts=2,
                                        random_input_len=4, progress_interval_s=0))

  def test_process_exit_statuses_and_no_jax(self):
    """As a process: one-line errors, statuses 2 and 1, and JAX never imported."""
    port = _closed_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "mlkit.serve.bench", "--base-url",
                          "http://127.0.0.1:1", "--num-prompts", "-1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    self.assertEqual(res.returncode, 2, res.stderr)
    self.assertLen(res.stderr.strip().splitlines(), 1)
    self.assertIn("--num-prompts", res.stderr)
    code = ("import sys; from mlkit.serve import bench; rc = bench.main(['--base-url', "
            f"'http://127.0.0.1:{port}', '--random-input-len', '4']); "
            "assert 'jax' not in sys.modules, 'jax imported'; sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    self.assertEqual(res.returncode, 1, res.stderr)
    self.assertLen(res.stderr.strip().splitlines(), 1)


if __name__ == "__main__":
  absltest.main()
