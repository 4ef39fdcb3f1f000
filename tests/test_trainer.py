"""End-to-end trainer runs on 8 simulated CPU devices."""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunix_kernels
import runs
from tunix_core import data as data_lib
from tunix_core.run import loop as train
from tunix_core.training import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")
EVAL = os.path.join(REPO, "data", "eval.jsonl")


def _rows(output_dir):
  with open(os.path.join(output_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _config(tmp_path, **kw):
  base = dict(output_dir=str(tmp_path), train_data=TRAIN, max_length=40, max_prompt_length=20,
              batch_size=8, steps=6, log_every=1, learning_rate=2e-3)
  return config_lib.TrainConfig(**{**base, **kw})


@pytest.mark.slow
def test_flagfile_run_on_8_devices_loss_falls_from_ln2(tmp_path):
  # 512 train and 64 eval pairs: the precomputed reference pass over both is 36 batches,
  # not 288; the 10 steps read 160 pairs either way.
  train_data, eval_data = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
  for path, src, n in ((train_data, TRAIN, 512), (eval_data, EVAL, 64)):
    with open(src) as f:
      path.write_text("".join(f.readlines()[:n]))
  flagfile = tmp_path / "run.flags"
  flagfile.write_text("\n".join([
      f"--output_dir={tmp_path / 'out'}", f"--train_data={train_data}",
      f"--eval_data={eval_data}",
      "--max_length=40", "--max_prompt_length=20", "--batch_size=16", "--steps=10",
      "--log_every=1", "--eval_every=10", "--learning_rate=2e-3", "--warmup_ratio=0.15",
      "--lr_schedule=cosine",
      "--reference=precomputed", f"--compilation_cache_dir={flagfile}/cache"]) + "\n")
  # A TPU environment naming one worker is a job of one process, with one notice line.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", TPU_WORKER_HOSTNAMES="localhost")
  proc = subprocess.run([sys.executable, os.path.join(REPO, "trainer.py"),
                         f"--flagfile={flagfile}"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "on 8 cpu device(s) in 1 process(es)" in proc.stdout
  assert "distributed: TPU_WORKER_HOSTNAMES names one worker: one process" in proc.stdout
  # A cache directory that cannot be made: one line, and the run goes on uncached.
  assert f"compilation cache: {flagfile}/cache is not writable" in proc.stdout
  assert "step 1: compiled in " in proc.stdout and "(no compilation cache)" in proc.stdout
  assert "again at its first call" not in proc.stdout  # compiled once, beside the start-up
  # The flagfile's reference mode holds; the default run saves its last step.
  assert "reference: precomputed" in proc.stdout
  assert os.listdir(tmp_path / "out" / "checkpoints") == ["10"]
  rows = _rows(tmp_path / "out")
  train_rows = [r for r in rows if "loss" in r]
  eval_rows = [r for r in rows if "eval/loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, 11))
  assert train_rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
  # Warmup ceil(0.15 * 10) = 2 steps, then a half cosine over the 8 left (the rate a
  # step used, as transformers' get_scheduler("cosine") gives it).
  want = [0, 1e-3] + [1e-3 * (1 + math.cos(math.pi * k / 8)) for k in range(8)]
  np.testing.assert_allclose([r["learning_rate"] for r in train_rows], want, rtol=1e-5)
  assert np.mean([r["loss"] for r in train_rows[-3:]]) < math.log(2) - 0.05
  for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
              "logps/chosen", "logps/rejected", "grad_norm", "learning_rate", "tokens_per_sec"):
    assert key in train_rows[-1]
  assert len(eval_rows) == 1 and eval_rows[0]["step"] == 10
  assert "eval/rewards/accuracies" in eval_rows[0]
  # Drift (values: test_step): the policy moved off the reference; log-probs are negative.
  assert eval_rows[0]["eval/kl/chosen"] != 0 and eval_rows[0]["eval/kl/rejected"] != 0
  assert eval_rows[0]["eval/logps/chosen_per_token"] < 0
  assert "kl/chosen" not in train_rows[-1]  # evaluation only


@pytest.mark.slow
def test_precomputed_reference_matches_in_step_reference(tmp_path):
  # 512 of the 4,096 pairs: b's reference pass over the whole set is then 64 batches,
  # not 512; the 6 steps read 48 pairs either way.
  data = tmp_path / "pairs.jsonl"
  with open(TRAIN) as f:
    data.write_text("".join(f.readlines()[:512]))
  config = functools.partial(_config, train_data=str(data))
  a = train.train(config(tmp_path / "a"), log=lambda *_: None)
  b = train.train(config(tmp_path / "b", reference="precomputed"), log=lambda *_: None)
  la = [r["loss"] for r in _rows(tmp_path / "a")]
  lb = [r["loss"] for r in _rows(tmp_path / "b")]
  np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-6)
  cache = sorted(os.listdir(tmp_path / "b" / "data_cache"))
  assert len(cache) == 2 and cache[0].startswith("pairs-") and cache[1].startswith(
      "ref_logps_")
  # A second run reuses the stores and the cache files (same data, same initial params).
  train.train(config(tmp_path / "b", reference="precomputed", steps=1), log=lambda *_: None)
  assert sorted(os.listdir(tmp_path / "b" / "data_cache")) == cache
  chex_params = [a["state"]["params"], b["state"]["params"]]
  for x, y in zip(*map(jax.tree.leaves, chex_params)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)


def test_every_config_field_is_a_flag_with_its_help_and_no_other_run_flag():
  import trainer  # pylint: disable=g-import-not-at-top  (defines the flags)
  f = trainer.flags.FLAGS
  helpfull = f.get_help()  # what --helpfull prints
  squeezed = "".join(helpfull.split())  # absl wraps lines (also at hyphens)
  for field in dataclasses.fields(config_lib.TrainConfig):
    assert f"--{field.name}:" in helpfull or f"--[no]{field.name}:" in helpfull
    assert "".join(field.metadata["help"].split()) in squeezed, field.name
  assert "precompute_ref_logps" not in f and "reference_free" not in f  # no alias left
  try:
    f.unparse_flags()
    f(["trainer.py", "--output_dir=/tmp/x", "--reference=precomputed"])
    assert trainer.config_from_flags().reference == "precomputed"
  finally:
    f.unparse_flags()


@pytest.mark.parametrize("override,message", [
    (dict(loss_type="sigmoid,kto"), "--loss_type='sigmoid,kto': unknown loss_type 'kto'"),
    (dict(batch_size=12), "--batch_size=12 is not divisible by the 8 devices"),
    (dict(train_data="/nonexistent.jsonl"), "--train_data='/nonexistent.jsonl': no such data file"),
    (dict(max_prompt_length=40), "--max_prompt_length=40 must be positive and less than "
                                 "--max_length=40"),
    (dict(model="huge"), "--model='huge' is not a preset"),
    (dict(online_data_chosen=True), "--online_data_chosen needs --online_samples"),
])
def test_bad_config_is_rejected(tmp_path, override, message):
  with pytest.raises(config_lib.ConfigError, match=message.replace("[", r"\[")):
    _config(tmp_path, **override).validate(num_devices=8)


@pytest.mark.slow
def test_bad_flag_prints_one_error_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(REPO, "trainer.py"),
                         f"--output_dir={tmp_path}", f"--train_data={TRAIN}",
                         "--loss_type=kto"], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 1
  errors = [l for l in proc.stderr.splitlines() if "error" in l.lower()]
  assert errors == ["trainer.py: error: --loss_type='kto': unknown loss_type 'kto'; choose "
                    "from " + ", ".join(tunix_kernels.LOSS_TYPES)]


def _losses(rows):
  return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow  # the ring's sync against one device: test_model_parallel's FSDP case
def test_8_devices_match_1_device(tmp_path):
  cfg = _config(tmp_path / "eight", steps=10, sync_impl="xla", bucket_mb=0.25)
  train.train(cfg, log=lambda *_: None)
  one = dataclasses.replace(cfg, output_dir=str(tmp_path / "one"))
  train.train(one, log=lambda *_: None, devices=jax.devices()[:1])
  np.testing.assert_allclose(_losses(_rows(tmp_path / "eight")), _losses(_rows(tmp_path / "one")),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_grad_accumulation_equals_one_big_batch(tmp_path):
  batch = data_lib.take_pairs(
      data_lib.load_dataset(TRAIN, data_lib.ByteTokenizer(), 40, 20), np.arange(8))
  params = []
  for accum in (1, 8):
    # Plain SGD, so the params after one step show the gradient itself.
    cfg = _config(tmp_path, grad_accum_steps=accum, max_grad_norm=0.0, optimizer="sgd",
                  learning_rate=1.0)
    trainer = runs.steps(cfg, jax.devices()[:1])
    state = trainer.init_state(jax.random.PRNGKey(0))
    ref = jax.tree.map(jnp.copy, state["params"])
    state, metrics = trainer.train_step(state, ref, trainer.put_batch(batch))
    params.append(state["params"])
  chex.assert_trees_all_close(params[0], params[1], rtol=1e-5, atol=1e-6)


def test_optimizer_state_is_sharded_one_eighth(tmp_path):
  trainer = runs.steps(_config(tmp_path), jax.devices())
  state = trainer.init_state(jax.random.PRNGKey(0))
  mu = state["opt_state"][0].mu["layers"]["wq"]  # adamw's first moment of one leaf
  full = state["params"]["layers"]["wq"].size
  assert mu.shape == (8, full // 8)
  assert {s.data.shape for s in mu.addressable_shards} == {(1, full // 8)}


def test_diverged_replicas_are_detected(tmp_path):
  devices = jax.devices()
  trainer = runs.steps(_config(tmp_path), devices)
  params = trainer.init_state(jax.random.PRNGKey(0))["params"]
  trainer.check_replicas(params)  # identical copies pass

  def corrupt(x):
    copies = [jax.device_put(np.asarray(x) + (i == 3), d) for i, d in enumerate(devices)]
    return jax.make_array_from_single_device_arrays(x.shape, trainer.replicated, copies)

  bad = dict(params, final_norm=corrupt(params["final_norm"]))
  with pytest.raises(RuntimeError, match="replicas diverged"):
    trainer.check_replicas(bad)


def test_reference_cache_key_follows_every_bit_of_the_reference(tmp_path):
  from tunix_core import model as model_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.run import ref_cache  # pylint: disable=g-import-not-at-top
  pairs = data_lib.build_store(TRAIN, data_lib.ByteTokenizer(), str(tmp_path / "s"), 40, 20)
  params = model_lib.init_params(jax.random.PRNGKey(0), model_lib.preset("tiny"))
  key = ref_cache.cache_key(pairs, params, "model")
  assert ref_cache.cache_key(pairs, jax.tree.map(jnp.copy, params), "model") == key
  assert ref_cache.cache_key(pairs, params, "another model") != key
  w = params["layers"]["wq"]
  nudged = dict(params, layers=dict(params["layers"], wq=w.at[1, 3, 5].set(
      jnp.nextafter(w[1, 3, 5], jnp.inf))))  # one ulp of one element
  assert ref_cache.cache_key(pairs, nudged, "model") != key
