"""The step functions: pinned golden metrics and no retracing in the training loop."""

import dataclasses
import json
import os

import chex
import jax
import numpy as np
import pytest

import runs
from tunix_core import data as data_lib
from tunix_core.run import compile_cache
from tunix_core.run import loop as train
from tunix_core.training import config as config_lib
from tunix_core.training import executables
from tunix_core.training.config import ConfigError
from tunix_core.training import plan as plan_lib
from tunix_core.training import fit
from tunix_core.training import step as step_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")
EVAL = os.path.join(REPO, "data", "eval.jsonl")

# Metrics of two train steps of the tiny preset on the first 8 shipped pairs (1 CPU
# device, float32, seed 0, AdamW lr 2e-3, in-step reference, plain rows), recorded per jax minor
# version with the release named. Within 1e-6 relative or 1e-5 absolute, not bit for bit:
# XLA:CPU compiles for the host's instruction set, so one release on two CPUs differs in
# the last bits (measured: 1.5e-6 absolute on the rewards, which are differences of
# ~50-nat log-probs, between an AVX-512 host and the one these were recorded on; 0.10
# and 0.12 themselves differ by ~2e-6).
# These must only change with an intended change of the numerics (model math, init,
# data encoding, loss, optimizer): then rerun this test, paste the values it prints
# and say why in the commit. A refactor that moves them has changed behaviour.
GOLDEN = {
    "0.10": ("0.10.2", [
        {"loss": 0.6931471824645996, "grad_norm": 1.000293493270874,
         "learning_rate": 0.0020000000949949026, "rewards/chosen": 0.0,
         "rewards/rejected": 0.0, "rewards/accuracies": 0.0, "rewards/margins": 0.0,
         "logps/chosen": -49.881309509277344, "logps/rejected": -50.75041198730469},
        {"loss": 0.2638869285583496, "grad_norm": 0.45967376232147217,
         "learning_rate": 0.0020000000949949026, "rewards/chosen": 0.9507220387458801,
         "rewards/rejected": -0.2842240631580353, "rewards/accuracies": 1.0,
         "rewards/margins": 1.2349460124969482, "logps/chosen": -40.374088287353516,
         "logps/rejected": -53.5926513671875},
    ]),
    "0.12": ("0.12.0.1", [
        {"loss": 0.6931471824645996, "grad_norm": 1.0002936124801636,
         "learning_rate": 0.0020000000949949026, "rewards/chosen": 0.0,
         "rewards/rejected": 0.0, "rewards/accuracies": 0.0, "rewards/margins": 0.0,
         "logps/chosen": -49.881317138671875, "logps/rejected": -50.75041198730469},
        {"loss": 0.26388680934906006, "grad_norm": 0.45967352390289307,
         "learning_rate": 0.0020000000949949026, "rewards/chosen": 0.9507232308387756,
         "rewards/rejected": -0.28422337770462036, "rewards/accuracies": 1.0,
         "rewards/margins": 1.2349467277526855, "logps/chosen": -40.374080657958984,
         "logps/rejected": -53.5926399230957},
    ]),
}
GOLDEN_KEYS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected",
               "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def _config(tmp_path, **kw):
  base = dict(output_dir=str(tmp_path), train_data=TRAIN, max_length=40, max_prompt_length=20,
              batch_size=8, steps=2, log_every=1, learning_rate=2e-3,
              lr_schedule="constant")  # as the golden metrics were pinned
  return config_lib.TrainConfig(**{**base, **kw})


def _two_steps(cfg):
  ds = data_lib.load_dataset(TRAIN, data_lib.ByteTokenizer(), cfg.max_length,
                             cfg.max_prompt_length)
  plan = plan_lib.make_plan(cfg, jax.devices()[:1], plan_lib.data_sizes(cfg, [ds]))
  steps = step_lib.make_steps(plan, jax.devices()[:1])
  batch = steps.put_batch(data_lib.take_pairs(ds, np.arange(8)))
  state = steps.init_state(jax.random.PRNGKey(cfg.seed))
  ref = jax.tree.map(lambda x: x.copy(), state["params"])
  rows = []
  for _ in range(2):
    state, metrics = steps.train_step(state, ref, batch)
    rows.append({k: float(metrics[k]) for k in GOLDEN_KEYS})
  return rows


