"""Data on the wire, never code (mlkit.wire): frames, schemas, the key handshake and key files.

Every socket between the project's processes goes through mlkit.wire. Here its
pieces are checked in this process: a pickle payload is refused and never run
(a marker file its ``__reduce__`` would create never appears), malformed, too
large, unknown and unauthenticated frames are refused with the connection
closed, keys are never constants and key files are checked. The servers'
sockets against real processes are in test_serve_processes.py; a pool's
leader/follower channel is at the end of this file.
"""

import os
import pickle
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import types

import msgpack
import ml_dtypes
import numpy as np
from absl.testing import absltest, parameterized

from mlkit import wire
from mlkit.serve import protocol as proto
from mlkit.wire import frames, keys, schema as S

from tempdirs import temp_dir

KEY = os.urandom(32).hex().encode()  # a fresh key per run (never a constant)


class _Payload:
  """Unpickling this creates ``path``: proof that a pickle ran, if it ever does."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (open, (self.path, "w"))


def pickle_bytes(marker: str) -> bytes:
  return pickle.dumps({"kind": "generate", "x": _Payload(marker)})


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class CodecTest(parameterized.TestCase):

  def test_round_trip_of_data_and_arrays(self):
    value = {"kind": "x", "ints": [1, -2, 1 << 62], "f": 0.5, "s": "ü", "b": b"\x00\x01",
             "none": None, "t": True, "nested": {"a": [{"b": []}]},
             "scalar": np.int32(7), "u": np.uint32(2**32 - 1)}
    for name, dt in frames.ARRAY_DTYPES.items():
      value[f"arr_{name}"] = (np.arange(12) % 3).astype(dt).reshape(3, 4)
    got = wire.decode(wire.encode(value))
    self.assertEqual(got["ints"], [1, -2, 1 << 62])
    self.assertEqual((got["scalar"], got["u"]), (7, 2**32 - 1))
    self.assertEqual(got["nested"], {"a": [{"b": []}]})
    for name, dt in frames.ARRAY_DTYPES.items():
      a = got[f"arr_{name}"]
      self.assertEqual((a.dtype, a.shape), (dt, (3, 4)), name)
      np.testing.assert_array_equal(a.astype(np.float32), value[f"arr_{name}"].astype(np.float32))
    empty = wire.decode(wire.encode(np.zeros((0, 5), np.float32)))
    self.assertEqual(empty.shape, (0, 5))

  def test_code_cannot_be_sent(self):
    for bad in (_Payload("/nonexistent"), print, object(), {1, 2}, np.zeros(2, object),
                np.zeros(2, np.complex64)):
      with self.assertRaises(TypeError, msg=repr(bad)):
        wire.encode({"kind": "x", "v": bad})

  def test_a_pickle_is_refused_and_never_runs(self):
    marker = os.path.join(temp_dir(self, "wire-"), "ran")
    for proto_version in range(2, pickle.HIGHEST_PROTOCOL + 1):
      body = pickle.dumps(_Payload(marker), protocol=proto_version)
      with self.assertRaises(wire.FrameError):
        wire.decode(body)
    self.assertFalse(os.path.exists(marker))
    pickle.loads(pickle.dumps(_Payload(marker)))  # the payload does run when unpickled
    self.assertTrue(os.path.exists(marker))

  @parameterized.named_parameters(
      ("truncated", msgpack.packb({"kind": "x", "v": "abc"})[:-2]),
      ("two_values", msgpack.packb(1) + msgpack.packb(2)),
      ("unknown_extension", msgpack.packb(msgpack.ExtType(7, b"xx"))),
      ("array_bytes_short", msgpack.packb(msgpack.ExtType(
          1, struct.pack("!H", 17) + msgpack.packb(["float32", [2, 3]]) + b"\x00" * 20))),
      ("array_bad_dtype", msgpack.packb(msgpack.ExtType(
          1, struct.pack("!H", 14) + msgpack.packb(["object", [1]]) + b"\x00" * 8))),
      ("array_negative_dim", msgpack.packb(msgpack.ExtType(
          1, struct.pack("!H", 14) + msgpack.packb(["int8", [-1]])))),
      ("array_header_not_list", msgpack.packb(msgpack.ExtType(
          1, struct.pack("!H", 2) + msgpack.packb({})))),
      ("non_string_map_key", msgpack.packb({1: 2})),
  )
  def test_malformed_bodies(self, body):
    with self.assertRaises(wire.FrameError):
      wire.decode(body)


class SchemaTest(absltest.TestCase):

  def test_each_schema_names_the_field(self):
    sch = S.Fields({"n": S.Int(0, 10), "x": S.Float(0.0, 1.0), "s": S.Str(3, ("a", "bb")),
                    "l": S.List(S.Int(0, 5), 3, 1), "t": S.Tuple((S.Int(), S.Bool())),
                    "a": S.Array(("int32",), ndim=1, max_size=4, lo=0, hi=9)},
                   {"m": S.MapOf(S.Str(8), S.Nullable(S.Int()), 2), "p": S.Plain(max_depth=2)})
    ok = {"n": 3, "x": 1, "s": "bb", "l": [0, 4], "t": [5, False],
          "a": np.array([1, 8], np.int32), "m": {"k": None}, "p": {"a": [1]}}
    out = sch.check(ok, "msg")
    self.assertEqual(out["x"], 1.0)
    cases = {
        "n": (True, "msg.n: expected an int, got bool"), "x": (float("nan"), "not finite"),
        "s": ("c", "is not one of"), "l": ([0, 5], r"msg.l\[1\]: 5 is not in \[0, 5\)"),
        "t": ([1], "expected 2 items"), "a": (np.array([1, 9], np.int32), "outside"),
        "m": ({"a": 1, "b": 2, "c": 3}, "exceeds 2"), "p": ({"a": {"b": {"c": 1}}}, "deeper"),
    }
    for field, (bad, why) in cases.items():
      with self.assertRaisesRegex(S.SchemaError, why, msg=field):
        sch.check({**ok, field: bad}, "msg")
    with self.assertRaisesRegex(S.SchemaError, "missing field"):
      sch.check({k: v for k, v in ok.items() if k != "n"}, "msg")
    with self.assertRaisesRegex(S.SchemaError, "unexpected field 'typo'"):
      sch.check({**ok, "typo": 1}, "msg")
    with self.assertRaisesRegex(S.SchemaError, "array of dtype float32"):
      sch.check({**ok, "a": np.zeros(1, np.float32)}, "msg")
    with self.assertRaisesRegex(S.SchemaError, "list of 4 items"):
      sch.check({**ok, "l": [0] * 4}, "msg")
    with self.assertRaisesRegex(S.SchemaError, "expected a map"):
      S.Fields().check([], "")
    # Large ints fall back to the per-item check, and still fail it.
    with self.assertRaisesRegex(S.SchemaError, r"\[1\]"):
      S.List(S.Int(0, 10), 4).check([1, 2**64], "")

  def test_message_kinds(self):
    kinds = proto.front_door_kinds(vocab=100, max_tokens=50)
    good = {"kind": "generate", "prompts": [[1, 2]], "sampling": [proto.sampling_to_dict(
        __import__("mlkit.sampling", fromlist=["x"]).SamplingParams())]}
    self.assertEqual(S.message_schema(kinds, good)["prompts"], [[1, 2]])
    for bad, why in (([1], "must be a map"), ({"kind": "rpc"}, "unknown message kind"),
                     ({"x": 1}, "unknown message kind None"),
                     ({**good, "prompts": [[1, 100]]}, r"generate.prompts\[0\]\[1\]: 100"),
                     ({**good, "prompts": [list(range(51))]}, "list of 51 items"),
                     ({**good, "prompts": [[]]}, "list of 0 items")):
      with self.assertRaisesRegex(S.SchemaError, why):
        S.message_schema(kinds, bad)


def _pair(listener_kw=None, connect_key=KEY):
  """A listener and one connection to it: (listener, server side, client side)."""
  lis = wire.Listener(("127.0.0.1", 0), KEY, **(listener_kw or {}))
  got = {}

  def accept():
    try:
      got["conn"] = lis.accept(timeout_s=5)
    except Exception as e:  # noqa: BLE001 - reported to the test
      got["error"] = e

  t = threading.Thread(target=accept)
  t.start()
  try:
    client = wire.connect(lis.address, connect_key, timeout_s=5)
  finally:
    t.join(10)
  return lis, got.get("conn"), client


class HandshakeTest(absltest.TestCase):

  def test_keys_must_match(self):
    lis, server, client = _pair()
    client.send({"kind": "ok", "a": np.arange(3)})
    msg = server.recv({"ok": S.Fields({}, {"a": S.Array(("int64",))})})
    np.testing.assert_array_equal(msg["a"], np.arange(3))
    server.close()
    with self.assertRaises(EOFError):
      client.recv_frame()
    lis.close()
    lis = wire.Listener(("127.0.0.1", 0), KEY)
    t = threading.Thread(target=lambda: self.assertRaises(TimeoutError, lis.accept, 1.0))
    t.start()
    with self.assertRaisesRegex(wire.AuthenticationError, "refused our key"):
      wire.connect(lis.address, os.urandom(32), timeout_s=5)
    t.join()
    lis.close()
    with self.assertRaisesRegex(ValueError, "at least 16 bytes"):
      wire.connect(("127.0.0.1", 1), b"short")

  def test_strangers_never_get_a_connection(self):
    marker = os.path.join(temp_dir(self, "wire-"), "ran")
    lis = wire.Listener(("127.0.0.1", 0), KEY, handshake_timeout_s=0.5)
    for opening in (pickle_bytes(marker), frames._HEADER.pack(5) + b"hello", b""):
      with socket.create_connection(lis.address) as s:
        if opening:
          s.sendall(opening)
        sock, peer = lis.accept_socket(5)
        t0 = time.monotonic()
        with self.assertRaises(ConnectionError):  # wrong digest, or silence past the deadline
          lis.handshake(sock, peer)
        self.assertLess(time.monotonic() - t0, 3)
    self.assertFalse(os.path.exists(marker))
    # A server that is not one of ours: the connector refuses it.
    plain = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: plain.accept()[0].sendall(b"HTTP/1.1 200 OK\r\n" * 4),
                     daemon=True).start()
    with self.assertRaisesRegex(wire.AuthenticationError, "does not speak this protocol"):
      wire.connect(plain.getsockname(), KEY, timeout_s=5)
    plain.close()
    lis.close()

  def test_frame_limit_is_checked_before_the_body(self):
    lis, server, client = _pair({"max_frame": 1000})
    client._sock.sendall(frames._HEADER.pack(1 << 40))  # a terabyte announced, nothing sent
    with self.assertRaisesRegex(wire.FrameError, "exceeds this end's limit of 1000"):
      server.recv_frame()
    lis.close()


class KeysTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = temp_dir(self, "wire-keys-")
    self.env = {keys.ENV_KEY_FILE: os.path.join(self.dir, "sub", "serve.key")}

  def test_loopback_generates_a_private_key_file(self):
    k = wire.server_key(["127.0.0.1", "localhost", "::1"], env=self.env)
    self.assertTrue(k.generated)
    self.assertEqual(k.path, self.env[keys.ENV_KEY_FILE])
    self.assertEqual(stat.S_IMODE(os.stat(k.path).st_mode), 0o600)
    self.assertEqual(len(k.value), 64)
    self.assertNotIn(k.value.decode(), repr(k))
    again = wire.server_key(["127.0.0.1"], env=self.env)
    self.assertEqual((again.value, again.generated), (k.value, False))
    self.assertEqual(wire.client_key(env=self.env), k.value)
    self.assertNotEqual(wire.server_key(["127.0.0.1"], os.path.join(self.dir, "other.key"),
                                        env={}).value, k.value)

  def test_two_processes_starting_at_once_agree(self):
    path = os.path.join(self.dir, "race.key")
    code = ("import sys; from mlkit.wire import keys; "
            "print(keys.server_key(['127.0.0.1'], sys.argv[1], env={}).value.decode())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", code, path], cwd=root,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = {p.communicate(timeout=60)[0].strip() for p in procs}
    self.assertLen(outs, 1)
    self.assertEqual(outs.pop().encode(), keys.read_key_file(path))

  def test_other_addresses_need_a_key(self):
    for host in ("10.1.2.3", "0.0.0.0", "example.invalid"):
      with self.assertRaisesRegex(wire.AuthKeyError,
                                  f"{host} is not a loopback address.*MLKIT_SERVE_AUTHKEY or pass "
                                  "--authkey-file"):
        wire.server_key(["127.0.0.1", host], env=self.env)
    missing = os.path.join(self.dir, "missing.key")
    with self.assertRaisesRegex(wire.AuthKeyError, "does not exist"):
      wire.server_key(["10.1.2.3"], missing, env={})
    self.assertFalse(os.path.exists(missing))  # never generated for a public address
    k = wire.server_key(["10.1.2.3"], env={keys.ENV_KEY: "x" * 40})
    self.assertEqual(k.value, b"x" * 40)

  def test_unsafe_key_files_are_refused(self):
    path = os.path.join(self.dir, "k")
    with open(path, "w") as f:
      f.write("a" * 64)
    os.chmod(path, 0o644)
    with self.assertRaisesRegex(wire.AuthKeyError, "open to other users.*chmod 600"):
      wire.client_key(key_file=path, env={})
    os.chmod(path, 0o600)
    self.assertEqual(wire.client_key(key_file=path, env={}), b"a" * 64)
    with open(path, "w") as f:
      f.write("short\n")
    with self.assertRaisesRegex(wire.AuthKeyError, "at least 16"):
      wire.client_key(key_file=path, env={})
    with self.assertRaisesRegex(wire.AuthKeyError, "no key"):
      wire.client_key(env={keys.ENV_KEY_FILE: os.path.join(self.dir, "none")})
    with self.assertRaisesRegex(wire.AuthKeyError, "at least 16"):
      wire.client_key(env={keys.ENV_KEY: "tiny"})

  def test_loopback(self):
    for host, want in (("127.0.0.1", True), ("127.9.9.9", True), ("::1", True),
                       ("localhost", True), ("10.0.0.1", False), ("0.0.0.0", False),
                       ("no-such-host.invalid", False)):
      self.assertEqual(wire.is_loopback(host), want, host)


class InboxTest(parameterized.TestCase):
  """A server's inbox refuses bad frames with an error answer and closes that connection only."""

  @parameterized.named_parameters(
      ("pickle", "pickle"), ("not_msgpack", b"\xc1\xc1"), ("not_a_map", wire.encode([1, 2])),
      ("unknown_kind", wire.encode({"kind": "rpc"})),
      ("bad_field", wire.encode({"kind": "release", "uuid": -1})),
      ("too_large", "too_large"))
  def test_bad_frame(self, body):
    marker = os.path.join(temp_dir(self, "wire-"), "ran")
    lis = wire.Listener(("127.0.0.1", 0), KEY, max_frame=4096)
    inbox = proto.Inbox()
    inbox.accept_from(lis, proto.prefill_kinds(100, 64))
    good = wire.connect(lis.address, KEY)
    bad = wire.connect(lis.address, KEY)
    if body == "pickle":
      bad.send_frame(pickle_bytes(marker))
    elif body == "too_large":
      bad.send_frame(b"\x00" * 5000)
    else:
      bad.send_frame(body)
    reply = bad.recv(proto.reply_kinds())
    self.assertEqual(reply["kind"], "error")
    self.assertIn("refused a frame", reply["error"])
    with self.assertRaises((EOFError, ConnectionError)):
      bad.recv_frame()  # closed by the server
    _, msg = inbox.get(5)
    self.assertEqual(msg["kind"], proto.CLOSED)
    good.send({"kind": "release", "uuid": 5})  # the other connection is served on
    _, msg = inbox.get(5)
    self.assertEqual(msg, {"kind": "release", "uuid": 5})
    self.assertEqual(inbox.refused, 1)
    self.assertFalse(os.path.exists(marker))
    good.close()
    lis.close()

  def test_unauthenticated_peers_never_reach_the_queue(self):
    lis = wire.Listener(("127.0.0.1", 0), KEY)
    inbox = proto.Inbox()
    inbox.accept_from(lis, proto.prefill_kinds(100, 64))
    with self.assertRaises(wire.AuthenticationError):
      wire.connect(lis.address, os.urandom(32))
    with socket.create_connection(lis.address) as s:  # skips the handshake, sends a frame
      s.sendall(frames._HEADER.pack(12) + wire.encode({"kind": "shutdown"})[:12])
      s.settimeout(5)
      self.assertIn(s.recv(64)[:4], (frames.MAGIC, b""))
    self.assertIsNone(inbox.get(0.5))
    lis.close()

  def test_a_closed_listener_takes_no_more_connections(self):
    # The inbox's accept thread is blocked in accept(2) when the listener closes: it must
    # wake and end, and a peer that connects afterwards must be refused, not served.
    lis = wire.Listener(("127.0.0.1", 0), KEY)
    accepting = threading.Event()
    real_accept = lis.accept_socket

    def accept_socket(*args):
      accepting.set()
      return real_accept(*args)

    lis.accept_socket = accept_socket
    before = set(threading.enumerate())
    inbox = proto.Inbox()
    inbox.accept_from(lis, proto.prefill_kinds(100, 64))
    (loop,) = set(threading.enumerate()) - before
    self.assertTrue(accepting.wait(5))
    time.sleep(0.05)  # inside accept(2)
    lis.close()
    loop.join(5)
    self.assertFalse(loop.is_alive(), "the accept thread still waits on a closed listener")
    with self.assertRaisesRegex(ConnectionError, "cannot connect"):
      wire.connect(lis.address, KEY, timeout_s=1)
    self.assertIsNone(inbox.get(0.2))
    # A listener that never accepted closes too, and closing twice is harmless.
    idle = wire.Listener(("127.0.0.1", 0), KEY)
    idle.close()
    idle.close()


