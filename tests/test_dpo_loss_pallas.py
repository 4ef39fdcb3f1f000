"""The Pallas DPO loss kernel (TPU interpret mode) against the jnp version and float64."""

import chex
import jax
import jax.numpy as jnp
import math
import numpy as np
import pytest
from absl.testing import parameterized

import tunix_kernels
from oracles import numpy_dpo_loss


def _batch(B, T, seed=3):
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  logps = [jax.random.normal(k, (B, T)) * 2 - 4 for k in keys[:4]]
  masks = [(jax.random.uniform(k, (B, T)) < 0.7).at[:, 0].set(True).astype(jnp.int32)
           for k in keys[4:]]
  return logps, masks


def _loss_and_grads(impl, logps, masks, **kw):
  def loss(pc, pr, rc, rr):
    return tunix_kernels.dpo_loss(pc, pr, rc, rr, chosen_mask=masks[0], rejected_mask=masks[1],
                            impl=impl, **kw)
  (l, m), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*logps)
  return l, m, g


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_every_loss_type_matches_jnp(loss_type):
  # B=5, T=300: rows padded to 8 and the sequence to one block of 384.
  logps, masks = _batch(5, 300)
  kw = dict(beta=0.3, loss_type=loss_type, label_smoothing=0.1)
  chex.assert_trees_all_close(_loss_and_grads("interpret", logps, masks, **kw),
                              _loss_and_grads("xla", logps, masks, **kw),
                              rtol=1e-5, atol=1e-6)


def test_pair_mask_means_match_jnp():
  # Two padding pairs (no scored token, as online DPO's ties): the kernel's means skip them.
  logps, masks = _batch(5, 40)
  masks = [m.at[1].set(0).at[3].set(0) for m in masks]
  kw = dict(beta=0.3, loss_type="sigmoid,ipo", pair_mask=jnp.array([1, 0, 1, 0, 1]))
  chex.assert_trees_all_close(_loss_and_grads("interpret", logps, masks, **kw),
                              _loss_and_grads("xla", logps, masks, **kw),
                              rtol=1e-5, atol=1e-6)


def test_long_sequence_uses_several_grid_steps_and_jit():
  logps, masks = _batch(3, 1100)  # block_t 512 -> 3 steps
  f = jax.jit(lambda *a: _loss_and_grads("interpret", a[:4], a[4:], beta=0.1))
  chex.assert_trees_all_close(f(*logps, *masks), _loss_and_grads("xla", logps, masks, beta=0.1),
                              rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_rows_past_vmem_go_in_blocks_with_the_same_means():
  # 1,500 rows of 128 positions pass the smallest default scoped VMEM: the kernels run
  # on blocks of rows (`DPOLossBlockSizes.get_default`), the means weighted by rows.
  bs = tunix_kernels.DPOLossBlockSizes.get_default(1500, 128)
  assert bs.block_b is not None and 1500 % bs.block_b
  logps, masks = _batch(1500, 128)
  chex.assert_trees_all_close(_loss_and_grads("interpret", logps, masks, beta=0.2),
                              _loss_and_grads("xla", logps, masks, beta=0.2),
                              rtol=1e-5, atol=1e-6)


def test_per_sequence_reference_free_and_ln2():
  x = jnp.array([-3.0, -1.0]); y = jnp.array([-2.0, -4.0])
  l, m = tunix_kernels.dpo_loss(x, y, x, y, impl="interpret")
  assert float(l) == pytest.approx(math.log(2), abs=1e-6)
  l, m = tunix_kernels.dpo_loss(x, y, None, None, reference_free=True, beta=0.5, impl="interpret")
  want = [math.log1p(math.exp(-0.5 * (-3.0 + 2.0))), math.log1p(math.exp(-0.5 * (-1.0 + 4.0)))]
  assert float(l) == pytest.approx(sum(want) / 2, rel=1e-6)
  assert float(m["rewards/accuracies"]) == 0.5


class SameWithAndWithoutJitTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      (f"{impl}_{loss_type}", impl, loss_type) for impl in ("xla", "interpret")
      for loss_type in ("sigmoid", "ipo", "hinge", "robust"))
  def test_against_float64(self, impl, loss_type):
    logps, masks = _batch(5, 200)
    kw = dict(beta=0.3, loss_type=loss_type, label_smoothing=0.1)

    @self.variant
    def loss(pc, pr, rc, rr, cm, rm):
      return tunix_kernels.dpo_loss(pc, pr, rc, rr, chosen_mask=cm, rejected_mask=rm, impl=impl,
                              **kw)

    got_loss, got_metrics = loss(*logps, *masks)
    want_loss, want_metrics = numpy_dpo_loss(*logps, *masks, **kw)
    np.testing.assert_allclose(float(got_loss), want_loss, rtol=1e-5, atol=1e-6)
    assert set(got_metrics) == set(want_metrics)
    for k, v in want_metrics.items():
      np.testing.assert_allclose(float(got_metrics[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