@pytest.mark.slow  # 12 s; the trainer tests cover the step in the fast tier too
def test_golden_step_metrics(tmp_path):
  rows = _two_steps(_config(tmp_path, prefix_sharing=False))
  version = jax.__version__
  minor = ".".join(version.split(".")[:2])
  if minor not in GOLDEN:
    pytest.fail(f"no golden metrics pinned for jax {minor}; measured with {version}:\n"
                f"    {rows!r}")
  recorded_with, golden = GOLDEN[minor]
  tol = dict(rel=1e-6, abs=1e-5)
  for step, (got, want) in enumerate(zip(rows, golden), start=1):
    for key in GOLDEN_KEYS:
      assert got[key] == pytest.approx(want[key], **tol), (
          f"step {step} {key}: {got[key]!r} != pinned {want[key]!r} (jax {version}; "
          f"pinned with {recorded_with}). "
          "Update GOLDEN only for an intended numerical change (see its comment); "
          f"measured:\n    {rows!r}")


@pytest.mark.slow  # a whole (short) training run
def test_training_loop_never_retraces_a_step(tmp_path, monkeypatch, capsys):
  """Train and eval steps trace once per run: a retrace would be a silent recompile on
  every step on a TPU."""

  class CountingSteps(step_lib.StepFunctions):

    @chex.assert_max_traces(n=1)
    def _train_step(self, *args):
      return super()._train_step(*args)

    @chex.assert_max_traces(n=1)
    def _eval_step(self, *args):
      return super()._eval_step(*args)

  monkeypatch.setattr(step_lib, "StepFunctions", CountingSteps)
  eval_data = tmp_path / "eval.jsonl"
  with open(EVAL, encoding="utf-8") as f:
    eval_data.write_text("".join(f.readlines()[:16]))
  cfg = _config(tmp_path, steps=4, eval_data=str(eval_data), eval_every=2, save_every=2,
                max_length=24, max_prompt_length=12, sample_every=2,
                sample_max_new_tokens=4)
  result = train.train(cfg, log=lambda *_: None, devices=jax.devices()[:2])
  assert int(result["state"]["step"]) == 4 and "eval/loss" in result["eval"]
  # --sample_every wrote the first eval prompts' completions before step 1 and at 2 and 4.
  with open(tmp_path / "samples.jsonl", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  with open(EVAL, encoding="utf-8") as f:
    prompts = [json.loads(line)["prompt"] for line in f.readlines()[:4]]
  assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (0, 2, 4) for p in prompts]
  assert all(isinstance(r["completion"], str) for r in rows)
  # The saved step 4, through `python -m tunix_core.generate --output_dir`, says the same.
  from tunix_core.generate import __main__ as cli  # pylint: disable=g-import-not-at-top
  assert cli.main([f"--output_dir={tmp_path}", f"--prompt={prompts[0]}",
                   "--max_new_tokens=4"]) == 0
  line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert line["text"] == rows[-len(prompts)]["completion"]  # step 4, the first prompt


@pytest.mark.slow
def test_offload_remat_equals_full_remat_on_cpu(tmp_path):
  """`--remat=offload` (matmul outputs to pinned host memory, back for the backward) runs
  on CPU devices under FSDP and computes what `--remat=full` does."""
  cfg = runs.config(tmp_path, steps=3, fsdp=True, remat="full")
  full = runs.step_run(runs.steps(cfg, jax.devices()), cfg)
  cfg = dataclasses.replace(cfg, remat="offload")
  runs.assert_agree(runs.step_run(runs.steps(cfg, jax.devices()), cfg), full, tol=1e-6)


