"""BUILD must list every library module, binary and test file (Bazel cannot run here), and
the package keeps its architecture: imports only go down the sub-packages' floors, no
import cycle (imports inside functions included), no module far over 300 lines."""

import ast
import dataclasses
import glob
import os

import pytest

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


def _package_dirs() -> dict:
  """`{import name: folder}` of our packages, as setup.py installs them (its
  `package_dir`; a package without an entry lives in the folder of its name)."""
  tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
  call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "id", None) == "setup")
  kw = {k.arg: k.value for k in call.keywords}
  mapped = ast.literal_eval(kw["package_dir"])
  return {name: mapped.get(name, name) for name in ("tunix_kernels", "tunix_core")}


def test_the_kernels_folder_installs_as_tunix_kernels():
  # Hugging Face's `kernels` (a dependency of transformers 5) owns the name `kernels`.
  assert _package_dirs() == {"tunix_kernels": "kernels", "tunix_core": "tunix_core"}


def test_nothing_of_ours_imports_kernels():
  files = [os.path.join(REPO, "trainer.py")] + [
      p for d in ("kernels", "tunix_core", "tests", "benchmarks")
      for p in glob.glob(os.path.join(REPO, d, "**", "*.py"), recursive=True)]
  for path in files:
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
      for name in names:
        assert name.split(".")[0] != "kernels", (
            f"{os.path.relpath(path, REPO)}:{node.lineno} imports `{name}`: our kernels "
            "are `tunix_kernels`; `kernels` is Hugging Face's package")


def test_every_module_is_in_a_library():
  # tunix_kernels' sources reach its py_library through the genrule that copies them
  # under the import name.
  listed = {s for rule, _, srcs in _targets() if rule in ("py_library", "genrule")
            for s in srcs}
  for pkg in _package_dirs().values():
    for path in glob.glob(os.path.join(REPO, pkg, "**", "*.py"), recursive=True):
      rel = os.path.relpath(path, REPO)
      assert rel in listed or rel.endswith("__main__.py"), (
          f"{rel} is missing from a py_library in BUILD")


def test_every_test_file_has_a_py_test():
  tests = {srcs[0] for rule, _, srcs in _targets() if rule == "py_test"}
  for path in glob.glob(os.path.join(REPO, "tests", "test_*.py")):
    rel = os.path.relpath(path, REPO)
    assert rel in tests, f"{rel} has no py_test in BUILD"


def test_binaries_and_listed_files_exist():
  targets = _targets()
  binaries = {srcs[0] for rule, _, srcs in targets if rule == "py_binary"}
  assert "trainer.py" in binaries and "tunix_core/hf/__main__.py" in binaries
  for path in glob.glob(os.path.join(REPO, "benchmarks", "*.py")):
    assert os.path.relpath(path, REPO) in binaries, f"{path} has no py_binary in BUILD"
  for _, name, srcs in targets:
    for src in (s for s in srcs if not s.startswith(":")):   # files, not target labels
      assert os.path.exists(os.path.join(REPO, src)), f"{name} lists missing file {src}"


# Floors of the sub-packages: a module imports only from lower floors and its own
# package. Entry points (`__main__` modules) sit above everything.
FLOORS = {"tunix_kernels": 0, "tunix_core.storage": 0, "tunix_core.model": 1, "tunix_core.data": 1, "tunix_core.hf": 2,
          "tunix_core.parallel": 2, "tunix_core.training": 3, "tunix_core.generate": 3,
          "tunix_core.checkpoints": 4, "tunix_core.online": 4,
          "tunix_core.run": 5, "tunix_core.aot": 6, "tunix_core.plot": 6, "tunix_core.cli": 7}


def _modules() -> dict:
  """`{dotted import name: path}` of every module of tunix_kernels and tunix_core."""
  out = {}
  for pkg, folder in _package_dirs().items():
    for path in glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True):
      name = pkg + "." + os.path.relpath(path, os.path.join(REPO, folder))[:-3].replace(os.sep, ".")
      out[name.removesuffix(".__init__")] = path
  return out


