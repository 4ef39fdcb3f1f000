"""Peer benchmark: speed of the Tunix library's own DPO train step, for comparison with ours.

Runs in its own virtualenv, not the project's (Tunix pins its own jax / flax):

    python3.11 -m venv /work/tunix_venv
    /work/tunix_venv/bin/pip install google-tunix==0.1.7      # pulls a CPU jax, no torch
    /work/tunix_venv/bin/python benchmarks/peer_tunix.py --steps 10

    flags (defaults): --layers 4 --d_model 256 --num_heads 4 --num_kv_heads 2 --head_dim 64
        --mlp_dim 1024 --vocab 32000 --pairs 8 --prompt_len 128 --response_len 128 --steps 10
        [--train_loop]   (also time Tunix's public `train()` loop, see below)

Model: `tunix.models.llama3.model.Llama3` built from its `ModelConfig` with the flags' shapes
(untied head, float32, no remat), randomly initialised through flax nnx (`nnx.Rngs(0)`).
Tunix initialises its MLP kernels to zeros; those are refilled with N(0, 0.02) noise so the
gradients are not degenerate (this changes no shape and no amount of work). The reference model
is a second, independent copy (`nnx.clone`) of the initial policy.

Trainer: `tunix.sft.dpo.dpo_trainer.DPOTrainer(policy, ref_model, optax.adamw(1e-5),
DPOTrainingConfig(algorithm="dpo", beta=0.1, label_smoothing=0.0))`, i.e. Tunix's sigmoid DPO
loss with an in-step reference model.

Pairs (same padding as `benchmarks/dpo_step.py`): one prompt of `prompt_len` tokens shared by
both responses, left-padded by `prompt_len / 4` on pairs 0, 2, 4, ...; chosen responses real for
their first `3 * response_len / 4` tokens (right-padded after); rejected ones real for the first
`response_len / 2` tokens on the even pairs and full length on the odd ones. They are fed as
Tunix's tokenized `dpo_trainer.TrainingInput` (left-padded prompt_ids / prompt_mask, right-padded
chosen_ids / chosen_mask and rejected_ids / rejected_mask; pad id 0, int32 masks).

What one timed step is: exactly the per-step work of `PeftTrainer.train()` minus its
bookkeeping, called directly so each step can be timed alone:
  1. `trainer._prepare_inputs(training_input)`: Tunix's DPO preprocessing (concatenating chosen
     and rejected rows, causal/padding attention mask, positions) and the reference model's
     forward pass (`dpo_trainer.compute_logps`, nnx.jit), and
  2. the jitted train step returned by `trainer.jit_train_and_eval_step(cache_nnx_graph=True)`
     (the function `train()` itself uses): `PeftTrainer._train_step` = `nnx.value_and_grad` of
     `dpo_loss_fn` over the policy, the global grad norm and the `nnx.Optimizer` AdamW update,
then `jax.block_until_ready` on the loss, aux metrics, grad norm and the updated parameters.
One untimed warm-up step compiles everything first. The median of `--steps` timed steps is
reported; tokens_per_sec = pairs * 2 * (prompt_len + response_len) / median step time (whole
rows, padding included, as in our benchmark). With `--train_loop`, Tunix's public
`trainer.train()` is then also run for `--steps` more steps and its mean wall time per step
(which lets up to two steps overlap and adds Tunix's metric logging) is reported as
`train_loop_step_s`.

The last printed line is one JSON object with tokens_per_sec, median_step_s, peak_rss_mib
(ru_maxrss of this process, MiB), steps, tunix_version and jax_version (plus a few extras).
"""

import argparse
import importlib.metadata
import json
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tunix.models.llama3 import model as llama3_lib
from tunix.sft.dpo import dpo_trainer


def build_model(args):
  config = llama3_lib.ModelConfig(
      num_layers=args.layers, vocab_size=args.vocab, embed_dim=args.d_model,
      hidden_dim=args.mlp_dim, num_heads=args.num_heads, head_dim=args.head_dim,
      num_kv_heads=args.num_kv_heads, rope_theta=500_000, norm_eps=1e-5,
      weight_tying=False)
  model = llama3_lib.Llama3(config, rngs=nnx.Rngs(0))
  # Tunix's MLP kernels start at zero; give them random values instead (same shapes).
  key = jax.random.PRNGKey(1)
  for layer in model.layers:
    for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
      key, sub = jax.random.split(key)
      old = proj.kernel[...]
      proj.kernel[...] = 0.02 * jax.random.normal(sub, old.shape, old.dtype)
  return model


