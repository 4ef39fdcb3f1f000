"""End-to-end trainer runs on 8 simulated CPU devices."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tunix_core import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")
EVAL = os.path.join(REPO, "data", "eval.jsonl")


def _rows(output_dir):
  with open(os.path.join(output_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _config(tmp_path, **kw):
  base = dict(output_dir=str(tmp_path), train_data=TRAIN, max_length=40, max_prompt_length=20,
              batch_size=8, steps=6, log_every=1, learning_rate=2e-3)
  return train.TrainConfig(**{**base, **kw})


def test_flagfile_run_on_8_devices_loss_falls_from_ln2(tmp_path):
  flagfile = tmp_path / "run.flags"
  flagfile.write_text("\n".join([
      f"--output_dir={tmp_path / 'out'}", f"--train_data={TRAIN}", f"--eval_data={EVAL}",
      "--max_length=40", "--max_prompt_length=20", "--batch_size=16", "--steps=10",
      "--log_every=1", "--eval_every=10", "--learning_rate=2e-3", "--warmup_steps=2"]) + "\n")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(REPO, "trainer.py"),
                         f"--flagfile={flagfile}"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "on 8 cpu device(s)" in proc.stdout
  rows = _rows(tmp_path / "out")
  train_rows = [r for r in rows if "loss" in r]
  eval_rows = [r for r in rows if "eval/loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, 11))
  assert train_rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
  assert train_rows[0]["learning_rate"] == 0.0 and train_rows[1]["learning_rate"] > 0
  assert np.mean([r["loss"] for r in train_rows[-3:]]) < math.log(2) - 0.05
  for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected", "grad_norm", "learning_rate", "tokens_per_sec"):
    assert key in train_rows[-1]
  assert len(eval_rows) == 1 and eval_rows[0]["step"] == 10
  assert "eval/rewards/accuracies" in eval_rows[0]


def test_precomputed_reference_matches_in_step_reference(tmp_path):
  a = train.train(_config(tmp_path / "a"), log=lambda *_: None)
  b = train.train(_config(tmp_path / "b", precompute_ref_logps=True), log=lambda *_: None)
  la = [r["loss"] for r in _rows(tmp_path / "a")]
  lb = [r["loss"] for r in _rows(tmp_path / "b")]
  np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-6)
  cache = os.listdir(tmp_path / "b" / "ref_cache")
  assert len(cache) == 1 and cache[0].startswith("ref_logps_")
  # A second run reuses the cache file (same data, same initial params).
  train.train(_config(tmp_path / "b", precompute_ref_logps=True, steps=1), log=lambda *_: None)
  assert os.listdir(tmp_path / "b" / "ref_cache") == cache
  chex_params = [a["state"]["params"], b["state"]["params"]]
  for x, y in zip(*map(jax.tree.leaves, chex_params)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("override,message", [
    (dict(loss_type="kto"), "--loss_type='kto' is unknown"),
    (dict(batch_size=12), "--batch_size=12 is not divisible by the 8 devices"),
    (dict(train_data="/nonexistent.jsonl"), "--train_data='/nonexistent.jsonl': no such file"),
    (dict(max_prompt_length=40), "--max_prompt_length=40 must be positive and less than "
                                 "--max_length=40"),
    (dict(model="huge"), "--model='huge' is not a preset"),
])
def test_bad_config_is_rejected(tmp_path, override, message):
  with pytest.raises(train.ConfigError, match=message.replace("[", r"\[")):
    _config(tmp_path, **override).validate(num_devices=8)


def test_bad_flag_prints_one_error_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(REPO, "trainer.py"),
                         f"--output_dir={tmp_path}", f"--train_data={TRAIN}",
                         "--loss_type=kto"], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 1
  errors = [l for l in proc.stderr.splitlines() if "error" in l.lower()]
  assert errors == ["trainer.py: error: --loss_type='kto' is unknown; choose one of "
                    "('sigmoid', 'ipo', 'hinge', 'robust')"]
