"""`--model_parallel` (tensor parallelism over a "model" mesh axis) in the trainer: TP and
FSDP x TP on a 4 x 2 mesh of 8 devices against ZeRO-1 on one device, the per-slice
`Stacked` layout against NumPy, restores from TP to no TP, and one-line config errors."""

import dataclasses

import jax
import numpy as np
import pytest

import runs
from tunix_core import model as model_lib
from tunix_core.parallel import collectives
from tunix_core.parallel import fsdp
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.parallel import tensor_parallel as tp
from tunix_core.parallel import zero
from tunix_core.run import loop as train
from tunix_core.training import config as config_lib

TINY_TP = model_lib.preset("tiny_tp")  # the tiny model, vocabulary 260 (splits 2 and 4 ways)


def _config(out, **kw):
  return runs.config(out, **{"steps": 3, "bucket_mb": 25.0, **kw})


def _tp_config(out, **kw):
  return _config(out, model="tiny_tp", **kw)


def _run(cfg, n, k):
  cfg = dataclasses.replace(cfg, model_parallel=k)
  return runs.step_run(runs.steps(cfg, jax.devices()[:n]), cfg)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(max_grad_norm=0.05),
                                dict(fsdp=True, sync_impl="ring", reference="precomputed",
                                     grad_accum_steps=2, batch_size=16)],
                         ids=["zero1-clipped", "fsdp-ring-precomputed-accum"])
def test_4x2_matches_one_device(tmp_path, kw):
  """Params and metrics of 3 steps on a ("data", "model") = 4 x 2 mesh equal ZeRO-1 on
  one device (no TP) within 1e-5: heads, kv-heads, MLP and vocabulary split 2 ways (the
  clipped run checks the global norm: split params summed over both axes, replicated
  ones counted once)."""
  one = {k: v for k, v in kw.items() if k not in ("fsdp", "sync_impl")}
  runs.assert_agree(_run(_tp_config(tmp_path, **kw), 8, 2), _run(_tp_config(tmp_path, **one), 1, 1))


@pytest.mark.slow
def test_stacked_layout_rows_are_each_slices_pieces():
  """Row i k + j of the stacked layout is piece i of model slice j (as NumPy slices
  the logical array), and `to_logical` inverts `to_pieces`."""
  k, n = 2, 3
  local = jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0),
                                                       tp.local_config(TINY_TP, k)))
  params = jax.tree.map(np.asarray, model_lib.init_params(jax.random.PRNGKey(1), TINY_TP))
  for inner in (fsdp.FsdpLayout(local, n), zero.Zero1Layout(collectives.BucketPlan.create(local, n))):
    layout = tp.Stacked(inner, model_lib.param_specs(TINY_TP, "model"), k)
    pieces = jax.device_get(layout.to_pieces(params))
    for j in range(k):
      want = jax.device_get(inner.to_pieces(_slice(params, j, k)))
      for i in range(n):
        np.testing.assert_array_equal(pieces["layers"]["wq"][i * k + j], want["layers"]["wq"][i])
        np.testing.assert_array_equal(pieces["final_norm"][i * k + j], want["final_norm"][i])
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(layout.to_logical(pieces)), params)


def _slice(params, j, k):
  """Model slice j of logical NumPy params, by `param_specs`' split dimensions."""
  dims = tp.split_dims(model_lib.param_specs(TINY_TP, "model"))
  return jax.tree.map(lambda x, d: x if d is None else np.split(x, k, axis=d)[j], params, dims,
                      is_leaf=lambda x: x is None)


@pytest.mark.slow
def test_restore_tp2_on_other_layouts(tmp_path):
  """A step saved under FSDP with --model_parallel=2 restores without TP (ZeRO-1 on 1
  device, FSDP on 4) and with TP under ZeRO-1, and verifies: the same logical params and
  Adam moments. (Checkpoints hold logical arrays, so the saving layout's other choice,
  ZeRO-1 with TP, writes the same thing.)"""
  cfg = _tp_config(tmp_path, fsdp=True, model_parallel=2, steps=2, save_every=2)
  ckpt, meta, want_params, want_mu = runs.train_and_save(cfg)
  assert meta["model_parallel"] == 2 and meta["num_shards"] == 4
  for n, k, to_fsdp in ((1, 1, False), (4, 1, True), (8, 2, False)):
    steps = runs.steps(_tp_config(tmp_path, fsdp=to_fsdp, model_parallel=k),
                       jax.devices()[:n])
    runs.restore_and_compare(steps, ckpt, 2, meta, want_params, want_mu)
  ckpt.close()


@pytest.mark.slow
def test_tp_run_resumes_without_tp_and_checks_replicas(tmp_path):
  """A --model_parallel=2 run (replicas checked per model slice) continued on one device
  logs the same losses as one device throughout."""
  train.train(_tp_config(tmp_path / "a", model_parallel=2, steps=2, save_every=2,
                         check_replicas_every=1), **runs.QUIET)
  train.train(_tp_config(tmp_path / "a", steps=4), devices=jax.devices()[:1], **runs.QUIET)
  train.train(_tp_config(tmp_path / "b", steps=4), devices=jax.devices()[:1], **runs.QUIET)
  a, b = runs.losses(tmp_path / "a"), runs.losses(tmp_path / "b")
  np.testing.assert_allclose([a[s] for s in range(1, 5)], [b[s] for s in range(1, 5)],
                             rtol=1e-5, atol=1e-5)


def test_bad_settings_are_one_line_errors(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="--model_parallel=3 does not divide the 8"):
    _tp_config(tmp_path, model_parallel=3).validate(8)
  with pytest.raises(config_lib.ConfigError, match="does not divide num_kv_heads=2"):
    _tp_config(tmp_path, model_parallel=4).validate(8)
  with pytest.raises(config_lib.ConfigError, match="does not divide vocab_size=259"):
    _config(tmp_path, model_parallel=2).validate(8)
  with pytest.raises(config_lib.ConfigError, match="4 data-parallel shards"):
    _tp_config(tmp_path, model_parallel=2, batch_size=6).validate(8)
  with pytest.raises(ValueError, match="does not divide the 8 devices"):
    mesh_lib.make_mesh(jax.devices(), 3)
  _tp_config(tmp_path, model_parallel=2, fsdp=True, batch_size=4).validate(8)