def test_drift_metrics_are_per_token_log_ratios_and_log_probs():
  """`objective.drift_metrics` against float64 NumPy on ragged masks."""
  from tunix_core.training import objective  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  logps, ref = rng.uniform(-4, 0, (2, 3, 2, 5))
  mask = (np.arange(5) < rng.integers(1, 6, (3, 2, 1))).astype(np.float64)
  got = objective.drift_metrics(*(jax.numpy.asarray(x, jax.numpy.float32)
                                  for x in (logps, ref, mask)))
  per_token = lambda x: ((x * mask).sum(-1) / mask.sum(-1)).mean(0)
  kl = per_token(logps - ref)
  np.testing.assert_allclose([got["kl/chosen"], got["kl/rejected"]], kl, rtol=1e-5)
  np.testing.assert_allclose(got["logps/chosen_per_token"], per_token(logps)[0], rtol=1e-5)
  assert set(objective.drift_metrics(logps, None, mask)) == {"logps/chosen_per_token"}


@pytest.mark.slow  # compiles the eval step for a padded last batch
def test_eval_counts_every_pair_of_a_set_that_is_not_a_multiple_of_the_batch(tmp_path):
  """10 eval pairs at --batch_size=4 (the last batch holds 2) give the means over all 10
  pairs: those of the same pairs at --batch_size=2, which needs no padding."""
  from tunix_core.run import evaluate  # pylint: disable=g-import-not-at-top
  full = runs.dataset(40, 20)
  ten = data_lib.PreferenceDataset(*(getattr(full, f)[:10] for f in (
      "tokens", "targets", "loss_mask", "attention_mask")), 0, 0, 0)
  devices = jax.devices()[:2]
  got = {}
  for B in (4, 2):
    steps = runs.steps(runs.config(tmp_path, batch_size=B), devices)
    params = steps.init_state(jax.random.PRNGKey(0))["params"]
    ref = steps.init_params(jax.random.PRNGKey(1))   # another model: rewards differ per pair
    got[B] = evaluate.evaluate(steps, params, ref, ten, None)
  assert got[4].keys() == got[2].keys() and abs(got[2]["eval/rewards/margins"]) > 1e-3
  for k, v in got[2].items():
    assert got[4][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.slow
def test_remat_auto_takes_the_cheapest_policy_that_fits(tmp_path):
  """`--remat=auto` (`training.fit`): none without a memory bound; with one, the first
  of none, dots, attention, full whose compiled step fits, by the compiler's own memory
  figures."""
  cfg = runs.config(tmp_path, batch_size=64, grad_accum_steps=1)
  devices = jax.devices()[:1]
  sizes = plan_lib.data_sizes(cfg, [runs.dataset(40, 20)])
  plan = plan_lib.make_plan(cfg, devices, sizes)
  steps = step_lib.make_steps(plan, devices)
  choose = lambda gib, log=lambda *_: None: fit.fit_steps(
      dataclasses.replace(cfg, device_memory_gib=gib), plan, steps, devices, sizes, log)
  assert cfg.remat == "auto" and choose(0).plan.model.remat == "none"
  need = {p: fit.compiled_bytes(executables.compile_step(step_lib.make_steps(
      plan_lib.make_plan(cfg, devices, sizes, fit=(p, 1)), devices), None), devices)
          for p in fit.POLICIES}
  # Activations dominate this step; `attention` drops the MLP's from what `dots` keeps.
  assert need["none"] > need["dots"] > need["attention"] > need["full"]
  lines = []
  for over, want in (("none", "dots"), ("dots", "attention")):
    gib = (need[over] - 1) / fit.MARGIN / 2**30
    assert choose(gib, lines.append).plan.model.remat == want
  with pytest.raises(ConfigError, match="fits no remat policy"):
    choose((need["full"] - 1) / fit.MARGIN / 2**30)
  # The run takes the chosen candidate's functions: its first step compiles nothing more.
  chosen = choose((need["none"] - 1) / fit.MARGIN / 2**30, lines.append)
  assert chosen.plan.model.remat == "dots", (lines, need)
  with compile_cache.FirstCompile() as first:  # as `run.compile_cache.Warmup` compiles it
    executables.compile_step(chosen, None)
  assert first.compiles == 0
