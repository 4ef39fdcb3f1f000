"""The preference-loss family (`tunix_kernels.dpo_loss.losses` through `tunix_kernels.dpo_loss`) against a
float64 NumPy implementation written from TRL's code (`oracles.numpy_dpo_loss`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunix_kernels
from oracles import numpy_dpo_loss
from tunix_core.training import config as config_lib

B, T = 6, 9


def _inputs(seed=0):
  """Per-token log-probs `[B, T]` and masks of different lengths (one of one token)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  logps = [jax.random.uniform(k, (B, T), minval=-3.0, maxval=-0.05) for k in keys]
  lens_c, lens_r = np.array([9, 1, 4, 7, 5, 2]), np.array([3, 8, 6, 1, 9, 4])
  pos = np.arange(T)
  masks = [jnp.asarray(pos < n[:, None], jnp.float32) for n in (lens_c, lens_r)]
  return logps, masks


def _params(loss_type):
  # EXO needs epsilon in (0, 1); the others take smoothing where TRL reads it.
  return dict(beta=0.3, label_smoothing=0.01 if "exo_pair" in loss_type else 0.1)


def _check(got, want, rtol=2e-5):
  loss, metrics = got
  want_loss, want_metrics = want
  np.testing.assert_allclose(float(loss), want_loss, rtol=rtol, atol=1e-6)
  for k, v in want_metrics.items():
    np.testing.assert_allclose(float(metrics[k]), v, rtol=rtol, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("loss_type", tunix_kernels.LOSS_TYPES)
@pytest.mark.parametrize("impl", ["xla", "naive"])
def test_each_loss_type_equals_trls_formula_in_float64(loss_type, impl):
  logps, masks = _inputs()
  kw = _params(loss_type)
  got = tunix_kernels.dpo_loss(*logps, chosen_mask=masks[0], rejected_mask=masks[1],
                         loss_type=loss_type, impl=impl, **kw)
  _check(got, numpy_dpo_loss(*logps, *masks, loss_type=loss_type, **kw))


@pytest.mark.parametrize("f_divergence_type,alpha", [
    ("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.3),
    ("alpha_divergence", 1.0)])
def test_f_divergences_map_the_scores_as_trl_does(f_divergence_type, alpha):
  logps, masks = _inputs(1)
  kw = dict(beta=0.2, f_divergence_type=f_divergence_type, f_alpha_divergence_coef=alpha,
            loss_type="sigmoid,hinge,ipo,nca_pair,bco_pair,sppo_hard,apo_down,discopop,"
                      "sigmoid_norm", loss_weights=[1.0, 0.5, 0.1, 2.0, 1.0, 0.3, 1.0, 1.0, 0.7])
  got = tunix_kernels.dpo_loss(*logps, chosen_mask=masks[0], rejected_mask=masks[1], **kw)
  _check(got, numpy_dpo_loss(*logps, *masks, **kw))


@pytest.mark.parametrize("loss_type,weights", [
    ("sigmoid,sft", [1.0, 0.2]), ("sigmoid,bco_pair,sft", [0.8, 0.2, 1.0]),
    ("simpo,cpo,orpo", None)])
def test_weighted_lists_are_the_weighted_sums_of_their_terms(loss_type, weights):
  logps, masks = _inputs(2)
  kw = dict(beta=0.4, loss_type=loss_type, loss_weights=weights, simpo_gamma=0.7,
            cpo_alpha=0.5)
  got = tunix_kernels.dpo_loss(*logps, chosen_mask=masks[0], rejected_mask=masks[1], **kw)
  _check(got, numpy_dpo_loss(*logps, *masks, **kw))
  terms = [tunix_kernels.dpo_loss(*logps, chosen_mask=masks[0], rejected_mask=masks[1],
                            **dict(kw, loss_type=t, loss_weights=None))[0]
           for t in loss_type.split(",")]
  np.testing.assert_allclose(float(got[0]), sum(w * float(t) for w, t in
                                                zip(weights or [1.0] * 3, terms)), rtol=1e-6)


def test_reference_free_objectives_need_no_reference():
  logps, masks = _inputs(3)
  got = tunix_kernels.dpo_loss(logps[0], logps[1], None, None, chosen_mask=masks[0],
                         rejected_mask=masks[1], loss_type="simpo,orpo", beta=2.0)
  zeros = np.zeros((B, T))
  _check(got, numpy_dpo_loss(logps[0], logps[1], zeros, zeros, *masks,
                             loss_type="simpo,orpo", beta=2.0))
  with pytest.raises(ValueError, match="only the reference log-probs may be None"):
    tunix_kernels.dpo_loss(logps[0], logps[1], None, None, chosen_mask=masks[0],
                     rejected_mask=masks[1], loss_type="simpo,sigmoid")


@pytest.mark.parametrize("loss_type", ["sigmoid,ipo", "orpo", "aot", "discopop,apo_zero",
                                       "simpo,sft"])
def test_gradients_equal_finite_differences_of_the_float64_formula(loss_type):
  logps, masks = _inputs(4)
  kw = _params(loss_type)
  grads = jax.grad(lambda pc, pr: tunix_kernels.dpo_loss(
      pc, pr, logps[2], logps[3], chosen_mask=masks[0], rejected_mask=masks[1],
      loss_type=loss_type, **kw)[0], argnums=(0, 1))(logps[0], logps[1])
  base = [np.asarray(x, np.float64) for x in logps]
  step = 1e-6
  for which, (row, col) in [(0, (0, 3)), (0, (2, 0)), (1, (1, 5)), (1, (4, 8))]:
    up, down = [x.copy() for x in base], [x.copy() for x in base]
    up[which][row, col] += step
    down[which][row, col] -= step
    fd = (numpy_dpo_loss(*up, *masks, loss_type=loss_type, **kw)[0]
          - numpy_dpo_loss(*down, *masks, loss_type=loss_type, **kw)[0]) / (2 * step)
    np.testing.assert_allclose(float(grads[which][row, col]), fd, rtol=2e-3, atol=1e-6)


def test_pallas_kernel_lists_equal_xla_and_other_losses_are_refused():
  logps, masks = _inputs(5)
  kw = dict(chosen_mask=masks[0], rejected_mask=masks[1], beta=0.3, label_smoothing=0.1,
            loss_type="sigmoid,ipo,robust", loss_weights=[1.0, 0.3, 0.5])
  chex.assert_trees_all_close(tunix_kernels.dpo_loss(*logps, impl="interpret", **kw),
                              tunix_kernels.dpo_loss(*logps, impl="xla", **kw), rtol=1e-5,
                              atol=1e-6)
  with pytest.raises(ValueError, match="Pallas kernel computes loss types sigmoid, ipo, "
                     "hinge, robust, not sft"):
    tunix_kernels.dpo_loss(*logps, impl="pallas", **dict(kw, loss_type="sigmoid,sft",
                                                     loss_weights=None))
  with pytest.raises(ValueError, match="reverse_kl scores only"):
    tunix_kernels.dpo_loss(*logps, impl="interpret", f_divergence_type="js_divergence", **kw)


@pytest.mark.parametrize("kw,match", [
    (dict(loss_type="kto"), "unknown loss_type 'kto'"),
    (dict(loss_type="sigmoid,sft", loss_weights=[1.0]), "1 loss_weights for 2 loss types"),
    (dict(loss_type="sigmoid,sigmoid"), "repeat"),
    (dict(loss_type="exo_pair"), r"exo_pair needs 0 < label_smoothing < 1"),
    (dict(f_divergence_type="chi2"), "unknown f_divergence_type"),
    (dict(loss_type="discopop", discopop_tau=0.0), "discopop_tau must be positive")])
def test_bad_loss_arguments_are_one_clear_error(kw, match):
  x = jnp.zeros((2,))
  with pytest.raises(ValueError, match=match):
    tunix_kernels.dpo_loss(x, x, x, x, **kw)


def test_flags_take_lists_and_name_the_bad_one(tmp_path):
  cfg = config_lib.TrainConfig(output_dir=str(tmp_path), loss_type="sigmoid,sft",
                               loss_weights="1.0,0.2")
  spec = cfg.loss_spec()
  assert spec.loss_types == ("sigmoid", "sft") and spec.loss_weights == (1.0, 0.2)
  assert not spec.reference_free
  assert config_lib.TrainConfig(output_dir="x", loss_type="simpo,orpo").loss_spec(
      ).reference_free
  for bad, match in [(dict(loss_weights="1.0,x"), "--loss_weights='1.0,x' is not"),
                     (dict(loss_type="sigmoid,dpo"), "--loss_type='sigmoid,dpo': unknown "
                      "loss_type 'dpo'")]:
    with pytest.raises(config_lib.ConfigError, match=match):
      config_lib.TrainConfig(output_dir=str(tmp_path), compile_only=True,
                             **bad).validate(1)