def padded_pairs(rng, pairs, prompt_len, response_len, vocab):
  """Tunix's tokenized DPO input with the benchmark's padding (module docstring); pad id 0."""
  prompt_ids = np.zeros((pairs, prompt_len), np.int32)
  prompt_mask = np.zeros((pairs, prompt_len), np.int32)
  out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
  for name in ("chosen", "rejected"):
    out[f"{name}_ids"] = np.zeros((pairs, response_len), np.int32)
    out[f"{name}_mask"] = np.zeros((pairs, response_len), np.int32)
  for b in range(pairs):
    left = prompt_len // 4 if b % 2 == 0 else 0
    prompt_ids[b, left:] = rng.integers(1, vocab, prompt_len - left)
    prompt_mask[b, left:] = 1
    real = {"chosen": 3 * response_len // 4,
            "rejected": response_len // 2 if b % 2 == 0 else response_len}
    for name, n in real.items():
      out[f"{name}_ids"][b, :n] = rng.integers(1, vocab, n)
      out[f"{name}_mask"][b, :n] = 1
  return dpo_trainer.TrainingInput(**{k: jnp.asarray(v) for k, v in out.items()})


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
  p.add_argument("--train_loop", action="store_true",
                 help="also time Tunix's public train() loop for --steps more steps")
  args = p.parse_args()

  policy = build_model(args)
  reference = nnx.clone(policy)
  config = dpo_trainer.DPOTrainingConfig(
      eval_every_n_steps=10**9, max_steps=None, algorithm="dpo", beta=0.1,
      label_smoothing=0.0)
  trainer = dpo_trainer.DPOTrainer(policy, reference, optax.adamw(1e-5), config)
  train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
  batch = padded_pairs(np.random.default_rng(0), args.pairs, args.prompt_len,
                       args.response_len, args.vocab)
  jax.block_until_ready(batch)

  def one_step():
    example = trainer._prepare_inputs(batch)  # Tunix's preprocessing + reference forward
    loss, aux, grad_norm = train_step(example)  # Tunix's loss, grad and AdamW update
    jax.block_until_ready((loss, aux, grad_norm, nnx.state(trainer.model, nnx.Param)))
    return loss, aux

  t0 = time.perf_counter()
  loss0, _ = one_step()
  compile_s = time.perf_counter() - t0
  times = []
  for i in range(args.steps):
    t0 = time.perf_counter()
    loss, aux = one_step()
    times.append(time.perf_counter() - t0)
    print(f"step {i}: {times[-1]:.3f} s, loss {float(loss):.6f}", file=sys.stderr)
  step_s = statistics.median(times)
  tokens = args.pairs * 2 * (args.prompt_len + args.response_len)

  result = {
      "tokens_per_sec": tokens / step_s,
      "median_step_s": step_s,
      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      "steps": args.steps,
      "tunix_version": importlib.metadata.version("google-tunix"),
      "jax_version": jax.__version__,
      "compile_s": compile_s,
      "tokens_per_step": tokens,
      "platform": jax.devices()[0].platform,
      "devices": len(jax.devices()),
      "first_loss": float(loss0),
      "last_loss": float(loss),
  }

  if args.train_loop:
    trainer.config.max_steps = trainer.train_steps + args.steps
    t0 = time.perf_counter()
    trainer.train([batch] * args.steps)
    jax.block_until_ready(nnx.state(trainer.model, nnx.Param))
    result["train_loop_step_s"] = (time.perf_counter() - t0) / args.steps
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

  print(f"Tunix {result['tunix_version']} DPO step: {tokens / step_s:,.0f} tokens/s "
        f"(median of {args.steps} steps, {step_s:.3f} s/step, after a {compile_s:.1f} s "
        f"warm-up), peak RSS {result['peak_rss_mib']:.0f} MiB")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
