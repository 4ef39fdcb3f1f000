"""Steady-state speed of a whole DPO train step on synthetic token batches.

    python benchmarks/dpo_step.py --layers 4 --d_model 256 --vocab 32000 --pairs 8 \\
        --prompt_len 128 --response_len 128 --logprob_impl xla

One step is the trainer's own: policy and frozen-reference forwards, fused log-probs,
DPO loss, backward and the AdamW update, jitted over every local device. Prints
steps/s and tokens/s after compilation, then one JSON line with the figures.
"""

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh

import kernels
from tunix_core import config as config_lib
from tunix_core import model as model_lib
from tunix_core import step as step_lib


def synthetic_batch(rng, pairs, prompt_len, response_len, vocab):
  """A `[B, 2, T]` pair batch: random prompt (unscored) and response tokens (scored)."""
  T = prompt_len + response_len
  tokens = rng.integers(0, vocab, (pairs, 2, T), dtype=np.int32)
  targets = np.roll(tokens, -1, axis=-1)
  loss_mask = np.zeros((pairs, 2, T), np.int32)
  loss_mask[..., prompt_len - 1:T - 1] = 1
  targets = np.where(loss_mask > 0, targets, kernels.IGNORE_INDEX).astype(np.int32)
  return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask,
          "attention_mask": np.ones((pairs, 2, T), np.int32)}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--num_kv_heads", type=int, default=4)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--mlp_dim", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--pairs", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=128)
  p.add_argument("--response_len", type=int, default=128)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--logprob_impl", default="xla")
  args = p.parse_args()

  mcfg = model_lib.ModelConfig(vocab_size=args.vocab, d_model=args.d_model,
                               num_layers=args.layers, num_heads=args.num_heads,
                               num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                               mlp_dim=args.mlp_dim)
  cfg = config_lib.TrainConfig(output_dir=tempfile.mkdtemp(), train_data="", steps=args.steps,
                              batch_size=args.pairs, logprob_impl=args.logprob_impl)
  devices = jax.devices()
  trainer = step_lib.StepFunctions(cfg, Mesh(np.array(devices), ("data",)), model_config=mcfg)
  state = trainer.init_state(jax.random.PRNGKey(0))
  ref_params = jax.tree.map(lambda x: x.copy(), state["params"])
  batch = trainer.put_batch(synthetic_batch(np.random.default_rng(0), args.pairs,
                                            args.prompt_len, args.response_len, args.vocab))

  t0 = time.perf_counter()
  state, metrics = trainer.train_step(state, ref_params, batch)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, metrics = trainer.train_step(state, ref_params, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  tokens = 2 * args.pairs * (args.prompt_len + args.response_len)
  result = {"logprob_impl": args.logprob_impl, "devices": len(devices),
            "platform": devices[0].platform, "compile_s": compile_s,
            "median_step_s": step_s, "steps_per_sec": 1 / step_s,
            "tokens_per_sec": tokens / step_s, "loss": float(metrics["loss"])}
  print(f"{args.logprob_impl}: {1 / step_s:.2f} steps/s, {tokens / step_s:,.0f} tokens/s "
        f"(median of {args.steps} steps after a {compile_s:.1f} s compile)")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
