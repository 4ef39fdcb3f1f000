"""`--head_on_scored` (`tunix_core.scored`): the scored block against NumPy, and log-probs,
their gradients and train steps with the block equal to whole rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import kernels
import runs
from oracles import rel_error
from tunix_core import data as data_lib
from tunix_core import model as model_lib
from tunix_core import objective
from tunix_core import scored
from tunix_core import step as step_lib

IGNORE = kernels.IGNORE_INDEX


def test_max_span_and_block_size_by_hand():
  mask = np.zeros((3, 2, 10), np.int32)
  mask[0, 0, 4:7] = 1   # span 3
  mask[1, 1, 2:9] = 1   # span 7
  mask[2, 0, 9] = 1     # span 1 at the last position
  assert scored.max_span(mask) == 7
  assert scored.max_span(np.zeros((2, 5))) == 0
  assert scored.block_size(7, 1000) == 16 and scored.block_size(17, 1000) == 32
  assert scored.block_size(40, 24) == 24  # never more than the row
  with pytest.raises(ValueError, match="scored span of 7 positions but the step was compiled "
                                       "for 6"):
    scored.check_batch(mask, 6)
  scored.check_batch(mask, 7)


def test_window_takes_each_rows_block_from_its_first_scored_position():
  T, S = 10, 4
  targets = np.full((3, T), IGNORE, np.int32)
  targets[0, 3:5] = [7, 8]        # block 3..6
  targets[1, 8:10] = [1, 2]       # would run past the row: moved back to 6..9
  hidden = np.arange(3 * T * 2, dtype=np.float32).reshape(3, T, 2)
  h, t, pos = jax.device_get(scored.window(jnp.asarray(hidden), jnp.asarray(targets), S, IGNORE))
  np.testing.assert_array_equal(pos, [[3, 4, 5, 6], [6, 7, 8, 9], [0, 1, 2, 3]])
  for r in range(3):
    np.testing.assert_array_equal(h[r], hidden[r, pos[r]])
    np.testing.assert_array_equal(t[r], targets[r, pos[r]])
  back = jax.device_get(scored.unwindow(jnp.asarray(t, jnp.float32), jnp.asarray(pos), T))
  want = np.zeros((3, T), np.float32)
  for r in range(3):
    want[r, pos[r]] = t[r]
  np.testing.assert_array_equal(back, want)


GEMMA = dataclasses.replace(model_lib.preset("tiny"), final_softcap=5.0, post_norms=True,
                            norm_offset=1.0, tie_embeddings=True)


@pytest.mark.parametrize("mcfg", [pytest.param(model_lib.preset("tiny"), marks=pytest.mark.slow),
                                  GEMMA], ids=["llama", "gemma"])
def test_logprobs_and_gradients_equal_whole_rows(mcfg):
  ds = data_lib.load_dataset(runs.TRAIN, data_lib.ByteTokenizer(), 48, 24)
  batch = jax.tree.map(jnp.asarray, data_lib.take_pairs(ds, np.arange(4)))
  size = scored.block_size(scored.max_span(ds.loss_mask[:4]), 48)
  assert size < 48  # the block really cuts something
  params = model_lib.init_params(jax.random.PRNGKey(0), mcfg)

  def total(params, size):
    logps = objective.sequence_logps(params, batch, mcfg, "xla", scored_size=size)
    return jnp.sum(logps * jnp.arange(logps.size).reshape(logps.shape) / logps.size), logps

  (_, want), want_g = jax.value_and_grad(total, has_aux=True)(params, None)
  (_, got), got_g = jax.value_and_grad(total, has_aux=True)(params, size)
  assert rel_error(got, want) < 1e-6
  for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    assert rel_error(g, w) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(loss_type="ipo", precompute_ref_logps=True)])
def test_train_steps_equal_whole_rows(tmp_path, kw):
  cfg = runs.config(tmp_path, steps=3, **kw)
  ds = data_lib.load_dataset(runs.TRAIN, data_lib.ByteTokenizer(), cfg.max_length,
                             cfg.max_prompt_length)
  size = scored.block_size(scored.max_span(ds.loss_mask), cfg.max_length)
  assert size < cfg.max_length
  mesh = Mesh(np.array(jax.devices()), ("data",))
  runs.assert_agree(runs.step_run(step_lib.StepFunctions(cfg, mesh, scored_size=size), cfg),
                    runs.step_run(step_lib.StepFunctions(cfg, mesh), cfg))
