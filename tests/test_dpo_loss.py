"""`tunix_kernels.dpo_loss` against numbers worked out by hand with the math module."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunix_kernels


def softplus(x):  # -log(sigmoid(-x)), by hand
  return math.log1p(math.exp(x))


# One pair: policy moved chosen up by 1 and rejected down by 1 -> h = 2, beta * h = 1.
PC, PR, RC, RR, BETA = -1.0, -3.0, -2.0, -2.0, 0.5
H = (PC - RC) - (PR - RR)


def _one(loss_type, label_smoothing=0.0, impl="auto", **kw):
  a = lambda v: jnp.array([v], jnp.float32)
  loss, _ = tunix_kernels.dpo_loss(a(PC), a(PR), a(RC), a(RR), beta=BETA, loss_type=loss_type,
                             label_smoothing=label_smoothing, impl=impl, **kw)
  return float(loss)


@pytest.mark.parametrize("impl", ["auto", "xla", "naive"])
def test_each_loss_type_by_hand(impl):
  assert H == 2.0
  z = BETA * H
  np.testing.assert_allclose(_one("sigmoid", impl=impl), softplus(-z), rtol=1e-6)
  np.testing.assert_allclose(_one("sigmoid", 0.2, impl=impl),
                             0.8 * softplus(-z) + 0.2 * softplus(z), rtol=1e-6)
  np.testing.assert_allclose(_one("robust", 0.2, impl=impl),
                             (0.8 * softplus(-z) - 0.2 * softplus(z)) / 0.6, rtol=1e-6)
  np.testing.assert_allclose(_one("hinge", impl=impl), 0.0, atol=1e-7)  # 1 - beta*h = 0
  np.testing.assert_allclose(_one("ipo", impl=impl), (H - 1 / (2 * BETA)) ** 2, rtol=1e-6)
  np.testing.assert_allclose(_one("sigmoid", impl=impl, reference_free=True),
                             softplus(-BETA * (PC - PR)), rtol=1e-6)


def test_hinge_active_region():
  a = lambda v: jnp.array([v], jnp.float32)
  loss, _ = tunix_kernels.dpo_loss(a(-1.0), a(-1.5), a(-1.0), a(-1.0), beta=0.5, loss_type="hinge")
  np.testing.assert_allclose(float(loss), 1 - 0.5 * 0.5, rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust"])
def test_policy_equals_reference_gives_ln2(loss_type):
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 6)) - 3
  y = jax.random.normal(jax.random.PRNGKey(1), (4, 6)) - 3
  mask = jnp.ones((4, 6))
  loss, m = tunix_kernels.dpo_loss(x, y, x, y, chosen_mask=mask, rejected_mask=mask,
                             loss_type=loss_type)
  assert float(loss) == pytest.approx(math.log(2), abs=1e-7)
  assert float(m["rewards/accuracies"]) == 0.0  # ties are not "strictly greater"


def test_metrics_on_hand_made_batch():
  # Per-token inputs with masks; the sums below were done on paper.
  pc = jnp.array([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
  cm = jnp.array([[1, 1, 0], [1, 1, 1]])          # sums: -3, -3
  pr = jnp.array([[-4.0, -5.0, -7.0], [-0.5, -0.5, -0.5]])
  rm = jnp.array([[1, 0, 0], [1, 1, 0]])          # sums: -4, -1
  rc = jnp.array([[-2.0, -2.0, 0.0], [-1.0, -1.0, -2.0]])  # sums: -4, -4
  rr = jnp.array([[-4.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])  # sums: -4, -2
  beta = 0.1
  loss, m = tunix_kernels.dpo_loss(pc, pr, rc, rr, chosen_mask=cm, rejected_mask=rm, beta=beta)
  chosen_r = [beta * (-3 + 4), beta * (-3 + 4)]      # [0.1, 0.1]
  rejected_r = [beta * (-4 + 4), beta * (-1 + 2)]    # [0.0, 0.1]
  want = {
      "rewards/chosen": 0.1, "rewards/rejected": 0.05, "rewards/accuracies": 0.5,
      "rewards/margins": 0.05, "logps/chosen": -3.0, "logps/rejected": -2.5,
  }
  assert set(m) == set(want)
  for k, v in want.items():
    np.testing.assert_allclose(float(m[k]), v, rtol=1e-6, atol=1e-7, err_msg=k)
  margins = [c - r for c, r in zip(chosen_r, rejected_r)]
  np.testing.assert_allclose(float(loss), np.mean([softplus(-x) for x in margins]), rtol=1e-6)


def test_ipo_loss_averages_over_the_response_and_its_metrics_sum():
  pc = jnp.array([[-1.0, -3.0, 0.0]]); cm = jnp.array([[1, 1, 0]])  # mean -2
  pr = jnp.array([[-6.0, -6.0, -6.0]]); rm = jnp.array([[1, 1, 1]])  # mean -6
  zeros = jnp.zeros((1, 3))
  beta = 0.25
  loss, m = tunix_kernels.dpo_loss(pc, pr, zeros, zeros, chosen_mask=cm, rejected_mask=rm,
                             beta=beta, loss_type="ipo")
  np.testing.assert_allclose(float(loss), (4.0 - 1 / (2 * beta)) ** 2, rtol=1e-6)
  # TRL's metrics are sums over the response even when the loss averages.
  np.testing.assert_allclose(float(m["logps/chosen"]), -4.0, rtol=1e-6)
  np.testing.assert_allclose(float(m["rewards/margins"]), beta * (-4.0 + 18.0), rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_xla_matches_naive_values_and_grads(loss_type):
  keys = jax.random.split(jax.random.PRNGKey(3), 6)
  logps = [jax.random.normal(k, (5, 7)) * 2 - 4 for k in keys[:4]]
  masks = [(jax.random.uniform(k, (5, 7)) < 0.7).at[:, 0].set(True) for k in keys[4:]]

  def f(impl):
    def loss(pc, pr):
      return tunix_kernels.dpo_loss(pc, pr, logps[2], logps[3], chosen_mask=masks[0],
                              rejected_mask=masks[1], beta=0.3, loss_type=loss_type,
                              label_smoothing=0.1, impl=impl)
    (l, m), g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(logps[0], logps[1])
    return l, m, g

  got, want = f("xla"), f("naive")
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_bad_inputs():
  x = jnp.zeros((2,))
  with pytest.raises(ValueError, match="unknown loss_type"):
    tunix_kernels.dpo_loss(x, x, x, x, loss_type="kto")
  with pytest.raises(ValueError, match="need chosen_mask"):
    tunix_kernels.dpo_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2, 3)))
  with pytest.raises(ValueError, match="shape"):
    tunix_kernels.dpo_loss(x, jnp.zeros((3,)), x, x)
  with pytest.raises(ValueError, match="reference_free"):
    tunix_kernels.dpo_loss(x, x, None, None)
  with pytest.raises(ValueError, match="robust"):
    tunix_kernels.dpo_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)
  loss, _ = tunix_kernels.dpo_loss(x, x, None, None, reference_free=True)
  assert float(loss) == pytest.approx(math.log(2))


def test_reference_is_not_an_impl():
  # "reference" only ever means DPO's frozen reference model; the oracle is "naive".
  x = jnp.zeros((2,))
  with pytest.raises(ValueError, match=r"unknown dpo_loss impl 'reference'; choose one of "
                     r"\('auto', 'xla', 'naive', 'pallas', 'interpret'\)"):
    tunix_kernels.dpo_loss(x, x, x, x, impl="reference")


ROW_TYPES = [t for t in tunix_kernels.LOSS_TYPES if t not in
             ("aot", "aot_unpaired", "sft", "cpo", "orpo")]


@pytest.mark.parametrize("impl", ["xla", "naive"])
def test_pair_mask_gives_the_loss_gradient_and_metrics_of_the_counted_pairs_alone(impl):
  """Padding pairs (online DPO's ties: no scored token) change nothing, for every loss
  that is a mean of per-pair terms: value, gradient and metrics equal the subset's."""
  rng = np.random.default_rng(3)
  B, T = 6, 5
  keep = np.array([1, 0, 1, 1, 0, 1], np.float32)
  logps = [jnp.asarray(rng.normal(-1.0, 0.5, (B, T)), jnp.float32) for _ in range(4)]
  masks = [jnp.asarray((rng.random((B, T)) < 0.8) * keep[:, None], jnp.float32)
           for _ in range(2)]
  masks = [m.at[keep > 0, 0].set(1.0) for m in masks]  # every kept row scores a token
  sub = keep > 0
  for loss_type in ROW_TYPES:
    kw = dict(beta=0.3, loss_type=loss_type, impl=impl, label_smoothing=0.1
              if loss_type in ("sigmoid", "robust", "exo_pair", "bco_pair") else 0.0)

    def f(pc, pr, rows, pair_mask, cm, rm):
      return tunix_kernels.dpo_loss(pc, pr, *[x[rows] for x in logps[2:]], chosen_mask=cm,
                                    rejected_mask=rm, pair_mask=pair_mask, **kw)

    (got, got_m), got_g = jax.value_and_grad(f, (0, 1), has_aux=True)(
        logps[0], logps[1], slice(None), keep, *masks)
    (want, want_m), want_g = jax.value_and_grad(f, (0, 1), has_aux=True)(
        logps[0][sub], logps[1][sub], sub, None, masks[0][sub], masks[1][sub])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=loss_type)
    for g, w in zip(got_g, want_g):
      np.testing.assert_allclose(g[sub], w, rtol=1e-6, atol=1e-7, err_msg=loss_type)
      np.testing.assert_array_equal(g[~sub], 0.0)
    for k in want_m:
      np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-6, atol=1e-6,
                                 err_msg=f"{loss_type} {k}")
  none, metrics = tunix_kernels.dpo_loss(*logps, chosen_mask=masks[0], rejected_mask=masks[1],
                                         pair_mask=np.zeros(B), impl=impl)
  assert float(none) == 0.0 and all(float(v) == 0.0 for v in metrics.values())
