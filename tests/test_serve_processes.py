"""Prefill and decode as two processes (mlkit.serve): same tokens as DisaggEngine, failures end cleanly.

One prefill+decode pair is started for the module (a 1-layer TINY_MLA, f32 KV,
page sizes 4 and 8 so the KV is re-paged) and reused by every test, in order:
equality with the in-process DisaggEngine, a corrupted transfer, a slow prefill
server, and last a kill -9 of the prefill server, after which a new one is
started on the same port. docs/serving_processes.md describes the protocol.
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
from absl.testing import absltest

from mlkit import wire
from mlkit.serve import launch
from mlkit.serve import protocol as proto
from mlkit.serve.client import Client

from tempdirs import temp_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the CLI tests' cwd
MODEL = ["--model", "tiny-mla", "--n-layers", "1", "--recipe", "bf16", "--kv-dtype", "float32",
         "--num-pages", "32", "--max-running", "4", "--prefill-chunk", "8",
         "--max-pages-per-seq", "8"]
PREFILL_PAGE, DECODE_PAGE = 4, 8
PROMPTS = [[5, 17, 99, 3, 250], [7] * 9, list(range(40, 53)), [1, 2, 3, 4, 5, 6, 7]]
MAX_NEW = 6
PREFILL_TIMEOUT = 3.0


def _start(role: str, listen: str, *extra: str, log: str):
  return launch.start(role, listen, [*MODEL, *extra], log=log)


def _stop(servers) -> None:
  """Shuts (process, address) servers down over their control channel, killing any that hang."""
  for proc, addr in servers:
    try:
      with Client(addr, timeout_s=5) as c:
        c.shutdown()
      proc.wait(timeout=10)
    except Exception:
      proc.kill()
      proc.wait()


class ServeProcessesTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = temp_dir(cls, "mlkit-serve-test-")
    cls.pre_addr = f"127.0.0.1:{launch.free_port()}"
    cls.dec_addr = f"127.0.0.1:{launch.free_port()}"
    cls.pre_log = os.path.join(cls.tmp, "prefill.log")
    cls.dec_log = os.path.join(cls.tmp, "decode.log")
    cls.prefill = cls._start_prefill()
    cls.decode = _start("decode", cls.dec_addr, "--prefill", cls.pre_addr, "--page-size",
                        str(DECODE_PAGE), "--prefill-timeout", str(PREFILL_TIMEOUT),
                        "--pull-timeout", "10", "--connect-timeout", "120",
                        "--enable-fault-injection", log=cls.dec_log)
    # The in-process reference compiles here while the servers start.
    cls.reference = cls._reference()
    launch.wait_ready(cls.decode, cls.dec_log)
    cls.client = Client(cls.dec_addr, timeout_s=60)
    cls.control = Client(cls.pre_addr, timeout_s=60)  # the test's own line to the prefill server

  @classmethod
  def _start_prefill(cls):
    return _start("prefill", cls.pre_addr, "--page-size", str(PREFILL_PAGE),
                  "--enable-fault-injection", "--offer-timeout", "20", log=cls.pre_log)

  @classmethod
  def tearDownClass(cls):
    _stop([(cls.decode, cls.dec_addr), (cls.prefill, cls.pre_addr)])
    super().tearDownClass()

  @classmethod
  def _reference(cls):
    """The same params served by DisaggEngine in this process (greedy tokens per prompt)."""
    from mlkit.engine.disagg import DisaggConfig, DisaggEngine, PoolConfig
    from mlkit.parallel import MeshConfig
    from mlkit.quant import BF16
    from mlkit.sampling import SamplingParams
    from mlkit.serve.model import ServeConfig, engine_config, load_model
    kw = dict(model="tiny-mla", n_layers=1, recipe="bf16", kv_dtype="float32", num_pages=32,
              max_running=4, prefill_chunk=8, max_pages_per_seq=8)
    pre = ServeConfig(role="prefill", page_size=PREFILL_PAGE, **kw)
    params, mcfg = load_model(pre)
    dec = dataclasses.replace(pre, role="decode", page_size=DECODE_PAGE)
    cfg = DisaggConfig(prefill=PoolConfig(engine_config(pre, mcfg), BF16, MeshConfig()),
                       decode=PoolConfig(engine_config(dec, mcfg), BF16, MeshConfig()))
    eng = DisaggEngine(params, cfg, devices=jax.devices()[:2])
    return eng.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))

  def _assert_pages_free(self):
    m = self.client.metrics()
    self.assertEqual(m["pages_used"], 0, m)
    self.assertEqual(m["serve"]["in_flight"], 0)
    self.assertEqual(m["serve"]["requests_held"], 0)  # answered requests leave the server

  def test_1_same_tokens_as_in_process_disagg(self):
    outs = self.client.generate(PROMPTS, max_new_tokens=MAX_NEW)
    self.assertEqual([o["tokens"] for o in outs], self.reference)
    self.assertTrue(all(o["finish_reason"] == "length" for o in outs))
    self._assert_pages_free()
    m = self.client.metrics()["serve"]
    self.assertGreaterEqual(m["transfers"], len(PROMPTS))
    self.assertGreater(m["transfer_bytes"], 0)

  def test_1b_pools_over_two_processes_each(self):
    # Both servers as pools over two JAX processes (gloo): each leader serves and sends its
    # device work to its follower; the decode leader lands each payload on both processes,
    # the prefill pool extracts on both. Same tokens as the in-process reference; then a
    # follower's death ends its pool cleanly.
    tmp = temp_dir(self, "mlkit-serve-mh-")
    pre_addr, dec_addr = (f"127.0.0.1:{launch.free_port()}" for _ in range(2))
    procs, logs = [], []
    for role, addr, extra in (
        ("prefill", pre_addr, ["--page-size", str(PREFILL_PAGE)]),
        ("decode", dec_addr, ["--page-size", str(DECODE_PAGE), "--prefill", pre_addr])):
      pool = ["--num-processes", "2", "--coordinator", f"127.0.0.1:{launch.free_port()}",
              "--pool-address", f"127.0.0.1:{launch.free_port()}", "--connect-timeout", "120"]
      for pid in (0, 1):
        logs.append(os.path.join(tmp, f"{role}{pid}.log"))
        procs.append(_start(role, addr, *extra, *pool, "--process-id", str(pid), log=logs[-1]))
    try:
      launch.wait_ready(procs[0], logs[0])
      launch.wait_ready(procs[2], logs[2])
      with Client(dec_addr, timeout_s=120) as c:
        outs = c.generate(PROMPTS, max_new_tokens=MAX_NEW)
        self.assertEqual([o["tokens"] for o in outs], self.reference)
        m = c.metrics()
        self.assertEqual(m["pages_used"], 0)
        self.assertGreaterEqual(m["serve"]["transfers"], len(PROMPTS))
      # kill -9 of the decode pool's follower: its leader cannot run another step, so the
      # next request's first device operation ends the leader (status 3, saying why); the
      # prefill pool sees its peer go and keeps no page.
      procs[3].kill()
      procs[3].wait()
      with Client(dec_addr, timeout_s=120) as c:
        with self.assertRaises((ConnectionError, EOFError, OSError)):
          c.generate(PROMPTS[:1], max_new_tokens=MAX_NEW)
      self.assertEqual(procs[2].wait(timeout=60), 3)
      with open(logs[2]) as f:
        self.assertIn("the pool cannot go on: PoolBroken: pool follower 1 is gone", f.read())
      with Client(pre_addr, timeout_s=30) as c:
        deadline = time.monotonic() + 30
        while c.metrics()["pages_used"] and time.monotonic() < deadline:
          time.sleep(0.2)
        self.assertEqual(c.metrics()["pages_used"], 0)
    finally:
      _stop([(procs[2], dec_addr), (procs[0], pre_addr)])
      for follower, log in ((procs[1], logs[1]), (procs[3], logs[3])):
        try:  # a follower stops with its leader
          follower.wait(timeout=30)
        except subprocess.TimeoutExpired:
          follower.kill()
          follower.wait()
          self.fail(f"a pool follower outlived its leader:\n{open(log).read()[-2000:]}")
    with open(logs[1]) as f:  # the prefill pool's follower, stopped by its leader
      text = f.read()
    self.assertIn("following the pool leader", text)
    self.assertRegex(text, r"stopped after [1-9]\d* pool operations")

  def test_2_corrupted_transfer_retried_then_aborted(self):
    before = self.client.metrics()["serve"]
    self.control.request("fault", corrupt=1)  # one flipped bit after the checksum: one retry
    (out,) = self.client.generate(PROMPTS[:1], max_new_tokens=MAX_NEW)
    self.assertEqual(out["tokens"], self.reference[0])
    m = self.client.metrics()["serve"]
    self.assertEqual(m["transfer_retries"], before["transfer_retries"] + 1)
    self.control.request("fault", corrupt=2)  # every attempt corrupted: aborted, never decoded
    (out,) = self.client.generate(PROMPTS[:1], max_new_tokens=MAX_NEW)
    self.assertEqual(out["abort_reason"], "transfer")
    self.assertIn("checksum mismatch", out["error"])
    self.assertEqual(out["tokens"], self.reference[0][:1])  # the prefill's token only
    self._assert_pages_free()

  def test_3_slow_prefill_server_times_out(self):
    self.control.request("fault", delay_s=PREFILL_TIMEOUT + 2)
    t0 = time.monotonic()
    (out,) = self.client.generate(PROMPTS[:1], max_new_tokens=MAX_NEW)
    self.assertLess(time.monotonic() - t0, PREFILL_TIMEOUT + 1.5)
    self.assertEqual(out["abort_reason"], "timeout")
    self._assert_pages_free()
    self.control.request("fault", delay_s=0.0)  # answered once the slow offer is done
    (out,) = self.client.generate(PROMPTS[:1], max_new_tokens=MAX_NEW)
    self.assertEqual(out["tokens"], self.reference[0])

  def test_3b_client_that_disconnects_cancels_its_requests(self):
    before = self.client.metrics()["serve"]["aborted"].get("cancelled", 0)
    self.control.request("fault", delay_s=1.0)  # keeps them in flight while the client goes
    gone = Client(self.dec_addr, timeout_s=30)
    gone._conn.send({"kind": "generate", "prompts": PROMPTS[:2], "sampling": [
        dict(max_new_tokens=MAX_NEW, temperature=0.0, top_k=0, top_p=1.0, seed=0,
             stop_tokens=[])] * 2})
    deadline = time.monotonic() + 10
    while self.client.metrics()["serve"]["in_flight"] < 2:
      self.assertLess(time.monotonic(), deadline)
      time.sleep(0.02)
    gone.close()
    while (m := self.client.metrics())["serve"]["aborted"].get("cancelled", 0) < before + 2:
      self.assertLess(time.monotonic(), deadline, m["serve"])
      time.sleep(0.02)
    self._assert_pages_free()
    self.control.request("fault", delay_s=0.0)

  def test_4_kill_prefill_mid_transfer_then_a_new_one(self):
    # One request is caught while its KV is being pulled (offered, the pull pending),
    # the other while the prefill server prepares its offer: kill -9 the prefill server.
    cls = type(self)
    results = []

    def generate(prompt):
      with Client(self.dec_addr, timeout_s=60) as c:
        results.append(c.generate([prompt], max_new_tokens=MAX_NEW)[0])

    def wait_for(what, cond):
      deadline = time.monotonic() + 20
      while not cond(self.client.metrics()["serve"]):
        self.assertLess(time.monotonic(), deadline, what)
        time.sleep(0.05)

    self.assertEqual(self.client.request("fault", pull_delay_s=30.0)["kind"], "ok")
    threads = [threading.Thread(target=generate, args=(PROMPTS[0],))]
    threads[0].start()
    wait_for("a pull in progress", lambda s: s["pulling"] == 1)
    self.control.request("fault", delay_s=30.0)  # the next offer hangs
    threads.append(threading.Thread(target=generate, args=(PROMPTS[1],)))
    threads[1].start()
    wait_for("a second request in flight", lambda s: s["in_flight"] == 2)
    self.assertGreater(self.client.metrics()["pages_used"], 0)  # reserved before the prefill
    os.kill(cls.prefill.pid, signal.SIGKILL)
    cls.prefill.wait()
    for t in threads:
      t.join(30)
    self.assertEqual([o["abort_reason"] for o in results], ["peer_lost"] * 2)
    self.assertEqual(self.client.request("fault", pull_delay_s=0.0)["kind"], "ok")
    self._assert_pages_free()
    self.control.close()
    cls.prefill = cls._start_prefill()
    launch.wait_ready(cls.prefill, cls.pre_log)
    cls.control = Client(cls.pre_addr, timeout_s=60)
    deadline = time.monotonic() + 30
    while not self.client.metrics()["serve"]["peer_ready"]:  # the decode server reconnects
      self.assertLess(time.monotonic(), deadline)
      time.sleep(0.1)
    outs = self.client.generate(PROMPTS, max_new_tokens=MAX_NEW)
    self.assertEqual([o["tokens"] for o in outs], self.reference)
    self._assert_pages_free()

  def test_5_prefill_frees_pages_of_a_decode_server_that_drops(self):
    cls = type(self)
    sampling = dict(max_new_tokens=MAX_NEW, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                    stop_tokens=[])
    rogue = Client(self.pre_addr, timeout_s=30)  # a decode server that vanishes mid-transfer
    offer = rogue.request("prefill", uuid=12345, tokens=PROMPTS[2], sampling=sampling)
    self.assertEqual(offer["kind"], "offered")
    self.assertEqual(offer["first_token"], self.reference[2][0])
    self.assertGreater(rogue.metrics()["pages_used"], 0)
    rogue.close()  # never pulled, never released
    deadline = time.monotonic() + 10
    while (m := cls.control.metrics())["pages_used"]:
      self.assertLess(time.monotonic(), deadline, m)
      time.sleep(0.05)
    self.assertGreaterEqual(m["serve"]["peer_drops"], 1)
    outs = self.client.generate(PROMPTS, max_new_tokens=MAX_NEW)  # the real decode server goes on
    self.assertEqual([o["tokens"] for o in outs], self.reference)


  def test_6_bad_frames_on_every_socket(self):
    # The decode server's client socket and the prefill server's socket each get a pickle
    # payload (never run: its marker file never appears), frames that are malformed, too
    # large or of an unknown kind, a token outside the vocabulary, and peers without the
    # key. Each gets an error answer (or no connection at all) and is closed; the pair then
    # serves a normal request.
    from test_wire import pickle_bytes
    marker = os.path.join(temp_dir(self, "mlkit-serve-frames-"), "ran")
    key = wire.client_key()
    sampling = dict(max_new_tokens=2, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                    stop_tokens=[])
    bodies = {
        "pickle": pickle_bytes(marker), "not msgpack": b"\xc1" * 8,
        "not a map": wire.encode([1, 2, 3]), "unknown kind": wire.encode({"kind": "exec"}),
        "token outside the vocabulary": wire.encode(
            {"kind": "generate", "prompts": [[1, 10**6]], "sampling": [sampling]}),
        "too large": b"\x00" * (65 << 20)}
    for addr in (self.dec_addr, self.pre_addr):
      for what, body in bodies.items():
        conn = wire.connect(proto.parse_address(addr), key)
        try:
          conn.send_frame(body)
        except ConnectionError:
          pass  # the server may close before taking a too-large frame's last byte
        if what != "too large":
          reply = conn.recv(proto.reply_kinds())
          self.assertEqual(reply["kind"], "error", (addr, what))
          self.assertIn("refused a frame", reply["error"])
        else:
          self._recv_error_or_close(conn)
        with self.assertRaises((EOFError, ConnectionError), msg=(addr, what)):
          while True:  # closed by the server (after its answer)
            conn.recv_frame()
        conn.close()
      with self.assertRaisesRegex(ConnectionError, "refused our key"):
        wire.connect(proto.parse_address(addr), os.urandom(32))
      with socket.create_connection(proto.parse_address(addr)) as raw:  # no handshake at all
        raw.sendall(pickle_bytes(marker))
        raw.settimeout(15)
        try:
          while raw.recv(4096):
            pass  # the server answers its challenge, then closes
        except ConnectionResetError:
          pass  # or closes with our bytes unread
    self.assertFalse(os.path.exists(marker))
    (out,) = self.client.generate(PROMPTS[:1], max_new_tokens=MAX_NEW)
    self.assertEqual(out["tokens"], self.reference[0])
    self._assert_pages_free()
    self.assertEqual(self.control.metrics()["pages_used"], 0)

  def _recv_error_or_close(self, conn):
    try:
      reply = conn.recv(proto.reply_kinds())
      self.assertEqual(reply["kind"], "error")
      self.assertIn("exceeds this end's limit", reply["error"])
    except (EOFError, ConnectionError):
      pass


class HuggingFaceCheckpointPairTest(absltest.TestCase):
  """A pair serving a Hugging Face checkpoint: GLM 5 with sparse attention (indexer keys paged,
  pulled and landed with the latent), against the greedy tokens transformers generated."""

  FIXTURE = os.path.join(ROOT, "tests", "fixtures", "glm_moe_dsa")

  def test_greedy_tokens_of_transformers(self):
    import numpy as np
    ref = np.load(os.path.join(self.FIXTURE, "reference.npz"))
    n, greedy = int(ref["prompt_len"]), ref["greedy"]
    tmp = temp_dir(self, "mlkit-serve-hf-")
    pre_addr, dec_addr = (f"127.0.0.1:{launch.free_port()}" for _ in range(2))
    common = ["--checkpoint", self.FIXTURE, "--kv-dtype", "float32", "--num-pages", "32",
              "--max-running", "4", "--prefill-chunk", "8", "--max-pages-per-seq", "8"]
    logs = [os.path.join(tmp, f"{r}.log") for r in ("prefill", "decode")]
    procs = [launch.start("prefill", pre_addr, [*common, "--page-size", "4"], log=logs[0])]
    procs.append(launch.start("decode", dec_addr, [*common, "--page-size", "8", "--prefill", pre_addr,
                                                  "--connect-timeout", "120"], log=logs[1]))
    try:
      for proc, log in zip(procs, logs):
        launch.wait_ready(proc, log)
      with Client(dec_addr, timeout_s=120) as c:
        outs = c.generate(ref["tokens"][:, :n].tolist(), max_new_tokens=greedy.shape[1])
        self.assertEqual([o["tokens"] for o in outs], greedy.tolist())
        m = c.metrics()
        self.assertEqual(m["pages_used"], 0)
        self.assertGreaterEqual(m["serve"]["transfers"], len(outs))
    finally:
      _stop(zip(procs, (pre_addr, dec_addr)))


class ProtocolTest(absltest.TestCase):
  """The control channel's pieces, in this process (no server)."""

  def test_messages_and_addresses(self):
    from mlkit.sampling import SamplingParams
    self.assertEqual(proto.message("release", uuid=3), {"kind": "release", "uuid": 3})
    self.assertEqual(len(proto.message("error", error="x" * 10_000)["error"]),
                     proto.MAX_MESSAGE_TEXT)
    s = SamplingParams(max_new_tokens=3, temperature=0.5, stop_tokens=(1, 2))
    self.assertEqual(proto.sampling_from_dict(proto.sampling_to_dict(s)), s)
    with self.assertRaises(ValueError):  # SamplingParams' own check
      proto.sampling_from_dict(dict(proto.sampling_to_dict(s), max_new_tokens=0))
    self.assertEqual(proto.parse_address("127.0.0.1:7100"), ("127.0.0.1", 7100))
    for bad in ("7100", "localhost:", ":80", "host:99999", "host:port"):
      with self.assertRaisesRegex(ValueError, "HOST:PORT"):
        proto.parse_address(bad)

  def test_round_trip_and_a_closed_peer(self):
    key = os.urandom(32)
    addr = f"127.0.0.1:{launch.free_port()}"
    listener = proto.listen(addr, key)
    inbox = proto.Inbox()
    inbox.accept_from(listener, proto.prefill_kinds(100, 64))
    with self.assertRaisesRegex(ConnectionError, "refused our key"):
      proto.connect(addr, os.urandom(32), 5)
    conn = proto.connect(addr, key, 5)
    conn.send(proto.message("hello", version=proto.PROTOCOL_VERSION, role="decode", model="m"))
    peer, msg = inbox.get(5)
    self.assertEqual(msg["kind"], "hello")
    self.assertTrue(inbox.send(peer, proto.message("ok")))
    self.assertEqual(conn.recv(proto.reply_kinds()), {"kind": "ok"})
    conn.close()
    _, msg = inbox.get(5)
    self.assertEqual(msg["kind"], proto.CLOSED)
    with self.assertRaisesRegex(OSError, "cannot listen on .*in use"):
      proto.listen(addr, key)
    listener.close()
    with self.assertRaisesRegex(ConnectionError, "no server reachable"):
      proto.connect(f"127.0.0.1:{launch.free_port()}", key, 0.3)
    self.assertIsInstance(wire.AuthenticationError("x"), ConnectionError)

  def test_options_checked(self):
    from mlkit.engine import ABORT_REASONS
    from mlkit.serve.decode import DecodeOptions
    from mlkit.serve.model import ServeConfig
    self.assertIn("peer_lost", ABORT_REASONS)
    self.assertIn("timeout", ABORT_REASONS)
    with self.assertRaisesRegex(ValueError, "prefill_timeout_s"):
      DecodeOptions(prefill_timeout_s=0)
    with self.assertRaisesRegex(ValueError, "transfer_attempts"):
      DecodeOptions(transfer_attempts=0)
    with self.assertRaisesRegex(ValueError, "exactly one of checkpoint"):
      ServeConfig(role="decode")
    with self.assertRaisesRegex(ValueError, "recipe"):
      ServeConfig(role="decode", model="tiny-mla", recipe="int3")


