"""bfloat16 params that train: `optim.compensated` (Kahan-compensated updates, moments
rounded stochastically) against float64 NumPy, across layouts, and end to end."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import runs
from tunix_core.checkpoints import resume
from tunix_core.checkpoints import store as checkpoint
from tunix_core.run import loop as train
from tunix_core.training import config as config_lib
from tunix_core.training import optim

BF16_ULP_AT_1 = 2.0 ** -7


def _run(tx, params, grads_fn, steps):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps):
    updates, state = update(grads_fn(t), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_uncompensated_bfloat16_updates_are_lost_and_compensated_ones_kept():
  """SGD at 1e-4 on weights near 1 (a step 1/78 of a bfloat16 ulp): plain optax leaves
  them unchanged after 300 steps; `compensated` ends within one rounding of float64's
  w - 300 * lr * g."""
  rng = np.random.default_rng(0)
  w0 = (1.0 + rng.uniform(0, 0.5, 64)).astype(jnp.bfloat16)
  g = rng.uniform(0.5, 1.5, 64).astype(np.float32)
  lr, steps = 1e-4, 300
  params = {"w": jnp.asarray(w0)}
  grads = lambda t: {"w": jnp.asarray(g, jnp.bfloat16)}
  lost, _ = _run(optax.sgd(lr), params, grads, steps)
  np.testing.assert_array_equal(np.asarray(lost["w"]), np.asarray(w0))  # every step lost
  want = np.asarray(w0, np.float64) - steps * lr * np.asarray(
      jnp.asarray(g, jnp.bfloat16), np.float64)
  for rounding, ulps in (("kahan_nearest", 0.5), ("kahan", 1.0)):
    tx, _ = optim.make_optimizer(optim.OptimizerConfig(
        optimizer="sgd", learning_rate=lr, param_dtype="bfloat16", param_rounding=rounding))
    kept, state = _run(tx, params, grads, steps)
    got = np.asarray(kept["w"], np.float64)
    assert kept["w"].dtype == jnp.bfloat16
    # One rounding to bfloat16 (to nearest: half an ulp of values in [1, 2)), no more.
    np.testing.assert_array_less(np.abs(got - want), ulps * BF16_ULP_AT_1 + 1e-9)
    assert np.abs(got - np.asarray(w0, np.float64)).min() > 0  # every weight moved
    # The master weight param + error is float32's (to float32 roundings of 300 steps).
    master = np.asarray(optim.join(kept["w"], state.error["w"], rounding == "kahan"))
    np.testing.assert_allclose(master, want, rtol=0, atol=300 * 2.0 ** -23 * 2)


def test_stochastic_param_rounding_follows_float64_on_average():
  """`--param_rounding=stochastic`: no error term, each update rounded up or down at
  random; over 4,096 weights the mean ends within a tenth of an ulp of float64 SGD's."""
  rng = np.random.default_rng(2)
  w0 = (1.0 + rng.uniform(0, 0.5, 4096)).astype(jnp.bfloat16)
  lr, steps = 1e-4, 200
  tx, _ = optim.make_optimizer(optim.OptimizerConfig(
      optimizer="sgd", learning_rate=lr, param_dtype="bfloat16", param_rounding="stochastic"))
  got, state = _run(tx, {"w": jnp.asarray(w0)}, lambda t: {"w": jnp.ones(4096, jnp.bfloat16)},
                    steps)
  assert state.error is None
  drift = np.asarray(got["w"], np.float64) - (np.asarray(w0, np.float64) - steps * lr)
  # Unbiased; each weight a random walk of 200 roundings, at most half an ulp apart each.
  assert abs(drift.mean()) < 0.1 * BF16_ULP_AT_1
  assert drift.std() < np.sqrt(steps) / 2 * BF16_ULP_AT_1


def _adam_f64(w, grads, lr, steps, b1=0.9, b2=0.999, eps=1e-8):
  m = v = np.zeros_like(w)
  for t in range(1, steps + 1):
    g = grads(t - 1)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    w = w - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
  return w


@pytest.mark.parametrize("optimizer_dtype,rounding,tol_ulps",
                         [("float32", "kahan_nearest", 0.5), ("bfloat16", "kahan", 3),
                          ("float8", "kahan", 3)])
def test_bfloat16_adamw_follows_float64_adam(optimizer_dtype, rounding, tol_ulps):
  """AdamW at 1e-4 over 400 steps of noisy gradients on bfloat16 weights: the params end
  within half a bfloat16 ulp of float64 Adam's with float32 moments, within a few ulps
  with the moments in bfloat16 or in 8 bits (their stochastic rounding is noise, not
  drift)."""
  rng = np.random.default_rng(1)
  n, steps, lr = 256, 400, 1e-4
  w0 = rng.uniform(1.0, 2.0, n).astype(jnp.bfloat16)
  noise = rng.normal(size=(steps, n)) * 0.3 + rng.uniform(0.2, 1.0, n)
  g_bf16 = np.asarray(jnp.asarray(noise, jnp.bfloat16), np.float64)
  tx, _ = optim.make_optimizer(optim.OptimizerConfig(
      learning_rate=lr, param_dtype="bfloat16", optimizer_dtype=optimizer_dtype,
      param_rounding=rounding))
  got, state = _run(tx, {"w": jnp.asarray(w0)},
                    lambda t: {"w": jnp.asarray(g_bf16[t], jnp.bfloat16)}, steps)
  mu = state.inner[0].mu["w"]
  assert (mu.codes.dtype == jnp.uint8 if optimizer_dtype == "float8"
          else mu.dtype == jnp.dtype(optimizer_dtype))
  want = _adam_f64(np.asarray(w0, np.float64), lambda t: g_bf16[t], lr, steps)
  moved = np.abs(want - np.asarray(w0, np.float64))
  assert moved.min() > 2 * BF16_ULP_AT_1  # uncompensated, all of it would be lost
  err = np.abs(np.asarray(got["w"], np.float64) - want)
  assert err.max() <= tol_ulps * BF16_ULP_AT_1 + 1e-9, err.max() / BF16_ULP_AT_1


