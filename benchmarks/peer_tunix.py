"""Peer benchmark: Tunix 0.1.7's own DPO train step on the pairs and sizes of
`benchmarks/gpu.py ours`, one case per process, one JSON row appended to `--out` that
`gpu.py table` sets beside ours (same real tokens, same MFU count, same chip).

On the TPU chip (through benchmarks/on_chip.sh, which installs Tunix from the wheels of
../shared/offline-tpu/wheels.txt carried in .whl-tpu/ and appends to the step part's file):

    PARTS=tunix TUNIX_CASES="smollm2-135m 1024; qwen2.5-0.5b 1024 --remat=block" \\
        OUT=DIR bash benchmarks/on_chip.sh          # rows in DIR/step.jsonl, table printed

On a CPU host (a dry run, in its own virtualenv: Tunix pins its own jax / flax):

    python3.11 -m venv /work/tunix_venv
    /work/tunix_venv/bin/pip install google-tunix==0.1.7 'jax==0.10.2'
    /work/tunix_venv/bin/python benchmarks/peer_tunix.py --model tiny --tokens 64 --pairs 2 \\
        --steps 2 --warmup 1 --out /tmp/peer.jsonl [--remat block]
    python benchmarks/gpu.py table /tmp/peer.jsonl   # with our package importable

Flags: --model (gpu.MODELS), --tokens L (1024), --pairs (8), --steps (6), --warmup (2),
--remat none|block|decoder (Tunix's `ModelConfig.remat_config`: BLOCK rematerialises each
layer's attention block and MLP block, DECODER the whole layer), --param_dtype bfloat16|float32
(bfloat16: float32 params of SmolLM2-135M at 1,024 tokens and 8 pairs need 26.5 GiB of
temporaries in Tunix's step, more than a 16 GiB v5e chip), --cache_dir (JAX's persistent
compilation cache, every entry kept), --out (the JSONL it appends to), --fused (Tunix's
policy and reference log-probs served by `tunix_kernels`: `benchmarks/tunix_fused.py`;
the row's side says "+ tunix_kernels"), --fused_attention (with --fused, Tunix's Llama 3
attention too); the row keeps every step's loss.

Model: `tunix.models.qwen2.model.Qwen2` for a Qwen2 config (q/k/v biases, its `dtype` and
`param_dtype` set to --param_dtype so it computes in that dtype as the Llama model does), else
`tunix.models.llama3.model.Llama3`, built from its `ModelConfig` at the config's sizes
(layers, d_model, heads, KV heads, head_dim (hidden / heads when absent), MLP dim, vocabulary,
rope_theta, norm eps) with a tied head where the config ties it (`weight_tying=True` /
`use_tied_embedding=True`), randomly initialised by Tunix (`nnx.Rngs(0)`). Tunix initialises
its MLP kernels to zeros (the gradients would be degenerate) and Qwen2's embedding at N(0, 1)
(logits of std ~30 through the tied head, and a first loss far from log 2 in bfloat16); the
MLP kernels and the embedding are refilled with N(0, 0.02) (no shape and no work changes).
With bfloat16, every float leaf of `nnx.state(model)` is then cast to bfloat16 (the Llama
model has no param dtype of its own); the AdamW state follows the params. The reference is
`nnx.clone` of that initial policy. The row's `peer_model` names the class used.

Trainer: `tunix.sft.dpo.dpo_trainer.DPOTrainer(policy, reference, optax.adamw(1e-5),
DPOTrainingConfig(algorithm="dpo", beta=0.1, label_smoothing=0.0))`: Tunix's sigmoid DPO
loss with the reference forward in every step, on one device, no mesh.

Pairs: `gpu.synthetic_pairs(pairs, tokens, vocab)` (prompts and responses of L/4 to L/2 ids),
as Tunix's tokenized `dpo_trainer.TrainingInput`: prompt_ids / prompt_mask left-padded to L/2,
chosen and rejected ids / masks right-padded to L/2, pad id 0, int32; so each of Tunix's rows
is L wide and holds exactly the ids of ours (`gpu.real_tokens`, checked against the masks).

One step: the per-step work of `PeftTrainer.train()` minus its bookkeeping, called directly:
`trainer._prepare_inputs(batch)` (Tunix's concatenation of chosen and rejected rows, causal
mask, positions and the reference forward, `dpo_trainer.compute_logps`) and the jitted train
step of `trainer.jit_train_and_eval_step(cache_nnx_graph=True)` (value_and_grad of
`dpo_loss_fn`, the global grad norm, the AdamW update), then `jax.block_until_ready` on the
loss, metrics, grad norm and updated params. The first step compiles (`first_step_s`), then
`--warmup` untimed steps, then `step_s` = the median of `--steps` timed steps. Peak:
`memory_stats()['peak_bytes_in_use']` of the device (run with
`XLA_PYTHON_CLIENT_PREALLOCATE=false`; none on CPU). A failure appends a row with `error`
(as gpu.py does) and re-raises.
"""

