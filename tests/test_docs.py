"""The README and docs/ name only things that exist, and the README's quick start runs.

Every file path, `python -m` module, dotted name (``mlkit.engine.Engine.adopt``)
and relative link in README.md and docs/*.md must resolve: a renamed function
or a deleted module fails here, not in a newcomer's hands.
"""

import importlib
import importlib.util
import os
import re
import subprocess
import sys

from absl.testing import absltest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
TOP = ("mlkit", "pallas_kernels", "configs", "experiments")
# A path of the repository: a top-level folder, then a path (in backticks or a link).
PATH = re.compile(r"(?<![\w/.-])((?:mlkit|pallas_kernels|configs|experiments|scripts|tests|docs)"
                  r"/[\w./-]*\w)")
DOTTED = re.compile(r"(?<![\w.:/-])((?:mlkit|pallas_kernels|configs)(?:\.\w+)+)")
MODULE = re.compile(r"python3? -m ([\w.]+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def resolve(dotted: str) -> bool:
  """Whether ``a.b.c`` is a module, or an attribute chain of one."""
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    name = ".".join(parts[:i])
    try:
      obj = importlib.import_module(name)
    except ImportError:
      continue
    for attr in parts[i:]:
      if not hasattr(obj, attr):
        return False
      obj = getattr(obj, attr)
    return True
  return False


def _text(page: str) -> str:
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    return f.read()


class DocsTest(absltest.TestCase):

  def test_paths_modules_names_and_links_exist(self):
    missing = []
    for page in PAGES:
      text = _text(page)
      for path in set(PATH.findall(text)):
        if not os.path.exists(os.path.join(ROOT, path.rstrip("."))):
          missing.append(f"{page}: path {path}")
      for mod in set(MODULE.findall(text)):
        if importlib.util.find_spec(mod) is None:
          missing.append(f"{page}: python -m {mod}")
      for name in set(DOTTED.findall(text)):
        if not resolve(name.rstrip(".")):
          missing.append(f"{page}: name {name}")
      for link in set(LINK.findall(text)):
        if "://" in link:
          continue
        if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(page), link))):
          missing.append(f"{page}: link {link}")
    self.assertEqual(missing, [], "\n".join(missing))

  def test_the_checker_catches_what_is_stale(self):
    self.assertTrue(resolve("mlkit.engine.Engine.adopt"))
    self.assertFalse(resolve("mlkit.engine.Engine.no_such_method"))
    self.assertFalse(resolve("pallas_kernels.lowering"))
    self.assertEqual(PATH.findall("see `mlkit/engine/engine.py` and docs/x.md."),
                     ["mlkit/engine/engine.py", "docs/x.md"])
    self.assertEqual(DOTTED.findall("call `mlkit.serve.bench.main` (mlkit:ttft)"),
                     ["mlkit.serve.bench.main"])

  def test_readme_stays_short(self):
    self.assertLessEqual(len(_text("README.md").splitlines()), 260)

  def test_readme_python_quick_start_runs(self):
    block = re.search(r"## Python quick start\n+```python\n(.*?)```", _text("README.md"), re.S)
    self.assertIsNotNone(block)
    res = subprocess.run([sys.executable, "-c", block.group(1)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    self.assertEqual(res.returncode, 0, res.stderr[-3000:])
    outs = eval(res.stdout.strip().splitlines()[-1])  # noqa: S307 - our own README's output
    self.assertEqual([len(o) for o in outs], [8, 8])


if __name__ == "__main__":
  absltest.main()
