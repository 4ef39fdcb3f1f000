"""BUILD must list every library module, binary and test file (Bazel cannot run here)."""

import ast
import glob
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _targets():
  """(rule, name, srcs) for each rule call in BUILD, read with Python's own parser."""
  tree = ast.parse(open(os.path.join(REPO, "BUILD")).read())
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
      kw = {k.arg: k.value for k in node.keywords}
      if "name" in kw:
        srcs = [e.value for e in getattr(kw.get("srcs"), "elts", [])]
        out.append((node.func.id, kw["name"].value, srcs))
  return out


def test_every_module_is_in_a_library():
  listed = {s for rule, _, srcs in _targets() if rule == "py_library" for s in srcs}
  for pkg in ("kernels", "tunix_core"):
    for path in glob.glob(os.path.join(REPO, pkg, "*.py")):
      rel = os.path.relpath(path, REPO)
      assert rel in listed, f"{rel} is missing from a py_library in BUILD"


def test_every_test_file_has_a_py_test():
  tests = {srcs[0] for rule, _, srcs in _targets() if rule == "py_test"}
  for path in glob.glob(os.path.join(REPO, "tests", "test_*.py")):
    rel = os.path.relpath(path, REPO)
    assert rel in tests, f"{rel} has no py_test in BUILD"


def test_binaries_and_listed_files_exist():
  targets = _targets()
  binaries = {srcs[0] for rule, _, srcs in targets if rule == "py_binary"}
  assert "trainer.py" in binaries
  for path in glob.glob(os.path.join(REPO, "benchmarks", "*.py")):
    assert os.path.relpath(path, REPO) in binaries, f"{path} has no py_binary in BUILD"
  for _, name, srcs in targets:
    for src in srcs:
      assert os.path.exists(os.path.join(REPO, src)), f"{name} lists missing file {src}"
