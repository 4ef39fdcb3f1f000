"""Steady-state speed and MFU of the trainer's DPO step on real-shaped, padded pairs.

    python benchmarks/dpo_step.py [--layers 4 --d_model 256 --num_heads 4 --num_kv_heads 2
        --head_dim 64 --mlp_dim 1024 --vocab 32000 --pairs 8 --prompt_len 128
        --response_len 128 --steps 10 --logprob_impl auto
        --prefix_sharing true --packing false]

One step is the trainer's own (a `training.plan.StepPlan` made from the batch, as the
trainer makes it from its data, with the trainer's defaults, so every optimisation the
trainer turns on by default is on here): the policy and an
in-step frozen reference, fused log-probs, the DPO loss, backward and AdamW, over every
local device. The pairs are padded as the peer benchmark's (`benchmarks/peer_tunix.py`):
one prompt of `prompt_len` shared by both responses, left-padded by `prompt_len / 4` on
half the pairs; chosen responses real for their first `3 * response_len / 4` tokens;
rejected ones real for the first `response_len / 2` tokens on half the pairs, full on
the others.

Prints the median step's tokens/s, where tokens are `pairs x 2 x (prompt_len +
response_len)` per step (the whole rows, padding included, so the figure compares with
a trainer that does all the work), the model FLOPs of the planned step
(`training.flops.step_flops`: the work the step does, never more) and MFU against the
peak the trainer uses (`training.flops.peak_flops`: nominal for known chips, else a
measured matmul peak cached per machine), times the devices. The peak RSS is this
process's `ru_maxrss`. The last line is one JSON object.
"""

import argparse
import dataclasses
import json
import resource
import statistics
import tempfile
import time

import jax
import numpy as np

import tunix_kernels
from tunix_core import model as model_lib
from tunix_core.data import packing
from tunix_core.training import config as config_lib
from tunix_core.training import flops
from tunix_core.training import plan as plan_lib
from tunix_core.training import step as step_lib


def padded_pairs(rng, pairs, prompt_len, response_len, vocab):
  """A `[B, 2, T]` pair batch with the peer benchmark's padding (module docstring), in
  the trainer's row layout: prompt then response, padding masked out of attention and
  loss (the left padding of a prompt sits before its first token)."""
  T = prompt_len + response_len
  batch = {k: np.zeros((pairs, 2, T), np.int32) for k in ("tokens", "attention_mask",
                                                           "loss_mask")}
  batch["targets"] = np.full((pairs, 2, T), tunix_kernels.IGNORE_INDEX, np.int32)
  for b in range(pairs):
    left = prompt_len // 4 if b % 2 == 0 else 0
    prompt = rng.integers(1, vocab, prompt_len - left)
    real = [3 * response_len // 4, response_len // 2 if b % 2 == 0 else response_len]
    for r, n in enumerate(real):
      row = np.concatenate([prompt, rng.integers(1, vocab, n)])
      start, end = left, left + row.size
      batch["tokens"][b, r, start:end] = row
      batch["attention_mask"][b, r, start:end] = 1
      # Position t predicts token t + 1; the response's tokens are scored (its last
      # real position has no next token here: the response is cut, not ended).
      batch["targets"][b, r, start:end - 1] = row[1:]
      batch["loss_mask"][b, r, left + prompt.size - 1:end - 1] = 1
      batch["targets"][b, r] = np.where(batch["loss_mask"][b, r] > 0, batch["targets"][b, r],
                                        tunix_kernels.IGNORE_INDEX)
  return batch


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--num_kv_heads", type=int, default=2)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--mlp_dim", type=int, default=1024)
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--pairs", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=128)
  p.add_argument("--response_len", type=int, default=128)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--logprob_impl", default=config_lib.TrainConfig.logprob_impl)
  for name in ("prefix_sharing", "packing"):
    p.add_argument(f"--{name}", default=str(getattr(config_lib.TrainConfig, name)).lower(),
                   choices=["true", "false"])
  args = p.parse_args()
  on = lambda name: getattr(args, name) == "true"

  mcfg = model_lib.ModelConfig(vocab_size=args.vocab, d_model=args.d_model,
                               num_layers=args.layers, num_heads=args.num_heads,
                               num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                               mlp_dim=args.mlp_dim)
  T = args.prompt_len + args.response_len
  cfg = config_lib.TrainConfig(output_dir=tempfile.mkdtemp(), train_data="", steps=args.steps,
                               batch_size=args.pairs, logprob_impl=args.logprob_impl,
                               max_length=T, max_prompt_length=args.prompt_len,
                               prefix_sharing=on("prefix_sharing"), packing=on("packing"))
  host_batch = padded_pairs(np.random.default_rng(0), args.pairs, args.prompt_len,
                            args.response_len, args.vocab)
  devices = jax.devices()
  plan = plan_lib.make_plan(dataclasses.replace(cfg, compile_only=True), devices,
                            packing.pair_sizes(host_batch, cfg.prefix_sharing),
                            model_config=mcfg)
  steps = step_lib.make_steps(plan, devices)
  state = steps.init_state(jax.random.PRNGKey(0))
  ref_params = jax.tree.map(lambda x: x.copy(), state["params"])
  batch = steps.put_batch(host_batch)

  t0 = time.perf_counter()
  state, metrics = steps.train_step(state, ref_params, batch)
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    state, metrics = steps.train_step(state, ref_params, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  peak = flops.peak_flops(devices[0], model_lib.DTYPES[mcfg.compute_dtype])[0] * len(devices)
  step_flops = flops.step_flops(plan, tunix_kernels.tpu.target_chip())
  tokens = 2 * args.pairs * T
  result = {"tokens_per_sec": tokens / step_s, "mfu": step_flops / step_s / peak,
            "median_step_s": step_s, "step_flops": step_flops, "peak_flops": peak,
            "compile_s": compile_s, "devices": len(devices), "platform": devices[0].platform,
            "logprob_impl": args.logprob_impl, "plan": plan.describe(),
            "loss": float(metrics["loss"]),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  print(plan.describe())
  print(f"{tokens / step_s:,.0f} tokens/s, {step_flops / 1e9:.2f} GFLOP per step, MFU "
        f"{result['mfu']:.1%} of {peak / 1e9:.1f} GFLOP/s (median of {args.steps} steps "
        f"after a {compile_s:.1f} s compile; peak RSS {result['peak_rss_mib']:.0f} MiB)")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
