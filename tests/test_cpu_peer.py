"""The cpu_peer experiment without torch: the skip path, the engine side, the worker protocol.

torch and transformers are never imported here: the peer is a fake interpreter that cannot
import them, and the worker's request loop runs against a stand-in model. The smoke run goes
through the command line (checked by CpuPeerSmokeChecks, mixed into
test_experiments.SmokeRunsTest); the rest tests the library it runs (mlkit.peer).
"""

import contextlib
import json
import os
import shutil
import stat
import tempfile
from unittest import mock

import numpy as np
from absl.testing import absltest

from mlkit.peer import compare, transformers_worker


_NO_TORCH = "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n"


def _tempdir(test) -> str:
  folder = tempfile.mkdtemp(prefix="cpu_peer_test_")
  test.addCleanup(shutil.rmtree, folder, ignore_errors=True)
  return folder


def fake_python(folder: str) -> str:
  """An interpreter that cannot import torch: a peer that cannot start."""
  path = os.path.join(folder, "python")
  with open(path, "w") as f:
    f.write(_NO_TORCH)
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
  return path


class SkipTest(absltest.TestCase):

  def test_interpreter_without_torch_is_skipped_with_a_clear_message(self):
    msg = compare.peer_unavailable(fake_python(_tempdir(self)))
    self.assertIn("transformers peer skipped", msg)
    self.assertIn("cannot import torch and transformers", msg)
    self.assertIn("No module named 'torch'", msg)
    self.assertIn(compare.PEER_PYTHON_ENV, msg)

  def test_missing_interpreter_is_skipped(self):
    msg = compare.peer_unavailable("/no/such/python")
    self.assertIn("/no/such/python", msg)
    self.assertIn(compare.PEER_PYTHON_ENV, msg)

  def test_peer_python_comes_from_the_environment(self):
    with mock.patch.dict(os.environ, {compare.PEER_PYTHON_ENV: "/opt/peer/bin/python"}):
      self.assertEqual(compare.peer_python(), "/opt/peer/bin/python")


class CpuPeerSmokeChecks:
  """Checks of the cpu_peer smoke run, with a peer that cannot start: the engine's side
  alone, and the report says why. Not a TestCase: test_experiments.SmokeRunsTest mixes it
  in, which runs every experiment's smoke mode in one process, with
  ``compare.PEER_PYTHON_ENV`` naming :func:`fake_python`."""

  def test_cpu_peer_engine_side_runs_and_the_report_says_the_peer_was_skipped(self):
    rec, out = self.records["cpu_peer"], self.out
    self.assertEqual(rec["experiment"], "cpu_peer")
    self.assertIn("cannot import torch and transformers", rec["peer_skipped"])
    self.assertIsNone(rec["peer"])
    self.assertIsNone(rec["target_met"])
    (row,) = rec["rows"]
    self.assertEqual(row["batch"], 2)
    self.assertGreater(row["engine_tok_s"], 0)
    self.assertTrue(row["engine_runs_agree"])
    self.assertIsNone(row["peer_tok_s"])
    self.assertIsNone(row["tokens_match"])
    with open(os.path.join(out, "cpu_peer.md")) as f:
      md = f.read()
    self.assertTrue(md.startswith("# cpu_peer"))
    self.assertIn("transformers peer skipped", md)
    self.assertIn("| 2 |", md)
    self.assertFalse(os.path.exists(os.path.join(out, "cpu_peer.png")))


class BatchRowTest(absltest.TestCase):

  def test_medians_ratio_and_token_agreement(self):
    wl = compare.Workload((2,), 4, 3, 2)
    eng = [{"seconds": s, "tokens": [[1, 2, 3], [4, 5, 6]], "prefill_ms": 1.0,
            "decode_ms_median": 2.0, "host_ms_per_step": 0.5} for s in (1.0, 3.0)]
    peer = [{"seconds": 4.0, "tokens": [[1, 2, 3], [4, 5, 7]]}] * 2
    row = compare.batch_row(2, wl, eng, peer)
    self.assertEqual((row["engine_tok_s"], row["peer_tok_s"], row["ratio"]), (3.0, 1.5, 2.0))
    self.assertTrue(row["engine_runs_agree"])
    self.assertEqual(row["tokens_match"],
                     {"identical": False, "fraction": 5 / 6, "first_mismatch": [1, 2]})
    alone = compare.batch_row(2, wl, eng, [])  # the peer skipped
    self.assertIsNone(alone["ratio"])
    self.assertIsNone(alone["tokens_match"])


class _FakeTorch:
  """What the worker's request loop uses of torch, over numpy."""

  long = np.int64

  @staticmethod
  def tensor(x, dtype=None):
    return np.asarray(x, dtype)

  ones_like = staticmethod(np.ones_like)

  @staticmethod
  def inference_mode():
    return contextlib.nullcontext()


class _FakeModel:
  """Appends token (last prompt token + i + 1) % 50; ``stop_after`` cuts generation short."""

  def __init__(self, stop_after=None):
    self.stop_after = stop_after
    self.calls = []

  def generate(self, ids, *, max_new_tokens, eos_token_id, **kwargs):
    self.calls.append(dict(kwargs, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id))
    n = max_new_tokens if self.stop_after is None else min(self.stop_after, max_new_tokens)
    new = (ids[:, -1:] + np.arange(1, n + 1)[None]) % 50
    return np.concatenate([ids, new], axis=1)


class WorkerProtocolTest(absltest.TestCase):

  def _serve(self, model, *requests):
    replies = []
    transformers_worker.serve(model, _FakeTorch, [json.dumps(r) + "\n" for r in requests],
                              replies.append)
    return replies

  def test_replies_tokens_and_time_per_request(self):
    model = _FakeModel()
    (r,) = self._serve(model, {"prompts": [[1, 2, 3], [4, 5, 6]], "new_tokens": 4})
    self.assertEqual(r["tokens"], [[4, 5, 6, 7], [7, 8, 9, 10]])
    self.assertGreaterEqual(r["seconds"], 0.0)
    # Greedy, with the cache, and no end-of-sequence stop.
    self.assertEqual(model.calls[0]["do_sample"], False)
    self.assertEqual(model.calls[0]["use_cache"], True)
    self.assertIsNone(model.calls[0]["eos_token_id"])

  def test_bad_requests_get_errors_and_the_worker_goes_on(self):
    r1, r2, r3 = self._serve(_FakeModel(stop_after=2),
                             {"prompts": [[1, 2], [3]], "new_tokens": 2},
                             {"prompts": [[1, 2]], "new_tokens": 3},
                             {"prompts": [[1, 2]], "new_tokens": 2})
    self.assertIn("same length", r1["error"])
    self.assertIn("stopped early", r2["error"])
    self.assertEqual(r3["tokens"], [[3, 4]])


if __name__ == "__main__":
  absltest.main()
