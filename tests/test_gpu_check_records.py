"""pallas_kernels.gpu_check_records: gpu_check's JSONL read back, one run or a run and its
rerun merged, with a killed run's cut-off last line skipped."""

import json
import os

from absl.testing import absltest

from pallas_kernels import gpu_check_records as gcr
from tempdirs import temp_dir


def _case(name, status="ok", group="kernel", impls=(), **extra):
  return {"type": "case", "name": name, "status": status, "group": group,
          "impls": list(impls), **extra}


def _write(path, records, cut_tail=None):
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
    if cut_tail is not None:  # a run killed while writing its next record
      f.write(json.dumps(cut_tail)[:25])
  return path


class GpuCheckRecordsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = temp_dir(self, "gpu_check_records_")
    xla = {"impl": "xla", "correct": True, "timing": {"median_s": 3e-6}}
    wrong_peer = {"impl": "peer", "correct": False, "rel_err": 0.5}
    self.first = _write(os.path.join(self.dir, "first.jsonl"), [
        {"type": "header", "jax": "0.11.2", "plan_size": 4},
        {"type": "worker", "pid": 11, "device_kind": "NVIDIA H200"},
        _case("a", impls=[{"impl": "pallas", "correct": True}, xla, wrong_peer]),
        _case("b", status="crashed"),
        _case("fault/hang", status="timeout", group="fault"),
        {"type": "budget", "stopped": True, "unstarted": ["c"]},
        {"type": "summary", "counts": {"ok": 1}, "fp8_vs_bf16": [{"fp8": "a"}]},
    ])
    self.rerun = _write(os.path.join(self.dir, "rerun.jsonl"), [
        {"type": "header", "jax": "0.11.2", "plan_size": 2},
        {"type": "worker", "pid": 12},
        _case("b"),
        _case("c", status="ok"),
        {"type": "summary", "counts": {"ok": 2}, "fp8_vs_bf16": [{"fp8": "c"}]},
    ], cut_tail=_case("d"))

  def test_a_cut_off_last_line_is_skipped(self):
    records = gcr.read_jsonl(self.rerun)
    self.assertEqual([r["type"] for r in records],
                     ["header", "worker", "case", "case", "summary"])
    # Every run's cases, as the step-time model reads them (mlkit.plan.step_programs).
    self.assertEqual([r["name"] for r in gcr.read_cases([self.first, self.rerun])],
                     ["a", "b", "fault/hang", "b", "c"])

  def test_one_run(self):
    runs = gcr.read_runs(self.first)
    self.assertEqual(runs.paths, (self.first,))
    self.assertEqual([r["name"] for r in runs.cases], ["a", "b", "fault/hang"])
    self.assertEqual([r["name"] for r in runs.measured], ["a", "b"])
    self.assertFalse(runs.all_ok)  # b crashed; the fault case's timeout is no failure
    self.assertEqual(runs.header["plan_size"], 4)
    self.assertEqual([s["type"] for s in runs.stops], ["budget"])
    self.assertEqual([w["pid"] for w in runs.workers], [11])
    self.assertEqual(runs.summary["fp8_vs_bf16"], [{"fp8": "a"}])

  def test_a_rerun_replaces_the_cases_it_ran_again(self):
    runs = gcr.read_runs([self.first, self.rerun])
    # b ran again: its later record is kept, and sorts after the first run's cases.
    self.assertEqual([(r["name"], r["status"]) for r in runs.cases],
                     [("a", "ok"), ("fault/hang", "timeout"), ("b", "ok"), ("c", "ok")])
    self.assertTrue(runs.all_ok)
    self.assertEqual(runs.header["plan_size"], 4)  # the first run's header
    self.assertEqual(runs.summary["counts"], {"ok": 1})  # the first run's summary ...
    self.assertEqual(runs.summary["fp8_vs_bf16"], [{"fp8": "a"}, {"fp8": "c"}])  # ... all pairs
    self.assertEqual([w["pid"] for w in runs.workers], [11, 12])

  def test_nothing_measured_is_not_ok(self):
    empty = _write(os.path.join(self.dir, "empty.jsonl"), [
        {"type": "aborted", "reason": "no GPU"}])
    runs = gcr.read_runs(empty)
    self.assertEqual((runs.cases, runs.header, runs.summary), ([], {}, None))
    self.assertFalse(runs.all_ok)
    self.assertEqual(runs.stops, [{"type": "aborted", "reason": "no GPU"}])

  def test_wrong_impls_and_xla_time(self):
    a, b = gcr.read_runs(self.first).cases[:2]
    self.assertEqual([p["impl"] for p in gcr.wrong_impls(a)], ["peer"])
    self.assertEqual(gcr.xla_time(a), 3e-6)
    self.assertEqual((gcr.wrong_impls(b), gcr.xla_time(b)), ([], None))

  def test_best_peer_is_the_fastest_right_one(self):
    wrong = {"impl": "fastest", "correct": False}
    case = _case("a", impls=[wrong, {"impl": "slow", "correct": True}],
                 peer_time_s={"fastest": 1e-6, "slow": 5e-6, "mid": 2e-6})
    self.assertEqual(gcr.best_peer(case), ("mid", 2e-6))
    self.assertIsNone(gcr.best_peer(_case("b", impls=[wrong], peer_time_s={"fastest": 1e-6})))
    self.assertIsNone(gcr.best_peer(_case("c")))

  def test_ceiling_text(self):
    copy = _case("copy", group="ceiling", measured={"copy_bytes_per_s": 4.3123e12})
    fp8 = _case("mm8", group="ceiling", measured={"matmul_fp8_flops_per_s": 1.5e15})
    self.assertEqual([gcr.ceiling_text(c) for c in (copy, fp8)], ["4.31 TB/s", "1500 TFLOP/s"])
    self.assertEqual(gcr.ceiling_text(_case("mm", status="crashed", group="ceiling")), "crashed")


if __name__ == "__main__":
  absltest.main()
