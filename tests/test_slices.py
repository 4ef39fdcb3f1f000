"""Several TPU slices, simulated on 8 CPU devices as 2 slices of 4: a "slice" axis in front
of "data", gradients reduce-scattered within a slice and all-reduced across slices once
per step; the result equals one device's, no per-layer collective crosses the slices,
and checkpoints move between slice counts."""

import dataclasses

import jax
import pytest

import runs
from tunix_core.aot import comms
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.training import config as config_lib


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  cfg = runs.config(tmp_path_factory.mktemp("one"), steps=5)
  return runs.step_run(runs.steps(cfg, jax.devices()[:1]), cfg, 5)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(fsdp=True)])
def test_two_slices_of_four_equal_one_device_over_five_steps(tmp_path, one_device, kw):
  cfg = runs.config(tmp_path, steps=5, num_slices=2, **kw)
  steps = runs.steps(cfg, jax.devices())
  assert dict(steps.mesh.shape) == {"slice": 2, "data": 4}
  # Without the mean across slices each slice would step on its own half of the batch.
  runs.assert_agree(runs.step_run(steps, cfg, 5), one_device)


@pytest.mark.slow  # compiles the multi-slice FSDP step
def test_multi_slice_step_has_no_per_layer_collective_on_the_slice_axis(tmp_path):
  cfg = runs.config(tmp_path, num_slices=2, fsdp=True, reference="precomputed")
  steps = runs.steps(cfg, jax.devices())
  text = steps.train_step.lower(*steps.abstract_inputs()).compile().as_text()
  ops = comms.ops(text, dict(steps.mesh.shape))
  in_loop = [o for o in ops if o["in_loop"]]
  # The layer scans gather (forward, backward) and reduce-scatter within a slice only.
  assert {o["axes"] for o in in_loop} == {("data",)}
  assert {o["op"] for o in in_loop} == {"all-gather", "reduce-scatter"}
  across = [o for o in ops if "slice" in o["axes"]]
  assert across and not any(o["in_loop"] for o in across)
  # Once per step, each device all-reduces its own f32 gradient pieces (1/4 of the model)
  # with the other slice: 2 S (n - 1) / n = S bytes; metrics and norms add a few scalars.
  local = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(steps.abstract_params())) / 4
  sent = sum(o["bytes"] * o["times"] for o in across)
  assert local <= sent <= local + 256, (sent, local)


@pytest.mark.slow
def test_checkpoints_move_between_slice_counts(tmp_path):
  cfg = runs.config(tmp_path, fsdp=True, steps=2, save_every=2, num_slices=2)
  ckpt, meta, want_params, want_mu = runs.train_and_save(cfg)
  assert meta["num_shards"] == 4  # the rows of one slice; the other slice holds a copy
  for n, kw in ((4, dict(num_slices=1)), (1, dict(num_slices=1, fsdp=False)),
                (8, dict(num_slices=2, fsdp=False))):
    steps = runs.steps(dataclasses.replace(cfg, **kw), jax.devices()[:n])
    runs.restore_and_compare(steps, ckpt, 2, meta, want_params, want_mu)
  ckpt.close()


def test_bad_slice_counts_are_one_line_errors(tmp_path):
  with pytest.raises(config_lib.ConfigError, match="--num_slices=3 does not divide the 8"):
    runs.config(tmp_path, num_slices=3).validate(8)
  with pytest.raises(config_lib.ConfigError, match="--num_slices=-1"):
    runs.config(tmp_path, num_slices=-1).validate(8)
  with pytest.raises(ValueError, match="--num_slices=2 does not divide the 3 devices"):
    mesh_lib.resolve_slices(jax.devices()[:3], 2)
  assert mesh_lib.resolve_slices(jax.devices(), 0) == 1  # CPU devices: one slice
