"""Installs beside Hugging Face's `kernels` (a dependency of transformers 5): our kernel
folder is the package `tunix_kernels`, so both import, installed (`pip install .`) or
editable (`pip install -e .`), from any directory.

A stand-in distribution owns the name `kernels` here, as HF's does beside transformers
(a package and its dist-info, which is what transformers' availability check reads), so
the test needs neither transformers nor a network."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")

# Run in a fresh interpreter outside the repository: which file each name resolves to.
_WHERE = """
import json, kernels, trainer, tunix_kernels, tunix_core.run.loop, tunix_core.training.step
assert kernels.OWNER == "stand-in", kernels.__file__
assert callable(tunix_kernels.fused_logprobs) and callable(tunix_kernels.dpo_loss)
print(json.dumps({m.__name__: m.__file__ for m in (tunix_kernels, tunix_core, trainer)}))
"""


def _stand_in(root) -> str:
  """A folder holding a package named `kernels` and its distribution metadata."""
  site = root / "standin"
  (site / "kernels").mkdir(parents=True)
  (site / "kernels" / "__init__.py").write_text('OWNER = "stand-in"\n')
  info = site / "kernels-0.12.0.dist-info"
  info.mkdir()
  (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.12.0\n")
  return str(site)


def _python(args, path, cwd, timeout=120, status=0, **env):
  proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                        timeout=timeout, env=dict(os.environ, PYTHONPATH=path, **env))
  assert proc.returncode == status, (proc.stdout + proc.stderr)[-3000:]
  return proc.stdout


def _where(path, cwd) -> dict:
  return json.loads(_python(["-c", _WHERE], path, cwd).splitlines()[-1])


@pytest.mark.slow  # builds the package and runs the trainer in subprocesses
def test_installed_beside_a_kernels_package_imports_and_trains(tmp_path):
  """`pip install .` (into a folder, with the stand-in beside it): both packages import,
  the CLIs start, and a 2-step run trains from a directory outside the repository."""
  src = tmp_path / "src"   # a copy, so pip's in-tree build writes nothing into the repo
  shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
      ".git", "tests", "docs", "data", "benchmarks", "build", "*.egg-info", "__pycache__"))
  site = tmp_path / "site"
  proc = subprocess.run(
      [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
       "--no-index", "--quiet", "--target", str(site), str(src)],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (site / "tunix_kernels" / "logprobs" / "pallas.py").is_file()  # the sub-packages too
  for op in ("attention", "logprobs"):  # its data
    assert (site / "tunix_kernels" / op / "tuned" / "v5e.json").is_file(), op
  assert not (site / "kernels").exists(), "the wheel must not own the name `kernels`"
  path = os.pathsep.join([_stand_in(tmp_path), str(site)])
  where = _where(path, tmp_path)
  assert all(f.startswith(str(site)) for f in where.values()), where

  assert "--max_new_tokens" in _python(["-m", "tunix_core.generate", "--helpfull"],
                                       path, tmp_path)
  help_text = _python(["-m", "trainer", "--helpfull"], path, tmp_path, status=1)  # absl's
  assert "--learning_rate: Peak learning rate" in help_text
  assert "(default: '1e-06')" in help_text.split("--learning_rate:")[1].split("--")[0]

  out = tmp_path / "run"
  _python(["-m", "trainer", f"--output_dir={out}", f"--train_data={TRAIN}", "--steps=2",
           "--batch_size=8", "--max_length=32", "--max_prompt_length=16", "--log_every=1"],
          path, tmp_path, timeout=300, JAX_PLATFORMS="cpu")
  with open(out / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_editable_install_beside_a_kernels_package(tmp_path):
  """This environment's own `pip install -e .`: from outside the repository, with the
  stand-in on the path, `tunix_kernels` is the repo's kernels/ folder and `kernels` the
  stand-in's."""
  # The installed distribution's record, not an egg-info a `python -m pytest` run
  # finds in the current directory.
  urls = [json.loads(d.read_text("direct_url.json") or "{}")
          for d in importlib.metadata.distributions() if d.metadata["Name"] == "tunix-core"]
  if not any(u.get("dir_info", {}).get("editable") for u in urls):
    pytest.skip("tunix-core is not installed editable (pip install -e .)")
  where = _where(_stand_in(tmp_path), tmp_path)
  assert where == {"tunix_kernels": os.path.join(REPO, "kernels", "__init__.py"),
                   "tunix_core": os.path.join(REPO, "tunix_core", "__init__.py"),
                   "trainer": os.path.join(REPO, "trainer.py")}
