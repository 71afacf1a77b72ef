"""The capacity experiment: real pools inside a byte budget, bf16 vs fp8, and paper-scale figures."""

import json
import os
import subprocess
import sys

from absl.testing import absltest

from configs import TINY_MLA
from experiment_runs import REPO
from mlkit import kvcache as kvc
from mlkit.plan.kv_tokens import PAGE_SIZE
from tempdirs import temp_dir



class CapacityExperimentTest(absltest.TestCase):

  def test_quick_run_writes_results_and_doubles_capacity(self):
    out = temp_dir(self, "capacity_")
    res = subprocess.run([sys.executable, "-m", "experiments", "capacity", "--out", out],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    self.assertEqual(res.returncode, 0, res.stderr[-3000:])
    for name in ("capacity.json", "capacity.md", "capacity.png"):
      self.assertGreater(os.path.getsize(os.path.join(out, name)), 0, name)
    with open(os.path.join(out, "capacity.json")) as f:
      record = json.load(f)
    with open(os.path.join(out, "capacity.md")) as f:
      md = f.read()
    self.assertIn(f"fp8/bf16 token ratio {record['ratio']:.3f}", res.stdout)
    self.assertIn("jax", record["machine"])
    self.assertIn("backend", record["machine"])
    self.assertGreaterEqual(record["ratio"], 1.95)
    self.assertTrue(record["ratio_ok"])
    for r in record["measured"]:
      self.assertLessEqual(r["allocated_bytes"], r["budget_bytes"])
      # The budget is used up to less than one page.
      self.assertLess(r["unused_bytes"], r["bytes_per_token"] * PAGE_SIZE + 4)
    kimi = {r["dtype"]: r for r in record["paper"] if r["model"] == "kimi-k2.6"}
    self.assertEqual(kimi["bfloat16"]["bytes_per_token"], 70_272)
    self.assertEqual(kimi["float8_e4m3fn"]["value_bytes"], 35_136)
    self.assertEqual(kimi["bfloat16"]["tokens_per_gpu"], 683_008)
    self.assertIn("686,000", md)
    self.assertIn("1,370,000", md)


class AllocateWithinTest(absltest.TestCase):

  def test_the_pool_fits_its_budget_to_within_a_page(self):
    budget = 3 << 20
    for dtype in ("bfloat16", "float8_e4m3fn"):
      r = kvc.allocate_within(TINY_MLA, dtype, budget, page_size=PAGE_SIZE)
      self.assertLessEqual(r["allocated_bytes"], budget)
      self.assertLess(r["unused_bytes"], r["bytes_per_token"] * PAGE_SIZE + 4)
      self.assertEqual(r["tokens"], r["pages"] * PAGE_SIZE)


if __name__ == "__main__":
  absltest.main()