def _imports(path: str, modules: dict) -> set:
  """The library modules `path` imports anywhere in it (functions included)."""
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      # `from pkg import sub` imports the submodule; `from pkg import name`, the package.
      names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
               else node.module for a in node.names]
    else:
      continue
    for name in names:
      while name and name not in modules:
        name = name.rpartition(".")[0]
      if name:
        found.add(name)
  return found


def _package(module: str) -> str:
  parts = module.split(".")
  return ".".join(parts[:2]) if parts[0] == "tunix_core" and len(parts) > 1 else parts[0]


def _graph():
  modules = _modules()
  return {m: _imports(p, modules) - {m} for m, p in modules.items()
          if not m.endswith("__main__")}


def test_imports_only_go_down():
  for module, imported in _graph().items():
    if module == "tunix_core":
      continue
    mine = _package(module)
    for other in imported:
      theirs = _package(other)
      if theirs == mine or other == "tunix_core":
        continue
      assert FLOORS[theirs] < FLOORS[mine], f"{module} imports {other} (a higher floor)"


def test_no_import_cycle():
  graph, done, path = _graph(), set(), []

  def visit(m):
    if m in path:
      pytest.fail("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
    if m in done:
      return
    path.append(m)
    for n in sorted(graph.get(m, ())):
      visit(n)
    path.pop()
    done.add(m)

  for m in sorted(graph):
    visit(m)


def test_no_module_far_over_300_lines():
  for path in _modules().values():
    with open(path, encoding="utf-8") as f:
      assert sum(1 for _ in f) <= 320, f"{path} is over ~300 lines: split it by concept"


def test_no_former_module_name_imports():
  """The flat module names of an unreleased layout (`tunix_kernels.logprobs_pallas`, ...)
  are gone: each op's modules live in its sub-package only."""
  import importlib  # pylint: disable=g-import-not-at-top
  for former in ("logprobs_pallas", "dpo_losses", "attention_xla"):
    with pytest.raises(ImportError):
      importlib.import_module(f"tunix_kernels.{former}")


def test_below_the_plan_nothing_reads_the_run_config():
  """Below the step plan (the kernels, model, parallel, data, storage, hf, and training
  but for the config, its flags and the plan) no module imports `training.config`, and
  the plan holds what it resolved, not the config."""
  below = ("tunix_kernels", "tunix_core.model", "tunix_core.parallel", "tunix_core.data",
           "tunix_core.storage", "tunix_core.hf", "tunix_core.training")
  allowed = {f"tunix_core.training.{m}" for m in ("config", "flags", "plan")}
  for module, imported in _graph().items():
    if _package(module) in below and module not in allowed:
      assert "tunix_core.training.config" not in imported, module
  from tunix_core.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.training import plan as plan_lib  # pylint: disable=g-import-not-at-top
  for field in dataclasses.fields(plan_lib.StepPlan):
    assert field.type not in (config_lib.TrainConfig, "TrainConfig"), field.name


# Per-op idioms that each op defines for itself, as JAX's Pallas ops do.
SAME_NAME_BY_DESIGN = {"BlockSizes"}


def test_one_name_per_concept():
  """No class name is defined in two modules (but `SAME_NAME_BY_DESIGN`), and no name
  is exported by two packages' `__init__` as two different functions."""
  import collections  # pylint: disable=g-import-not-at-top
  import importlib  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  modules = _modules()
  classes = collections.defaultdict(list)
  for name, path in modules.items():
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
      if isinstance(node, ast.ClassDef):
        classes[node.name].append(name)
  twice = {c: m for c, m in classes.items() if len(m) > 1 and c not in SAME_NAME_BY_DESIGN}
  assert not twice, twice
  exported = collections.defaultdict(set)
  for name, path in modules.items():
    if path.endswith("__init__.py"):
      for key, value in vars(importlib.import_module(name)).items():
        if inspect.isfunction(value) and not key.startswith("_"):
          exported[key].add(f"{value.__module__}.{value.__qualname__}")
  assert not {k: v for k, v in exported.items() if len(v) > 1}