import argparse
import importlib.metadata
import logging
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu  # pylint: disable=g-import-not-at-top,wrong-import-position  (benchmarks/gpu.py)


def tunix_version() -> str:
  try:
    return importlib.metadata.version("google-tunix")
  except importlib.metadata.PackageNotFoundError:
    return "?"


def training_input(pairs, tokens: int):
  """`pairs` as host arrays of Tunix's `TrainingInput` (module docstring); pad id 0."""
  width = tokens // 2
  n = len(pairs)
  out = {f"{name}_{kind}": np.zeros((n, width), np.int32)
         for name in ("prompt", "chosen", "rejected") for kind in ("ids", "mask")}
  for b, (prompt, chosen, rejected) in enumerate(pairs):
    if max(len(prompt), len(chosen), len(rejected)) > width:
      raise ValueError(f"pair {b} is longer than L/2 = {width}")
    out["prompt_ids"][b, width - len(prompt):] = prompt  # left-padded
    out["prompt_mask"][b, width - len(prompt):] = 1
    for name, ids in (("chosen", chosen), ("rejected", rejected)):  # right-padded
      out[f"{name}_ids"][b, :len(ids)] = ids
      out[f"{name}_mask"][b, :len(ids)] = 1
  seen = int(2 * out["prompt_mask"].sum() + out["chosen_mask"].sum()
             + out["rejected_mask"].sum())
  if seen != gpu.real_tokens(pairs):
    raise RuntimeError(f"Tunix's masks hold {seen} ids, the pairs {gpu.real_tokens(pairs)}")
  return out


