"""The small trainer runs the checkpoint, fault-injection and sharding tests share, their
output, and how two runs are compared."""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from tunix_core import data as data_lib
from tunix_core.checkpoints import resume
from tunix_core.checkpoints import store as checkpoint
from tunix_core.run import loop as train
from tunix_core.storage import paths
from tunix_core.training import config as config_lib
from tunix_core.training import plan as plan_lib
from tunix_core.training import step as step_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")
QUIET = dict(log=lambda *_: None)


def config(out, **overrides) -> config_lib.TrainConfig:
  """6 steps of 8 pairs of 40 tokens, a metrics row every step, small gradient buckets,
  a constant learning rate (a run resumed with more --steps then equals a straight one)."""
  base = dict(output_dir=str(out), train_data=TRAIN, max_length=40, max_prompt_length=20,
              batch_size=8, steps=6, log_every=1, learning_rate=2e-3, bucket_mb=0.25,
              lr_schedule="constant")
  return config_lib.TrainConfig(**{**base, **overrides})


def quickstart_config(out, **kw) -> config_lib.TrainConfig:
  """configs/quickstart.flags as a TrainConfig, with `kw` on top."""
  values = {}
  fields = {f.name: f.type for f in dataclasses.fields(config_lib.TrainConfig)}
  with open(f"{REPO}/configs/quickstart.flags") as f:
    for line in f:
      if line.startswith("--"):
        name, value = line.strip()[2:].split("=", 1)
        kind = fields[name]
        values[name] = ({"bool": lambda v: v == "true", "int": int, "float": float}
                        .get(kind if isinstance(kind, str) else kind.__name__, str)(value))
  values.update(train_data=f"{REPO}/data/train.jsonl",
                eval_data=f"{REPO}/data/eval.jsonl")
  return config_lib.TrainConfig(**{**values, "output_dir": str(out), **kw})


def rows(out) -> list[dict]:
  """The rows of `{out}/metrics.jsonl` (local or `gs://`)."""
  text = paths.read_text(paths.join(str(out), "metrics.jsonl"))
  return [json.loads(line) for line in text.splitlines()]


def losses(out) -> dict:
  """`{step: loss}` of the train rows in `{out}/metrics.jsonl`."""
  return {r["step"]: r["loss"] for r in rows(out) if "loss" in r}


@functools.lru_cache(maxsize=None)
def dataset(max_length: int, max_prompt_length: int) -> data_lib.PreferenceDataset:
  """`TRAIN` encoded with the byte tokenizer (once per shape)."""
  return data_lib.load_dataset(TRAIN, data_lib.ByteTokenizer(), max_length, max_prompt_length)


def steps(cfg, devices, **plan_kw) -> step_lib.StepFunctions:
  """The step functions of `cfg` on `devices`, planned for `TRAIN` as the trainer plans
  for its data (`plan_kw` go to `plan.make_plan`)."""
  sizes = plan_lib.data_sizes(cfg, [dataset(cfg.max_length, cfg.max_prompt_length)])
  return step_lib.make_steps(plan_lib.make_plan(cfg, devices, sizes, **plan_kw), devices)


def step_run(steps, cfg, num_steps=3):
  """`(metrics of each step, final logical params)` of `num_steps` train steps of `steps`
  (a `step.StepFunctions` for `cfg`) on the first pairs of `TRAIN`, in-step or
  precomputed reference as `cfg` says; asserts the frozen input (the reference params,
  or LoRA's base) is bit-identical afterwards."""
  ds = dataset(cfg.max_length, cfg.max_prompt_length)
  state = steps.init_state(jax.random.PRNGKey(0))
  if steps.plan.lora is not None:  # the frozen base (the reference: adapters off)
    ref = {"base": steps.init_base(jax.random.PRNGKey(0))}
  else:
    ref = jax.tree.map(lambda x: jnp.array(x, copy=True), state["params"])
  frozen = ref if cfg.reference == "step" or steps.plan.lora is not None else None
  frozen_before = jax.device_get(frozen)
  out = []
  for i in range(num_steps):
    B = cfg.batch_size
    batch = steps.put_batch(data_lib.take_pairs(ds, np.arange(B * i, B * (i + 1))))
    if cfg.reference == "precomputed":
      batch["ref_logps"] = steps.ref_logps(ref, batch)
    state, metrics = steps.train_step(state, frozen, batch)
    out.append({k: float(v) for k, v in metrics.items() if k != "nonfinite"})
  # Only the trained params change: the reference (LoRA: the base) keeps its bytes.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(frozen), frozen_before)
  return out, jax.device_get(steps.logical_params(state["params"]))


def norm_rel_error(got, want) -> float:
  """||got - want|| / ||want|| over a whole tree. Params are compared this way: Adam
  divides each element's step by its own gradient scale, so where a gradient is ~0 its
  rounding (summation order differs with the device count) moves that element by up
  to the learning rate."""
  sq = lambda t: sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in t)
  diff = jax.tree.leaves(jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, got, want))
  return (sq(diff) / sq(jax.tree.leaves(want))) ** 0.5


def assert_agree(a, b, tol=1e-5):
  """Two `step_run` results: every metric of every step within `tol` (relative above 1),
  the final params within `tol` in relative norm."""
  (rows_a, params_a), (rows_b, params_b) = a, b
  for ra, rb in zip(rows_a, rows_b):
    for k in ra:
      assert abs(ra[k] - rb[k]) <= tol * max(1.0, abs(ra[k])), (k, ra[k], rb[k])
  assert norm_rel_error(params_a, params_b) <= tol


def train_and_save(cfg) -> tuple:
  """Trains `cfg` on all devices (its last step saved) and returns `(checkpointer, that
  step's metadata, the saved logical params, Adam's saved logical mu)` for
  `restore_and_compare`; the caller closes the checkpointer."""
  saved = train.train(cfg, **QUIET)["state"]
  steps_all = steps(cfg, jax.devices())
  want_params = jax.device_get(steps_all.logical_params(saved["params"]))
  want_mu = jax.device_get(steps_all.layout.cut.to_logical(saved["opt_state"][0].mu))
  ckpt = checkpoint.Checkpointer(os.path.join(str(cfg.output_dir), "checkpoints"))
  return ckpt, ckpt.read_meta(cfg.steps), want_params, want_mu


def restore_and_compare(steps, ckpt, step, meta, want_params, want_mu) -> dict:
  """Restores `step` into `steps`' layout and asserts it verifies against the saved
  fingerprints and holds exactly `want_params` and Adam's `want_mu` (logical arrays);
  returns the restored state."""
  state = resume.restore_state(steps, ckpt, step, meta)
  assert resume.verify(steps, state, meta)[1] == []
  jax.tree.map(np.testing.assert_array_equal,
               jax.device_get(steps.logical_params(state["params"])), want_params)
  mu = jax.device_get(steps.layout.cut.to_logical(state["opt_state"][0].mu))
  jax.tree.map(np.testing.assert_array_equal, mu, want_mu)
  return state