class CliTest(absltest.TestCase):

  def _run(self, *args):
    return subprocess.run([sys.executable, "-m", "mlkit.serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)

  def _main(self, *args):
    """``mlkit.serve``'s main() in this process, for starts refused only after its imports
    of jax and the model code (a process of its own would import them again): its exit
    status and stderr, as ``_run`` returns them. The environment it sets for its own
    devices is restored, and so is absl's logging verbosity (main() lowers it to WARNING
    for its process; left lowered, a later module's INFO logs vanish). The listener a
    refused start leaves open closes as its process's would (with its frames, quietly)."""
    import contextlib
    import io
    import warnings
    from unittest import mock

    from absl import logging as absl_logging

    from mlkit.serve.__main__ import main
    err = io.StringIO()
    # The absl logger's own level, not get_verbosity(): that reads the effective level,
    # and setting it back would pin a logger that had inherited the root's.
    absl_level = absl_logging.get_absl_logger().level
    with (mock.patch.dict(os.environ), contextlib.redirect_stderr(err),
          warnings.catch_warnings()):
      warnings.simplefilter("ignore", ResourceWarning)
      try:
        code = main(list(args))
      except SystemExit as e:
        code = e.code
      finally:
        absl_logging.get_absl_logger().setLevel(absl_level)
    return subprocess.CompletedProcess(args, code, "", err.getvalue())

  def test_help(self):
    res = self._run("--help")
    self.assertEqual(res.returncode, 0, res.stderr)
    for flag in ("--role", "--prefill", "--checkpoint", "--model", "--prefill-timeout"):
      self.assertIn(flag, res.stdout)

  def test_bad_starts(self):
    res = self._run("--role", "prefill", "--checkpoint", "/nonexistent/ckpt")
    self.assertEqual(res.returncode, 2)
    self.assertIn("checkpoint directory /nonexistent/ckpt does not exist", res.stderr)
    with socket.socket() as busy:
      busy.bind(("127.0.0.1", 0))
      busy.listen()
      port = busy.getsockname()[1]
      res = self._run("--role", "prefill", "--model", "tiny-mla", "--listen", f"127.0.0.1:{port}")
    self.assertEqual(res.returncode, 2)
    self.assertIn(f"cannot listen on 127.0.0.1:{port}", res.stderr)
    res = self._run("--role", "decode", "--model", "tiny-mla")
    self.assertEqual(res.returncode, 2)
    self.assertIn("--prefill", res.stderr)
    with socket.socket() as s:  # a port nothing listens on (bound, never listening)
      s.bind(("127.0.0.1", 0))
      dead = s.getsockname()[1]
      res = self._main("--role", "decode", "--model", "tiny-mla", "--listen",
                       f"127.0.0.1:{launch.free_port()}", "--prefill", f"127.0.0.1:{dead}",
                       "--connect-timeout", "0.5")
    self.assertEqual(res.returncode, 2)
    self.assertIn(f"prefill server unreachable: no server reachable at 127.0.0.1:{dead}",
                  res.stderr)
    # A pool over several processes needs its coordinator and pool addresses, and a
    # process id within the pool.
    res = self._run("--role", "prefill", "--model", "tiny-mla", "--num-processes", "2")
    self.assertEqual(res.returncode, 2)
    self.assertIn("--num-processes > 1 needs --coordinator HOST:PORT and --pool-address",
                  res.stderr)
    res = self._run("--role", "prefill", "--model", "tiny-mla", "--num-processes", "2",
                    "--process-id", "2", "--coordinator", "127.0.0.1:1", "--pool-address",
                    "127.0.0.1:2")
    self.assertEqual(res.returncode, 2)
    self.assertIn("--process-id 2 must be in [0, --num-processes 2)", res.stderr)
    # Speculative decoding drafts with the model's MTP layer: a model without one is refused
    # once loaded, a negative K before.
    res = self._main("--role", "colocated", "--model", "tiny-gqa", "--speculative-tokens", "2",
                     "--listen", f"127.0.0.1:{launch.free_port()}")
    self.assertEqual(res.returncode, 2, res.stderr)
    self.assertIn("cannot serve tiny-gqa as configured: EngineConfig.speculative_tokens=2 "
                  "needs a model with multi-token-prediction layers", res.stderr)
    self.assertNotIn("Traceback", res.stderr)
    res = self._main("--role", "prefill", "--model", "tiny-mla", "--speculative-tokens", "-1")
    self.assertEqual(res.returncode, 2)
    self.assertIn("--speculative-tokens) must be a non-negative int, got -1", res.stderr)
    res = self._run("--role", "colocated", "--model", "tiny-mla", "--arrival-gap-ms", "5",
                    "--arrival-max-ms", "1")
    self.assertEqual(res.returncode, 2)
    self.assertIn("--arrival-gap-ms 5.0 / --arrival-max-ms 1.0: both must be >= 0, the max at "
                  "least the gap", res.stderr)

  def test_keys(self):
    # Any address other than loopback needs a key given; none is ever a constant.
    for listen in ("10.11.12.13:7100", "0.0.0.0:7100"):
      res = self._run("--role", "prefill", "--model", "tiny-mla", "--listen", listen)
      self.assertEqual(res.returncode, 2, res.stderr)
      self.assertIn(f"{listen.split(':')[0]} is not a loopback address", res.stderr)
      self.assertIn("set MLKIT_SERVE_AUTHKEY or pass --authkey-file PATH", res.stderr)
    res = self._run("--role", "decode", "--model", "tiny-mla", "--prefill", "10.11.12.13:7100")
    self.assertEqual(res.returncode, 2)
    self.assertIn("10.11.12.13 is not a loopback address", res.stderr)
    res = self._run("--role", "prefill", "--model", "tiny-mla", "--authkey", "secret")
    self.assertEqual(res.returncode, 2)
    self.assertIn("a key on the command line is visible to every user", res.stderr)
    tmp = temp_dir(self, "mlkit-serve-key-")
    loose = os.path.join(tmp, "loose.key")
    with open(loose, "w") as f:
      f.write("k" * 64)
    os.chmod(loose, 0o644)
    res = self._run("--role", "prefill", "--model", "tiny-mla", "--authkey-file", loose)
    self.assertEqual(res.returncode, 2)
    self.assertIn("open to other users", res.stderr)


if __name__ == "__main__":
  absltest.main()
