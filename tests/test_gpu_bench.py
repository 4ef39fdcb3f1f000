"""`benchmarks/gpu.sh`, the script a lent GPU runs, kept from rotting while none is lent:
its dry run on CPU at tiny shapes (TRL's side where torch, trl and datasets import, else
skipped and said so), and the FLOP count its MFU divides by, against a hand count."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import oracles

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location("gpu_bench",
                                               os.path.join(REPO, "benchmarks", "gpu.py"))
gpu = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu)


def test_pairs_fit_the_row_and_the_flops_are_the_hand_count():
  pairs = gpu.synthetic_pairs(16, 64, vocab=512)
  for p, c, r in pairs:
    assert 16 <= len(p) <= 32 and 16 <= len(c) <= 32 and 16 <= len(r) <= 32
    assert c[-1] == r[-1] == gpu.EOS and min(p + c[:-1] + r[:-1]) >= 2
  assert gpu.real_tokens(pairs) == sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs)
  # One pair, rows of 5 and 4 ids, on the tiny config (D 64, F 128, 2 layers, 4 heads and
  # 2 KV heads of 16, V 512): 4 forwards (policy forward + backward, reference) of each
  # row: per position 2 x the layers' matmul weights, QK^T and PV over the causal mean
  # of (t + 1) / 2 keys, and the LM head.
  weights = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
  want = sum(4 * t * (2 * weights + 4 * 2 * 4 * 16 * (t + 1) / 2 + 2 * 64 * 512)
             for t in (5, 4))
  assert gpu.dpo_flops(gpu.MODELS["tiny"], [([7, 8, 9], [3, 1], [1])]) == pytest.approx(want)


@pytest.mark.slow  # subprocesses: our side (and TRL's where installed) trains 4 steps
def test_dry_run_writes_a_row_per_side_and_the_table(tmp_path):
  env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
  proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu.sh"), "--dry_run"],
                        env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  with open(tmp_path / "results.jsonl") as f:
    rows = {r["side"]: r for r in map(json.loads, f)}
  has_trl = subprocess.run([env.get("TRL_PYTHON", sys.executable), "-c",
                            "import torch, trl, datasets"], capture_output=True).returncode == 0
  ours = "ours --remat=full"  # the dry run's case passes a flag to our side
  assert set(rows) == ({ours, "trl"} if has_trl else {ours}), rows
  if not has_trl:
    assert "TRL side skipped" in proc.stdout
  pairs = gpu.synthetic_pairs(2, 64, vocab=512)
  for side, r in rows.items():
    assert "error" not in r, r
    assert r["real_tokens"] == gpu.real_tokens(pairs) and r["step_s"] > 0, r
  assert "shared rows" in rows[ours]["plan"] and "remat full" in rows[ours]["plan"]
  table = (tmp_path / "table.md").read_text()
  assert all(f"| tiny | 64 | 2 | {side} |" in table for side in rows), table


@pytest.mark.slow  # interpret mode: the Pallas kernels on a CPU
def test_on_chip_dry_run_checks_every_impl_against_the_reference():
  """`benchmarks/on_chip.py`, the script a lent TPU chip runs, at tiny shapes in interpret
  mode: each implementation compiles, runs, is timed and is compared with the reference
  (XLA's logits; the blockwise XLA attention), and the comparison can fail."""
  spec = importlib.util.spec_from_file_location(
      "on_chip", os.path.join(REPO, "benchmarks", "on_chip.py"))
  on_chip = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(on_chip)
  case = on_chip.logprobs_case(64, 256, 512, ["pallas", "split", "xla", "naive"], None,
                               repeats=1, interpret=True, oracle=True)
  assert case["split_tiles"].endswith("D 128"), case  # the split kernels did run split
  for name in ("pallas", "split", "xla"):
    r = case["impls"][name]
    assert r["ms"] > 0 and r["value_err"] < 1e-6 and max(r["grad_errs"]) < 1e-2, (name, r)
  # The default kernels against float64 NumPy on the host too (the gradient in bf16).
  r = case["impls"]["pallas"]
  assert r["oracle_value_abs"] < 1e-5 and max(r["oracle_grad_errs"]) < 1e-2, r
  case = on_chip.attention_case(256, ["pallas", "xla"], 1, True, None, h=4, kv=2, kdim=128,
                                oracle=256)
  r = case["impls"]["pallas"]
  assert r["value_err"] < 1e-2 and max(r["grad_errs"]) < 1e-2, r
  assert r["oracle_value_abs"] < 2e-2 and len(r["oracle_grad_errs"]) == 3, r
  assert max(r["oracle_grad_errs"]) < 1e-2, r
  # The host oracle flags a wrong answer (its own float64 answer moved by 1e-3 and 1%), at
  # a production vocabulary (no [V, V] one-hot).
  rng = np.random.default_rng(0)
  h, w = rng.normal(size=(8, 16)), rng.normal(size=(16, 200_000))
  t, g = rng.integers(0, 200_000, 8), rng.normal(size=8)
  logp, dh = oracles.numpy_logprobs(h, w, t)[0], oracles.numpy_logprob_grads(h, w, t, g)[0]
  bad = on_chip._logprobs_oracle((h, w, t, g), (logp + 1e-3, (dh * 1.01, None)))
  assert bad["oracle_value_abs"] > 9e-4 and bad["oracle_grad_errs"][0] > 9e-3, bad
  # The "split" row runs the split kernels on v5e although its table names fused tiles.
  assert on_chip.split_tiles(4096, "bfloat16", "v5e", 8192, 128256).block_d is not None
  # The tile tuner (benchmarks/tune_tiles.py) on the same measure: every candidate that
  # fits is timed and checked, and the choice is the fastest of them.
  sys.path.insert(0, os.path.join(REPO, "benchmarks"))
  try:
    tune = importlib.import_module("tune_tiles")
  finally:
    sys.path.pop(0)
  entry = tune.case(256, 1, 4, 2, 64, None, 1, True)
  tiles = {k: v for k, v in entry["ms"].items() if k != "xla"}
  assert not entry["errors"] and set(tiles) == {"256x256", "128x256", "128x128"}, entry
  assert f"{entry['block_q']}x{entry['block_k']}" == min(tiles, key=tiles.get)
  # Log-prob heads: the forward's tiles on the forward, then the backward's after it.
  entry = tune.logprobs_entry(64, 256, 1024, None, 1, True)
  for stage, fields in (("ms_forward", ("block_n", "block_v")),
                        ("ms", ("block_n_bwd", "block_v_bwd"))):
    tiles = {k: v for k, v in entry[stage].items() if k != "xla"}
    assert set(tiles) == {"64x1024", "64x512"} and not entry["errors"], entry
    assert "{}x{}".format(*map(entry.get, fields)) == min(tiles, key=tiles.get), entry
  # The measure itself, on a hand-computed gap: |1 - 2| / 2 for values and gradients.
  ones = np.ones((4, 3), np.float32)
  assert on_chip._errors((ones, [ones]), (2 * ones, [2 * ones])) == dict(
      value_err=0.5, grad_errs=[0.5])


def test_step_profile_attributes_each_op_to_its_scope_and_direction(tmp_path):
  """`benchmarks/step_profile.py`'s attribution on a profiled CPU run of a function with
  two named scopes: every op found in the compiled HLO, each part forward and backward
  where it has both, nothing counted twice (control flow left out)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(REPO, "benchmarks"))
  try:
    import step_profile  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.remove(os.path.join(REPO, "benchmarks"))
  assert step_profile.part_of("jit(f)/transpose(jvp(mlp))/dot") == ("mlp", "backward")
  assert step_profile.part_of("jit(f)/reference/jvp(attention)/x") == ("reference", "forward")
  assert step_profile.part_of("jit(f)/transpose(jvp(reference))/x") == ("reference", "forward")
  assert step_profile.part_of("jit(f)/attention_like/x") == ("other", "forward")
  assert step_profile.part_of("jit(loss)/jvp(mlp)/x") == ("mlp", "forward")  # a jit's name

  def loss(w, x):
    h = jax.named_scope("attention")(lambda x: jnp.tanh(x @ w))(x)
    return jnp.sum(jax.named_scope("mlp")(lambda h: jnp.sin(h @ w))(h) ** 2)

  step = jax.jit(jax.grad(loss))
  w, x = jnp.ones((64, 64)) / 64, jnp.ones((32, 64))
  ops = step_profile.hlo_ops(step.lower(w, x).compile().as_text())
  assert {step_profile.part_of(n)[0] for _, n, _ in ops.values()} >= {"attention", "mlp"}
  step(w, x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(3):
      step(w, x).block_until_ready()
  totals, count, per_op = step_profile.op_times(str(tmp_path), ops)
  assert count >= 3 and all(seconds > 0 for seconds in totals.values())
  # The slowest-instruction listing (`--top`) shares out the same device time.
  assert set(per_op) <= set(ops)
  assert sum(per_op.values()) == pytest.approx(sum(totals.values()))
  assert {("attention", "forward"), ("attention", "backward"), ("mlp", "forward"),
          ("mlp", "backward")} <= set(totals)