# ------------------------------------------------------------------ a pool's leader and follower
def _fake_side():
  """A DeviceSide stand-in for lockstep.follow: a real pool shape, recording each call."""
  from configs import TINY_MLA
  from mlkit.engine import EngineConfig
  from mlkit.kvcache import KVCacheConfig, init_paged_state
  cfg = EngineConfig(model=TINY_MLA, kv=KVCacheConfig(16, 4, "float32"), max_running=2,
                     batch_buckets=(2,), prefill_buckets=(4,), prefill_token_budget=8,
                     max_pages_per_seq=8)
  calls = []
  side = types.SimpleNamespace(runner=types.SimpleNamespace(config=cfg),
                               state=init_paged_state(TINY_MLA, cfg.kv), calls=calls)
  for op in ("sync_tags", "copy_pages", "run", "read", "call"):
    setattr(side, op, (lambda name: lambda *a: calls.append((name, a)))(op))
  return side


class LockstepWireTest(parameterized.TestCase):
  """The pool channel: followers check every operation; the leader drops strangers."""

  def _follow(self, side, port, out):
    from mlkit.engine import lockstep
    try:
      out["result"] = lockstep.follow(("127.0.0.1", port), side, KEY, connect_timeout_s=10)
    except Exception as e:  # noqa: BLE001 - reported to the test
      out["error"] = e

  @parameterized.named_parameters(
      ("pickle", "pickle"),
      ("unknown_op", {"kind": "exec", "code": "print(1)"}),
      ("unregistered_call", {"kind": "call", "name": "os.system", "args": ["true"]}),
      ("tags_wrong_dtype", {"kind": "sync_tags", "tags": np.zeros(16, np.float32)}),
      ("tags_wrong_length", {"kind": "sync_tags", "tags": np.zeros(15, np.int32)}),
      ("page_outside_pool", {"kind": "copy_pages", "copies": [[0, 16]]}),
      ("call_bad_args", {"kind": "call",
                         "name": "mlkit.engine.transfer.extract_to_host", "args": [[99], 4]}))
  def test_follower_refuses_and_runs_nothing(self, frame):
    from mlkit.engine import lockstep
    marker = os.path.join(temp_dir(self, "wire-"), "ran")
    side = _fake_side()
    port = _free_port()
    out = {}
    t = threading.Thread(target=self._follow, args=(side, port, out))
    t.start()
    leader = lockstep.Followers(("127.0.0.1", port), 1, KEY, timeout_s=10)
    conn = leader._conns[0]
    leader.send("sync_tags", (np.arange(16, dtype=np.int32),))  # a good one runs
    conn.send_frame(pickle_bytes(marker) if frame == "pickle" else wire.encode(frame))
    t.join(10)
    self.assertIsInstance(out.get("error"), wire.FrameError, out)
    self.assertEqual([c[0] for c in side.calls], ["sync_tags"])
    self.assertFalse(os.path.exists(marker))
    leader.close()

  @staticmethod
  def _raises(fn, *args, **kw):
    try:
      fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - returned to the test
      return e
    return None

  def test_leader_drops_strangers_and_runs_with_its_follower(self):
    from mlkit.engine import lockstep
    from mlkit.engine.transfer import extract_to_host
    marker = os.path.join(temp_dir(self, "wire-"), "ran")
    side = _fake_side()
    port = _free_port()
    out = {}
    threads = []

    def stranger(opening):
      deadline = time.monotonic() + 10
      while time.monotonic() < deadline:
        try:
          with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(opening)
            s.recv(64)
          return
        except OSError:
          time.sleep(0.05)

    joined = {}
    waiting = threading.Thread(target=lambda: joined.update(
        leader=lockstep.Followers(("127.0.0.1", port), 1, KEY, timeout_s=30)))
    waiting.start()  # the leader listens; strangers come first, then its follower
    for opening in (pickle_bytes(marker), b"\x00" * 64):
      threads.append(threading.Thread(target=stranger, args=(opening,)))
    threads.append(threading.Thread(
        target=lambda: out.update(wrong_key=self._raises(
            lockstep.follow, ("127.0.0.1", port), _fake_side(), os.urandom(32),
            connect_timeout_s=10))))
    for th in threads:
      th.start()
    for th in threads:
      th.join(20)
    self.assertIsInstance(out.pop("wrong_key"), wire.AuthenticationError)
    follower = threading.Thread(target=self._follow, args=(side, port, out))
    follower.start()
    waiting.join(20)
    leader = joined["leader"]
    leader.send("copy_pages", ([(1, 2)],))
    leader.send("call", (extract_to_host, [3, 4], 7))
    with self.assertRaisesRegex(ValueError, "not a registered pool call"):
      leader.send("call", (print, 1))
    leader.close()
    follower.join(10)
    self.assertEqual(out.get("result"), (2, True), out)
    self.assertEqual(side.calls[0], ("copy_pages", ([(1, 2)],)))
    self.assertEqual(side.calls[1], ("call", (extract_to_host, [3, 4], 7)))
    self.assertFalse(os.path.exists(marker))


if __name__ == "__main__":
  absltest.main()
