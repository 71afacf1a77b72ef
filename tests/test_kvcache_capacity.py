"""The capacity experiment: real pools inside a byte budget, bf16 vs fp8, and paper-scale figures."""

import json
import os
import tempfile

from absl.testing import absltest

from experiments import capacity


class CapacityExperimentTest(absltest.TestCase):

  def test_quick_run_writes_results_and_doubles_capacity(self):
    with tempfile.TemporaryDirectory() as out:
      record = capacity.run(out, quick=True)
      for name in ("capacity.json", "capacity.md", "capacity.png"):
        self.assertGreater(os.path.getsize(os.path.join(out, name)), 0, name)
      with open(os.path.join(out, "capacity.json")) as f:
        on_disk = json.load(f)
      with open(os.path.join(out, "capacity.md")) as f:
        md = f.read()
    self.assertEqual(on_disk["ratio"], record["ratio"])
    self.assertIn("jax", on_disk["machine"])
    self.assertIn("backend", on_disk["machine"])
    self.assertGreaterEqual(record["ratio"], 1.95)
    self.assertTrue(record["ratio_ok"])
    for r in record["measured"]:
      self.assertLessEqual(r["allocated_bytes"], r["budget_bytes"])
      # The budget is used up to less than one page.
      self.assertLess(r["unused_bytes"], r["bytes_per_token"] * capacity.PAGE_SIZE + 4)
    kimi = {r["dtype"]: r for r in record["paper"] if r["model"] == "kimi-k2.6"}
    self.assertEqual(kimi["bfloat16"]["bytes_per_token"], 70_272)
    self.assertEqual(kimi["float8_e4m3fn"]["value_bytes"], 35_136)
    self.assertEqual(kimi["bfloat16"]["tokens_per_gpu"], 683_008)
    self.assertIn("686,000", md)
    self.assertIn("1,370,000", md)


if __name__ == "__main__":
  absltest.main()
