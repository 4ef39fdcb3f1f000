"""Model FLOPs (`tunix_core.flops`) against numbers by hand and XLA's own cost analysis
of the forward, and the measured matmul peak."""

import dataclasses

import jax
import jax.numpy as jnp

from tunix_core import flops
from tunix_core import model as model_lib

CFG = model_lib.ModelConfig(vocab_size=512, d_model=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16, mlp_dim=128)


def test_forward_flops_by_hand():
  # per layer: wq 64*64 + wk, wv 2*64*32 + wo 64*64 + MLP 3*64*128 = 36864; head 64*512.
  dense = 2 * 36864 + 64 * 512
  T = 32
  assert flops.forward_flops_per_token(CFG, T) == 2 * dense + 4 * 2 * T * 4 * 16
  assert flops.step_flops(CFG, 3, T, True) == 4 * 6 * T * flops.forward_flops_per_token(CFG, T)
  assert flops.step_flops(CFG, 3, T, False) == 3 * 6 * T * flops.forward_flops_per_token(CFG, T)


def test_forward_flops_match_xla_cost_analysis():
  """XLA counts the compiled forward (logits on every position) within 10% of ours: the
  rest is norms, rope and softmax. One layer, as XLA counts a loop body once."""
  B, T = 2, 64
  cfg = dataclasses.replace(CFG, num_layers=1)
  params = model_lib.init_params(jax.random.PRNGKey(0), cfg)
  tokens = jnp.zeros((B, T), jnp.int32)
  compiled = jax.jit(lambda p, t: model_lib.logits(p, t, None, cfg)).lower(params, tokens).compile()
  cost = compiled.cost_analysis()
  xla = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
  ours = B * T * flops.forward_flops_per_token(cfg, T)
  assert abs(xla - ours) <= 0.1 * ours, (xla, ours)


def test_matmul_peak_is_a_positive_rate():
  assert flops.matmul_peak(n=256, repeats=3) > 1e6
