"""Model FLOPs of a planned step (`training.flops`) against numbers by hand and XLA's own
cost analysis of the forward, and the peak MFU is measured against."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp

import runs
from tunix_core import model as model_lib
from tunix_core.data import packing
from tunix_core.training import flops
from tunix_core.training import plan as plan_lib

CFG = model_lib.ModelConfig(vocab_size=512, d_model=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16, mlp_dim=128)


def test_step_flops_of_a_plan_by_hand(tmp_path):
  # per layer: wq 64*64 + wk, wv 2*64*32 + wo 64*64 + MLP 3*64*128 = 36864.
  rows = packing.Spec(pairs=2, rows=2, length=32, head=40, band=None, share=True)
  cfg = runs.config(tmp_path, batch_size=8)
  plan = plan_lib.StepPlan(cfg=cfg, model=CFG, rows=rows, data_shards=4, model_parallel=1)
  per_position = 2 * 2 * 36864 + 4 * 2 * 4 * 16 * 32   # dense + attention over 32 keys
  forward = 4 * (2 * 32 * per_position + 40 * 2 * 64 * 512)  # 4 groups of 2 pairs
  assert flops.step_flops(plan) == 4 * forward             # policy fwd + bwd, reference
  none = dataclasses.replace(plan, cfg=dataclasses.replace(cfg, reference="none"))
  assert flops.step_flops(none) == 3 * forward
  packed = dataclasses.replace(plan, rows=dataclasses.replace(rows, rows=1, length=128,
                                                              band=20))
  per_position = 2 * 2 * 36864 + 4 * 2 * 4 * 16 * 20   # the band bounds the keys
  assert flops.step_flops(packed) == 4 * 4 * (128 * per_position + 40 * 2 * 64 * 512)


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
  ours = flops.forward_flops(cfg, B * T, T, B * T)
  assert abs(xla - ours) <= 0.1 * ours, (xla, ours)


def test_peak_is_nominal_for_known_chips_and_measured_once_elsewhere(tmp_path):
  v5e = types.SimpleNamespace(device_kind="TPU v5 lite")
  assert flops.peak_flops(v5e)[0] == 197e12
  cache = str(tmp_path / "peak.json")
  first, source = flops.peak_flops(jax.devices()[0], n=256, repeats=3, cache=cache)
  assert first > 1e6 and "measured" in source
  with open(cache) as f:
    assert list(json.load(f).values()) == [first]
  # A second launch reads the same denominator instead of timing again.
  assert flops.peak_flops(jax.devices()[0], n=256, repeats=3, cache=cache)[0] == first
