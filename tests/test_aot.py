"""`--compile_only`: the train step compiled for a TPU slice ahead of time (needs
`libtpu`, skipped without it) or for the local devices, allocating nothing."""

import os
import shutil
import subprocess
import sys

import pytest

from kernels import tpu
from tunix_core import aot
from tunix_core import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")
needs_libtpu = pytest.mark.skipif(not tpu.has_libtpu(), reason="needs libtpu (.[tpu] extra)")


def _config(tmp_path, **kw):
  base = dict(output_dir=str(tmp_path), train_data=TRAIN, batch_size=8, max_length=64,
              max_prompt_length=32, compile_only=True)
  return config_lib.TrainConfig(**{**base, **kw})


@pytest.mark.slow
def test_local_compile_reports_memory_and_fits(tmp_path):
  lines = []
  assert aot.compile_only(_config(tmp_path), "local", log=lines.append) == 0
  assert "8 x cpu" in lines[0].lower()
  assert lines[1].startswith("per device: arguments") and lines[-1] == "fits"
  assert not os.listdir(tmp_path)  # no checkpoints, caches or metrics: nothing ran


@pytest.mark.slow  # AOT TPU compiles live in the slow tier
@needs_libtpu
def test_tpu_slice_from_an_hf_config_alone_validated_for_the_target(tmp_path):
  # Only config.json: a step that compiles proves no weights were read.
  model_dir = tmp_path / "model"
  model_dir.mkdir()
  shutil.copy(os.path.join(REPO, "tests", "fixtures", "hf", "gemma2", "config.json"),
              model_dir)
  lines = []
  cfg = _config(tmp_path / "out", hf_model_dir=str(model_dir), compute_dtype="bfloat16")
  assert aot.compile_only(cfg, "v5e-8", log=lines.append) == 0
  assert "8 x TPU v5 lite" in lines[0] and "of 16.00 GiB HBM" in lines[2]
  # Checked against the slice's 8 devices, not this host's.
  with pytest.raises(config_lib.ConfigError, match="not divisible by the 4 devices"):
    aot.compile_only(_config(tmp_path, batch_size=6), "v4-8", log=lines.append)


@pytest.mark.slow
@needs_libtpu
def test_7b_does_not_fit_a_v5e_8_without_sharded_params(tmp_path):
  # The trainer's exit status and the compiler's own message, through the CLI.
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "trainer.py"), "--model=7b", "--compile_only",
       "--target_topology=v5e-8", "--batch_size=8", "--max_length=1024",
       "--max_prompt_length=512", "--compute_dtype=bfloat16", "--remat=full",
       "--precompute_ref_logps", f"--train_data={TRAIN}", f"--output_dir={tmp_path}"],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
  assert "exceeds available HBM" in proc.stdout, proc.stdout
  assert "6,738,415,616 params" in proc.stdout
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))
  assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
@needs_libtpu
def test_fit_is_judged_on_what_the_buffer_assignment_allocates(tmp_path):
  """The fit check uses the HBM bytes the TPU compiler's buffer assignment allocates (its
  XLA dump: the arguments, outputs and one preallocated block of temporaries), never
  less than the buffers the caller holds through the step (arguments, outputs not
  donated)."""
  stats = aot.compile_stats(_config(tmp_path, fsdp=True), "v5e-8")
  assert stats["error"] is None and stats["hbm"] is not None
  held = stats["argument"] + stats["output"] - stats["alias"]
  assert 0 < held < stats["hbm"] == stats["need"]
  lines = []
  assert aot.compile_only(_config(tmp_path, fsdp=True), "v5e-8", log=lines.append) == 0
  assert lines[2].startswith(f"total {aot._gib(stats['hbm'])} of 16.00 GiB HBM "
                             "(allocated by the compiler's buffer assignment; ")
  assert not os.listdir(tmp_path)  # the dump went to a temporary directory
