"""`python -m experiments`: a bad --out fails at once, before any experiment is imported or run."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest, parameterized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
  """Runs ``python -X importtime -m experiments ARGS`` from the repository root; (result, seconds)."""
  t0 = time.perf_counter()
  res = subprocess.run([sys.executable, "-X", "importtime", "-m", "experiments", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  return res, time.perf_counter() - t0


def _imported(stderr: str) -> set[str]:
  """Top-level module names from ``-X importtime`` lines ("import time: ... | <module>")."""
  return {m.group(1).strip().split(".")[0]
          for m in re.finditer(r"^import time:.*\|\s*(\S+)\s*$", stderr, re.M)}


def _errors(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if not line.startswith("import time:")]


class OutDirTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.tmp = tempfile.mkdtemp(prefix="mlkit_cli_")
    self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
    self.file = os.path.join(self.tmp, "a_file")
    with open(self.file, "w") as f:
      f.write("not a directory")

  # Root ignores permission bits, so unwritable places are ones the kernel refuses to
  # anybody: under a regular file, inside /proc (no files can be created there) and
  # inside /sys (sysfs refuses new files with "Permission denied", even to root).
  @parameterized.named_parameters(
      ("empty", lambda t, f: "", r"--out is an empty string"),
      ("a_file", lambda t, f: f, r"--out {out}: exists and is not a directory"),
      ("under_a_file", lambda t, f: os.path.join(f, "sub"), r"--out {out}: .*\(Not a directory\)"),
      ("in_proc", lambda t, f: "/proc/mlkit_out", r"--out {out}: .*\(No such file or directory\)"),
      ("proc_itself", lambda t, f: "/proc", r"--out {out}: .*\(No such file or directory: /proc/"),
      ("read_only_dir", lambda t, f: "/sys", r"--out {out}: .*\(Permission denied: /sys/\.write-probe"),
      ("in_read_only_dir", lambda t, f: "/sys/mlkit_out", r"--out {out}: .*\(Operation not permitted\)"),
  )
  def test_bad_out_fails_before_any_work(self, make, pattern):
    out = make(self.tmp, self.file)
    res, secs = _cli("--out", out, "capacity", "--smoke")
    self.assertEqual(res.returncode, 2, res.stderr[-2000:])
    errors = _errors(res.stderr)
    self.assertLen(errors, 1, errors)  # one line, no traceback
    self.assertRegex(errors[0], "^error: " + pattern.format(out=re.escape(out)))
    self.assertEqual(res.stdout, "")
    # Nothing ran: neither the experiment nor jax was even imported.
    imported = _imported(res.stderr)
    self.assertIn("absl", imported)  # the parse of -X importtime works
    self.assertNotIn("jax", imported)
    self.assertNotIn("mlkit", imported)
    self.assertFalse(any(line.rstrip().endswith("experiments.capacity") for line in res.stderr.splitlines()))
    self.assertLess(secs, 30)
    self.assertFalse(os.path.exists("/proc/mlkit_out") or os.path.exists("/sys/mlkit_out"))

  @absltest.skipIf(os.geteuid() == 0, "root ignores permission bits; /sys stands in for this case")
  def test_read_only_dir_by_permissions(self):
    out = os.path.join(self.tmp, "ro")
    os.makedirs(out)
    os.chmod(out, 0o555)
    self.addCleanup(os.chmod, out, 0o755)
    res, _ = _cli("--out", out, "capacity", "--smoke")
    self.assertEqual(res.returncode, 2)
    self.assertRegex(_errors(res.stderr)[0], r"^error: --out .*\(Permission denied")
    self.assertNotIn("jax", _imported(res.stderr))

  def test_good_out_is_created_and_left_clean(self):
    out = os.path.join(self.tmp, "new", "dir")
    res, _ = _cli("--out", out, "no_such_experiment")
    self.assertEqual(res.returncode, 2)
    self.assertIn("unknown experiment(s): no_such_experiment", res.stderr)
    self.assertFalse(os.path.exists(out))  # a typo in the names creates nothing
    # The check itself: a missing folder is created, and its write probe removed again (the
    # quickest experiment, the capacity arithmetic, writes into it).
    res, _ = _cli("--out", out, "capacity", "--smoke")
    self.assertEqual(res.returncode, 0, "\n".join(_errors(res.stderr))[-2000:])
    self.assertTrue(os.path.isdir(out))
    written = sorted(os.listdir(out))
    self.assertEqual([f for f in written if f.startswith(".")], [])  # the probe file is gone
    self.assertContainsSubset({"capacity.json", "capacity.md", "capacity.png", "REPORT.md"},
                              written)


if __name__ == "__main__":
  absltest.main()