def build_model(config: dict, remat: str, param_dtype: str):
  """`(policy, class path)`: Tunix's model at `config`'s sizes (module docstring)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  dtype = jnp.dtype(param_dtype)
  sizes = dict(num_layers=config["num_hidden_layers"], vocab_size=config["vocab_size"],
               embed_dim=config["hidden_size"], hidden_dim=config["intermediate_size"],
               num_heads=config["num_attention_heads"],
               head_dim=config.get("head_dim",
                                   config["hidden_size"] // config["num_attention_heads"]),
               num_kv_heads=config["num_key_value_heads"],
               rope_theta=int(config["rope_theta"]), norm_eps=config["rms_norm_eps"])
  tied = bool(config.get("tie_word_embeddings", False))
  lib = None
  if config.get("model_type") == "qwen2":
    try:
      from tunix.models.qwen2 import model as lib  # pylint: disable=g-import-not-at-top
    except ImportError:  # a Tunix without Qwen2: Llama 3 stands in
      lib = None
  if lib is not None:
    mcfg = lib.ModelConfig(**sizes, use_tied_embedding=tied,
                           remat_config=lib.RematConfig[remat.upper()], dtype=dtype,
                           param_dtype=dtype)
    model = lib.Qwen2(mcfg, rngs=nnx.Rngs(0))
  else:
    from tunix.models.llama3 import model as lib  # pylint: disable=g-import-not-at-top
    mcfg = lib.ModelConfig(**sizes, weight_tying=tied,
                           remat_config=lib.RematConfig[remat.upper()])
    model = lib.Llama3(mcfg, rngs=nnx.Rngs(0))
  # Tunix's MLP kernels start at zero and its Qwen2 embedding at N(0, 1) (logits of std
  # ~30 through the tied head): all of them N(0, 0.02) instead (same shapes, same work).
  key = jax.random.PRNGKey(1)
  for layer in model.layers:
    for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
      key, sub = jax.random.split(key)
      old = proj.kernel[...]
      proj.kernel[...] = 0.02 * jax.random.normal(sub, old.shape, old.dtype)
  table = model.embedder.input_embedding
  table[...] = 0.02 * jax.random.normal(key, table[...].shape, table[...].dtype)
  state = nnx.state(model)
  nnx.update(model, jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state))
  return model, f"{lib.__name__}.{type(model).__name__}"


def run(a, config: dict, pairs) -> dict:
  """Tunix's DPO step (module docstring): the measured part of the row."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tunix.sft.dpo import dpo_trainer  # pylint: disable=g-import-not-at-top

  if a.fused:
    import tunix_fused  # pylint: disable=g-import-not-at-top  (beside this script)
    tunix_fused.install(attention=a.fused_attention)
  compiles = gpu.CompileLog()
  logging.getLogger("jax").addHandler(compiles)
  jax.config.update("jax_log_compiles", True)
  if a.cache_dir:
    jax.config.update("jax_compilation_cache_dir", a.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  imported = gpu.process_age()
  t_build = time.perf_counter()
  device = jax.devices()[0]
  policy, peer_model = build_model(config, a.remat, a.param_dtype)
  reference = nnx.clone(policy)
  trainer = dpo_trainer.DPOTrainer(
      policy, reference, optax.adamw(1e-5),
      dpo_trainer.DPOTrainingConfig(eval_every_n_steps=10**9, max_steps=None,
                                    algorithm="dpo", beta=0.1, label_smoothing=0.0))
  train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)
  batch = dpo_trainer.TrainingInput(
      **{k: jnp.asarray(v) for k, v in training_input(pairs, a.tokens).items()})
  jax.block_until_ready((batch, nnx.state(trainer.model), nnx.state(reference)))
  t_init = time.perf_counter()
  print(f"built {peer_model} ({a.param_dtype} params, remat {a.remat}) and the trainer in "
        f"{t_init - t_build:.1f} s", file=sys.stderr, flush=True)

  def one_step():
    example = trainer._prepare_inputs(batch)  # pylint: disable=protected-access
    loss, aux, grad_norm = train_step(example)
    jax.block_until_ready((loss, aux, grad_norm, nnx.state(trainer.model, nnx.Param)))
    return float(loss)

  times, losses = [], []
  for i in range(1 + a.warmup + a.steps):
    t0 = time.perf_counter()
    losses.append(one_step())
    times.append(time.perf_counter() - t0)
    if i == 0:
      step1_at = gpu.process_age()
    print(f"step {i}: {times[-1]:.3f} s, loss {losses[-1]:.9f}", file=sys.stderr, flush=True)
  stats = device.memory_stats() or {}
  version = tunix_version()
  temps = None
  try:  # the train step's compiled temporaries (the persistent cache serves the compile)
    lowered = nnx.jit(trainer.create_train_step_fn(), donate_argnames=("optimizer",)).lower(
        trainer.model, trainer.optimizer, trainer._prepare_inputs(batch))  # pylint: disable=protected-access
    temps = lowered.compile().memory_analysis().temp_size_in_bytes
  except Exception as e:  # pylint: disable=broad-except  (a figure less, not a failure)
    print(f"no memory analysis: {type(e).__name__}: {e}"[:200], file=sys.stderr)
  return dict(first_step_s=times[0], step_s=statistics.median(times[1 + a.warmup:]),
              peak_bytes=stats.get("peak_bytes_in_use"), memory_stats=stats,
              train_step_temp_bytes=temps, losses=losses,
              device=device.device_kind, loss=losses[-1], first_loss=losses[0], last_loss=losses[-1],
              peer_model=peer_model, param_dtype=a.param_dtype, remat=a.remat,
              framework=f"jax {jax.__version__}, tunix {version}",
              jax_version=jax.__version__, tunix_version=version,
              platform_version=getattr(device.client, "platform_version", None),
              startup=dict(imports_s=round(imported, 2), init_s=round(t_init - t_build, 2),
                           process_start_to_step1_end_s=round(step1_at, 2),
                           cache_dir=a.cache_dir, compiles=compiles.times))


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", choices=sorted(gpu.MODELS), default="smollm2-135m")
  p.add_argument("--tokens", type=int, default=1024, help="L: the longest row of a pair")
  p.add_argument("--pairs", type=int, default=8, help="pairs per step")
  p.add_argument("--steps", type=int, default=6, help="timed steps after the warm-up")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
  p.add_argument("--remat", choices=("none", "block", "decoder"), default="none",
                 help="Tunix's ModelConfig.remat_config")
  p.add_argument("--param_dtype", choices=("bfloat16", "float32"), default="bfloat16")
  p.add_argument("--cache_dir", help="JAX's persistent compilation cache (unset: JAX's own "
                 "setting)")
  p.add_argument("--out", default="gpu_results.jsonl", help="JSONL the case appends to")
  p.add_argument("--fused", action="store_true", help="Tunix's log-probs from tunix_kernels "
                 "(benchmarks/tunix_fused.py)")
  p.add_argument("--fused_attention", action="store_true", help="with --fused: Tunix's "
                 "Llama 3 attention from tunix_kernels too")
  a = p.parse_args()
  if a.steps < 1 or a.warmup < 0 or a.tokens % 2:
    p.error("--steps >= 1, --warmup >= 0 and an even --tokens")
  config = gpu.MODELS[a.model]
  pairs = gpu.synthetic_pairs(a.pairs, a.tokens, config["vocab_size"])
  side = (f"tunix {tunix_version()}" + (f" --remat={a.remat}" if a.remat != "none" else "")
          + (f" {a.param_dtype}" if a.param_dtype != "bfloat16" else "")
          + (" + tunix_kernels" if a.fused else "")
          + (" (log-probs and attention)" if a.fused and a.fused_attention else ""))
  case = dict(model=a.model, tokens=a.tokens, pairs=a.pairs, side=side)
  append = gpu._append  # pylint: disable=protected-access  (gpu.py's row writer)
  try:
    measured = run(a, config, pairs)
  except Exception as e:  # pylint: disable=broad-except  (the table says what failed)
    first = (str(e).strip().splitlines() or [""])[0][:160]
    append(a.out, dict(case, error=f"{type(e).__name__}: {first}"))
    raise
  append(a.out, dict(case, real_tokens=gpu.real_tokens(pairs), steps=a.steps, **measured))
  return 0


if __name__ == "__main__":
  sys.exit(main())
