"""Model FLOPs of a planned step (`training.flops`) against numbers by hand and XLA's own
cost analysis of the forward, and the peak MFU is measured against."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runs
from tunix_core import model as model_lib
from tunix_core.data import packing
from tunix_core.training import flops
from tunix_core.training import plan as plan_lib

CFG = model_lib.ModelConfig(vocab_size=512, d_model=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16, mlp_dim=128)


def _plan(cfg, model, rows):
  """A `StepPlan` of `cfg`'s sizes and loss with `model`'s `rows` on 4 data devices."""
  return plan_lib.StepPlan(model=model, rows=rows, data_shards=4, model_parallel=1,
                           batch_size=cfg.batch_size, max_length=cfg.max_length,
                           max_prompt_length=cfg.max_prompt_length, loss=cfg.loss_spec(),
                           optimizer=cfg.optimizer_config(), reference=cfg.reference)


def test_step_flops_of_a_plan_by_hand(tmp_path):
  # per layer: wq 64*64 + wk, wv 2*64*32 + wo 64*64 + MLP 3*64*128 = 36864. Rows of 32
  # tokens are one attention tile: 32 x 32 pairs computed per layer.
  rows = packing.Spec(pairs=2, rows=2, length=32, head=40, band=None, share=True)
  cfg = runs.config(tmp_path, batch_size=8)
  plan = _plan(cfg, CFG, rows)
  per_row = 2 * 2 * 36864 * 32 + 4 * 4 * 16 * 2 * 32 * 32  # dense + 2 layers' tile
  forward = 4 * (2 * per_row + 40 * 2 * 64 * 512)           # 4 groups of 2 pairs
  assert flops.step_flops(plan) == 4 * forward             # policy fwd + bwd, reference
  none = dataclasses.replace(plan, reference="none")
  assert flops.step_flops(none) == 3 * forward
  # 2,048-token rows in 512 x 512 tiles: causal, 10 of the 16 tiles; packed sequences of
  # 512, the 4 diagonal tiles only.
  long = dataclasses.replace(rows, rows=1, length=2048, band=None, share=False)
  plain = dataclasses.replace(plan, rows=long)
  assert flops.attended_pairs(plain) == 2 * 10 * 512 * 512
  packed = dataclasses.replace(plan, rows=dataclasses.replace(long, band=512))
  assert flops.attended_pairs(packed) == 2 * 4 * 512 * 512
  assert flops.step_flops(packed) == 4 * 4 * (2 * 2 * 36864 * 2048 + 40 * 2 * 64 * 512
                                              + 4 * 4 * 16 * 2 * 4 * 512 * 512)


def _visible_tiles_by_brute_force(segments, branches, positions, window, tile):
  """Tiles of a `[L, L]` visibility built entry by entry from its definition (a key at
  or before the query, same segment, of the trunk or the query's branch, within the
  window) that hold at least one visible entry."""
  s, b, p = segments[0], branches[0], positions[0]
  q, k = np.arange(len(s))[:, None], np.arange(len(s))[None, :]
  visible = ((k <= q) & (s[:, None] == s[None, :]) & ((b[None, :] == 0) | (b[None, :] == b[:, None]))
             & (p[:, None] - p[None, :] < window))
  n = len(s) // tile
  return int(visible.reshape(n, tile, n, tile).any(axis=(1, 3)).sum())


@pytest.mark.parametrize("share,band,window", [(True, None, 0), (True, 512, 0),
                                               (False, None, 700)])
def test_attention_flops_count_the_tiles_the_kernels_visit(tmp_path, share, band, window):
  """The pairs a planned row's attention computes equal the tiles of the brute-force
  visibility of that row (prefix sharing: the rejected response's queries skip the
  chosen response's keys; a sliding window on one of the two layers skips the far
  tiles) times the tile's area."""
  rows = packing.Spec(pairs=1, rows=1, length=2048, head=40, band=band, share=share)
  model = dataclasses.replace(CFG, sliding_window=window, layer_types=(
      ("sliding_attention", "full_attention") if window else None))
  plan = _plan(runs.config(tmp_path, batch_size=8, max_prompt_length=300), model, rows)
  segments, branches, positions = flops.planned_row(rows, 300)
  if share and band is None:  # a prompt of 300, responses of 874 from position 300 on
    assert list(np.bincount(branches[0])) == [300, 874, 874]
    assert positions[0, 300 + 874] == 300 and positions[0, -1] == 300 + 873
  layers = [_visible_tiles_by_brute_force(segments, branches, positions,
                                          w or 1 << 30, 512)
            for w in ((window, 0) if window else (0, 0))]
  assert flops.attended_pairs(plan) == sum(layers) * 512 * 512
  assert sum(layers) < 2 * 10  # fewer than the causal tiles of both layers


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