def test_stochastic_rounding_lets_a_bfloat16_moment_decay():
  """Adam's second moment after a burst of large gradients: rounded to nearest in
  bfloat16 it never decays (each step's decrease, 1e-3 of it, is below half an ulp);
  rounded stochastically it tracks float64's EMA."""
  b2, v0, steps = 0.999, 1.0, 700
  want = v0 * b2 ** steps  # gradients 0 after the burst
  seeds = jnp.arange(steps, dtype=jnp.uint32)
  nearest = jnp.full((4096,), v0, jnp.bfloat16)
  stochastic = nearest

  @jax.jit
  def decay(nearest, stochastic, seed):
    return ((b2 * nearest.astype(jnp.float32)).astype(jnp.bfloat16),
            optim.stochastic_round(b2 * stochastic.astype(jnp.float32), jnp.bfloat16, seed))

  for s in seeds:
    nearest, stochastic = decay(nearest, stochastic, s)
  assert float(nearest.astype(jnp.float32).min()) == v0
  mean = float(np.mean(np.asarray(stochastic, np.float64)))
  assert abs(mean - want) <= 0.01 * want, (mean, want)


@pytest.mark.slow
def test_fsdp_on_8_equals_one_device_in_bfloat16(tmp_path):
  """bfloat16 params and moments (error term, params rounded to nearest): FSDP over 8
  devices and one device agree step by step
  (the error term and the moments cut with the params; sums in another order round
  differently, hence a bfloat16-sized tolerance)."""
  # Rounded to nearest: the default's random draws follow each piece's own indices.
  cfg = lambda out, **kw: runs.config(out, param_dtype="bfloat16",
                                      param_rounding="kahan_nearest", **kw)
  one = runs.step_run(runs.steps(cfg(tmp_path / "one"), jax.devices()[:1]),
                      cfg(tmp_path / "one"))
  eight = runs.step_run(runs.steps(cfg(tmp_path / "8", fsdp=True), jax.devices()),
                        cfg(tmp_path / "8", fsdp=True))
  runs.assert_agree(one, eight, tol=1e-2)
  assert runs.norm_rel_error(eight[1], one[1]) <= 2e-3


@pytest.mark.slow
def test_quickstart_in_bfloat16_reaches_float32s_eval_loss(tmp_path):
  """The quickstart at --learning_rate=1e-5 for 200 steps: bfloat16 params end within
  0.01 eval loss of float32's (uncompensated they stayed near ln 2)."""
  last = {}
  for dtype in ("float32", "bfloat16"):
    cfg = runs.quickstart_config(tmp_path / dtype, learning_rate=1e-5, steps=200,
                                 eval_every=200, save_every=0, param_dtype=dtype,
                                 compilation_cache_dir="")
    train.train(cfg, **runs.QUIET)
    last[dtype] = [r for r in runs.rows(tmp_path / dtype) if "eval/loss" in r][-1]["eval/loss"]
  assert last["float32"] < 0.6  # it trained at all
  assert abs(last["bfloat16"] - last["float32"]) <= 0.01, last


@pytest.mark.slow
def test_a_checkpoint_without_the_error_term_resumes_with_it_at_zero(tmp_path):
  """A bfloat16 run's step saved as before the error term existed (the inner optimizer's
  state alone, no --optimizer_dtype in its config) resumes with one line saying so, its
  params and moments as saved and the error term zero."""
  cfg = runs.config(tmp_path / "new", steps=2, save_every=2, param_dtype="bfloat16")
  state = train.train(cfg, **runs.QUIET)["state"]
  new = checkpoint.Checkpointer(str(tmp_path / "new" / "checkpoints"))
  meta = new.read_meta(2)
  new.close()
  steps = runs.steps(cfg, jax.devices())
  legacy = {"params": steps.logical_params(state["params"]),
            "opt_state": state["opt_state"].inner}
  meta["config"].pop("optimizer_dtype")
  meta["config"].pop("lr_schedule")  # nor --lr_schedule: its rate was constant
  meta["fingerprints"] = checkpoint.fingerprints(legacy)
  old = checkpoint.Checkpointer(str(tmp_path / "old" / "checkpoints"))
  old.save(2, legacy, meta)
  old.close()
  lines = []
  cfg_old = dataclasses.replace(cfg, output_dir=str(tmp_path / "old"), resume="required")
  restored = resume.restore_state(steps, checkpoint.Checkpointer(
      str(tmp_path / "old" / "checkpoints")), 2, meta)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored["opt_state"].inner),
               jax.device_get(state["opt_state"].inner))
  assert all(not np.asarray(e).any() for e in jax.tree.leaves(restored["opt_state"].error))
  with pytest.raises(config_lib.ConfigError, match="lr_schedule='constant' but this run has "
                     "lr_schedule='linear'"):
    train.train(dataclasses.replace(cfg_old, steps=3, lr_schedule="linear"), **runs.QUIET)
  out = train.train(dataclasses.replace(cfg_old, steps=3), log=lines.append)
  assert int(out["state"]["step"]) == 3
  said = [l for l in lines if "error term" in l]
  assert len(said) == 1 and "resumes at zero" in said[0], lines
