"""Our DPO step against TRL 1.16's `DPOTrainer` on one GPU: step time, real tokens/s, MFU
and the allocator's peak, one case per process (`benchmarks/gpu.sh` runs them all).

    python benchmarks/gpu.py ours --model smollm2-135m --tokens 1024 --out results.jsonl
    python benchmarks/gpu.py trl --model smollm2-135m --tokens 1024 [--liger] --out ...
    python benchmarks/gpu.py table results.jsonl

Both sides train the same model (random weights of the real shapes: `MODELS`, written as
an HF `config.json`) on the same synthetic pairs (`synthetic_pairs`): a prompt of L/4 to
L/2 tokens, chosen and rejected responses of L/4 to L/2 tokens each ending in EOS, so
each of TRL's two rows per pair holds at most L = `--tokens` ids and nothing is cut.
TRL reads them as text through a word-level tokenizer (one word per id), so it
tokenizes to exactly these ids.

- ours: the trainer's step with its default flags (`--reference=step`, prefix sharing,
  `--compute_dtype=auto`: bfloat16 on GPU, float32 params and AdamW), planned from the
  batch as the trainer plans from its data; each timed iteration puts the batch and
  waits for the metrics. Peak: `jax.Device.memory_stats()['peak_bytes_in_use']` (run
  with `XLA_PYTHON_CLIENT_PREALLOCATE=false`).
- trl: `DPOTrainer` with TRL's defaults (bf16 autocast over float32 params, gradient
  checkpointing, its chunked fused LM head, the reference a frozen in-step copy);
  `--liger` adds `use_liger_kernel=True` (in TRL 1.16: Liger's RMSNorm, RoPE and SwiGLU
  kernels). Peak: `torch.cuda.max_memory_allocated()`.

Step time: the median interval between consecutive step ends after `--warmup` steps.
Real tokens: the ids of both rows of every pair (prompt twice), padding excluded, the
same count for both sides. MFU (`table`): the model FLOPs of DPO on these rows as TRL
computes them (policy forward + backward and the reference forward over both full rows,
causal attention, the LM head at every position; `training.flops.forward_flops`), one
count for both sides, over the device's dense bf16 peak (`training.flops.PEAK_FLOPS`).
Each case appends one JSON line to `--out` as soon as it is measured.
"""

import argparse
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

# config.json of each model: random weights of these shapes. Llama-3.2-1B's llama3 rope
# scaling is left out: it changes no shape and no cost.
_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
              tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=1,
              max_position_embeddings=8192)
MODELS = {
    "smollm2-135m": dict(_LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, rope_theta=100000.0),
    "smollm2-360m": dict(_LLAMA, vocab_size=49152, hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         head_dim=64, rope_theta=100000.0),
    # Qwen2.5-0.5B's config.json (Qwen2: biases on q, k and v; a tied 151,936-word head).
    "qwen2.5-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                         hidden_act="silu", tie_word_embeddings=True, rms_norm_eps=1e-6,
                         bos_token_id=151643, eos_token_id=151643,
                         max_position_embeddings=32768, use_sliding_window=False,
                         sliding_window=32768, max_window_layers=24, vocab_size=151936,
                         hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2,
                         rope_theta=1000000.0),
    "qwen2.5-1.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                         hidden_act="silu", tie_word_embeddings=True, rms_norm_eps=1e-6,
                         bos_token_id=151643, eos_token_id=151643,
                         max_position_embeddings=32768, use_sliding_window=False,
                         sliding_window=32768, max_window_layers=28, vocab_size=151936,
                         hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2,
                         rope_theta=1000000.0),
    "llama3-8b": dict(_LLAMA, tie_word_embeddings=False, vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, rope_theta=500000.0),
    "llama3-70b": dict(_LLAMA, tie_word_embeddings=False, vocab_size=128256,
                       hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                       rope_theta=500000.0),
    "llama3.2-1b": dict(_LLAMA, vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, rope_theta=500000.0),
    "tiny": dict(_LLAMA, vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, rope_theta=10000.0),    # the CPU dry run
}
EOS = 1       # the word-level tokenizer's "</s>"; id 0 pads
WORDS = 4096  # ids are drawn below min(WORDS, vocab)


def synthetic_pairs(n: int, tokens: int, vocab: int, seed: int = 0) -> list[tuple]:
  """`n` pairs `(prompt, chosen, rejected)` of id lists (module docstring)."""
  rng = np.random.default_rng(seed)
  hi = min(WORDS, vocab)
  size = lambda: int(rng.integers(tokens // 4, tokens // 2 + 1))
  out = []
  for _ in range(n):
    prompt = rng.integers(2, hi, size()).tolist()
    chosen, rejected = (rng.integers(2, hi, size() - 1).tolist() + [EOS] for _ in range(2))
    out.append((prompt, chosen, rejected))
  return out


def real_tokens(pairs) -> int:
  """Ids of both rows of every pair: `2 prompt + chosen + rejected`."""
  return sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs)


def dpo_flops(config: dict, pairs, reference: str = "step", lora: bool = False) -> float:
  """Model FLOPs of one DPO step on `pairs` as TRL computes them (module docstring):
  4 forwards' worth, one fewer without the reference's forward in the step
  (`--reference=precomputed`) and one fewer under LoRA (a frozen base's backward
  computes no weight gradients)."""
  from tunix_core.hf import config as hf_config  # pylint: disable=g-import-not-at-top
  from tunix_core.training import flops  # pylint: disable=g-import-not-at-top
  mcfg = hf_config.model_config(config)
  rows = [len(p) + len(r) for p, c, rr in pairs for r in (c, rr)]
  # A causal row of t positions scores (t + 1) / 2 keys per position on average.
  passes = 4 - (reference != "step") - bool(lora)
  return passes * sum(flops.forward_flops(mcfg, t, (t + 1) / 2, t) for t in rows)


def _append(path: str, row: dict) -> None:
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(row) + "\n")
  print(json.dumps(row), flush=True)


def _median_interval(ends: list[float], warmup: int) -> float:
  return statistics.median(np.diff(ends[warmup:]).tolist())


def ours_plan(a, config: dict, pairs, devices):
  """`(plan, host batch)` of our trainer's step on `pairs` (module docstring), planned
  from the batch as the trainer plans from its data."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from tunix_core.data import encode  # pylint: disable=g-import-not-at-top
  from tunix_core.data import packing  # pylint: disable=g-import-not-at-top
  from tunix_core.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.training import fit  # pylint: disable=g-import-not-at-top
  from tunix_core.training import plan as plan_lib  # pylint: disable=g-import-not-at-top

  T, P = a.tokens, a.tokens // 2
  host = {k: np.zeros((a.pairs, 2, T), np.int32) for k in ("tokens", "targets", "loss_mask",
                                                           "attention_mask")}
  for b, (prompt, *responses) in enumerate(pairs):
    for r, response in enumerate(responses):
      tokens, targets, loss_mask = encode.build_row([], prompt, response, 0, T, P)
      host["tokens"][b, r], host["targets"][b, r], host["loss_mask"][b, r] = (
          tokens, targets, loss_mask)
      host["attention_mask"][b, r, :len(prompt) + len(response) - 1] = 1
  model_dir = tempfile.mkdtemp()
  with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump(config, f)
  cfg = config_lib.TrainConfig(output_dir=tempfile.mkdtemp(), train_data="",
                               hf_model_dir=model_dir, batch_size=a.pairs, max_length=T,
                               max_prompt_length=P, steps=a.warmup + a.steps,
                               reference=a.reference, remat=a.remat,
                               param_dtype=a.param_dtype, optimizer_dtype=a.optimizer_dtype,
                               param_rounding=a.param_rounding, lora_rank=a.lora_rank,
                               quantize_base=a.quantize_base,
                               offload_optimizer=a.offload_optimizer)
  cfg = dataclasses.replace(cfg, compile_only=True)
  sizes = packing.pair_sizes(host, cfg.prefix_sharing)
  plan = plan_lib.make_plan(cfg, devices, sizes)
  # As the trainer: what --remat / --grad_accum_steps=auto take (`training.fit`).
  fitted = lambda steps, say: fit.fit_steps(cfg, plan, steps, devices, sizes, say)
  return plan, host, fitted


def aot_ours(a, config: dict, pairs) -> dict:
  """The same step compiled ahead of time for one chip of `--aot` (a TPU generation):
  what the compiler says it needs, to set beside the allocator's peak on that chip."""
  from tunix_core.aot import compile as aot  # pylint: disable=g-import-not-at-top
  chip, devices = aot.target_devices(f"{a.aot}-1")
  plan, _, _ = ours_plan(a, config, pairs, devices[:1])
  stats = aot.compile_stats(plan, chip, devices[:1])
  if stats["error"]:
    raise RuntimeError(stats["error"])
  return dict(device=f"{a.aot} (ahead of time)", plan=plan.describe(),
              **{k: stats[k] for k in ("argument", "output", "alias", "temp", "peak", "hbm",
                                       "need")})


def process_age() -> float:
  """Seconds since this process started, by the kernel's clock (Linux `/proc`)."""
  with open("/proc/self/stat") as f:
    started_ticks = int(f.read().rpartition(")")[2].split()[19])
  with open("/proc/uptime") as f:
    return float(f.read().split()[0]) - started_ticks / os.sysconf("SC_CLK_TCK")


class CompileLog(logging.Handler):
  """`jax_log_compiles`' lines as `(what, seconds)`: each jitted function's trace,
  lowering and XLA compile (or cache load), in order."""
  _LINE = re.compile(r"Finished (.+?) in ([0-9.]+) sec")

  def __init__(self):
    super().__init__()
    self.times = []

  def emit(self, record):
    m = self._LINE.search(record.getMessage())
    if m and float(m.group(2)) >= 0.1:  # the dozens of tiny ones add nothing to read
      self.times.append((m.group(1)[:90], round(float(m.group(2)), 2)))


def run_ours(a, config: dict, pairs) -> dict:
  """Our trainer's DPO step (module docstring); with `--cache_dir`, through the trainer's
  compilation cache, timing the start-up from the process's start by its own clock."""
  import jax  # pylint: disable=g-import-not-at-top
  timeline = [("jax imported", process_age())]  # seconds since the process started
  # The chip opens on a thread from here, as the trainer's does once its job is known
  # (`run.distributed.start_backend`): the imports and the plan overlap libtpu's start.
  threading.Thread(target=jax.devices, daemon=True).start()
  from tunix_core.run import compile_cache  # pylint: disable=g-import-not-at-top
  from tunix_core.run import loop as train_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.training import executables  # pylint: disable=g-import-not-at-top
  from tunix_core.training import step as step_lib  # pylint: disable=g-import-not-at-top

  timeline.append(("imported", process_age()))
  compiles = CompileLog()
  logging.getLogger("jax").addHandler(compiles)
  jax.config.update("jax_log_compiles", True)
  if a.cache_dir is not None:
    compile_cache.enable(a.cache_dir, "", lambda line: print(line, file=sys.stderr))
  timeline.append(("cache enabled", process_age()))
  devices = jax.devices()[:1]
  t_plan = time.perf_counter()
  imported = process_age()
  timeline.append(("chip open", imported))
  plan, host, fitted = ours_plan(a, config, pairs, devices)
  steps = step_lib.make_steps(plan, devices)
  timeline.append(("planned", process_age()))
  say = lambda line: print(line, file=sys.stderr)
  warmup = compile_cache.Warmup(  # as the trainer: what is auto chosen on the thread
      lambda chosen: executables.compile_step(chosen, executables.store_dir(devices), say),
      choose=lambda: fitted(steps, say))
  state = steps.init_state(jax.random.PRNGKey(0))
  timeline.append(("params initialised", process_age()))
  if plan.lora is not None:  # the frozen base (QLoRA: quantized layer by layer)
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    frozen = {"base": steps.init_base(jax.random.PRNGKey(1), jnp.dtype(plan.ref_dtype))}
  else:
    frozen = (train_lib.frozen_copy(state["params"], plan.ref_dtype)
              if plan.reference == "step" else None)  # as the trainer
  jax.block_until_ready((state, frozen))
  t_init = time.perf_counter()
  timeline.append(("reference copied", process_age()))
  compiled = warmup.describe("step 1")
  steps = warmup.choice()
  plan = steps.plan
  t0 = time.perf_counter()
  timeline.append(("step compiled", process_age()))
  print(f"planned and initialised in {t_init - t_plan:.1f} s: {plan.describe()}\n{compiled}",
        file=sys.stderr, flush=True)
  train_step = executables.TrainStep(steps, warmup.compiled,
                                     lambda line: print(line, file=sys.stderr))
  batch = lambda: steps.put_batch(host)
  if plan.reference == "precomputed":  # the trainer's pass over the data, once, before
    ref = steps.ref_logps(frozen if plan.lora else state["params"], steps.put_batch(host))
    batch = lambda: dict(steps.put_batch(host), ref_logps=ref)
  ends = []
  for i in range(a.warmup + a.steps + 1):
    with compile_cache.FirstCompile() as first:
      state, metrics = train_step(state, frozen, batch())
    if i == 0:
      recompiled = first.compiles
    jax.block_until_ready(metrics)
    ends.append(time.perf_counter())
    if i == 0:
      step1_at = process_age()
      print(f"step 1 done {step1_at:.1f} s after the process started (" + ", ".join(
          f"{what} {t:.1f}" for what, t in timeline) + ")", file=sys.stderr, flush=True)
  stats = devices[0].memory_stats() or {}
  # The first step from the end of initialisation: the compile's remainder and the step.
  return dict(first_step_s=ends[0] - t_init, step_s=_median_interval(ends, a.warmup),
              peak_bytes=stats.get("peak_bytes_in_use"), device=devices[0].device_kind,
              loss=float(metrics["loss"]), plan=plan.describe(),
              framework=f"jax {jax.__version__}",
              platform_version=getattr(devices[0].client, "platform_version", None),
              startup=dict(imports_s=round(imported, 2), init_s=round(t_init - t_plan, 2),
                           step1_compile_wait_s=round(t0 - t_init, 2), step1_compile=compiled,
                           step1_recompiled=recompiled,
                           process_start_to_step1_end_s=round(step1_at, 2),
                           cache_dir=a.cache_dir, compiles=compiles.times,
                           timeline=[(what, round(t, 2)) for what, t in timeline]))


# Words of the tokenizer: id 0 pads, `EOS` ends a response, id i >= 2 is "w{i}". The
# special tokens are matched anywhere in the text, so they must not occur inside a word.
_SPECIAL = {0: "<pad>", EOS: "</s>"}


def _word(i: int) -> str:
  return _SPECIAL.get(i, f"w{i}")


def _word_tokenizer(vocab: int):
  """A fast tokenizer with one word per id (`_word`), adding no special tokens."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  words = {_word(i): i for i in range(min(WORDS, vocab))}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<pad>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>",
                                              pad_token="<pad>", eos_token=_word(EOS))


def run_trl(a, config: dict, pairs) -> dict:
  """TRL's `DPOTrainer` (module docstring)."""
  import copy  # pylint: disable=g-import-not-at-top
  import datasets  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top

  text = lambda ids: " ".join(map(_word, ids))
  data = datasets.Dataset.from_list([dict(prompt=text(p), chosen=" " + text(c),
                                          rejected=" " + text(r)) for p, c, r in pairs])
  cuda = torch.cuda.is_available()
  torch.manual_seed(0)
  with torch.device("cuda" if cuda else "cpu"):  # random init on the device: seconds
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
  ends = []

  class Clock(transformers.TrainerCallback):
    def on_step_end(self, *_, **__):
      if cuda:
        torch.cuda.synchronize()
      ends.append(time.perf_counter())

  args = trl.DPOConfig(
      output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.pairs,
      max_steps=a.warmup + a.steps + 1, learning_rate=1e-6, max_length=a.tokens,
      use_liger_kernel=a.liger, report_to="none", save_strategy="no", logging_steps=1000,
      use_cpu=not cuda, bf16=cuda, seed=0)
  # The reference: a frozen copy, as TRL makes from a model path (ours has none).
  trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                           train_dataset=data,
                           processing_class=_word_tokenizer(config["vocab_size"]),
                           callbacks=[Clock()])
  batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(pairs))])
  seen = int(batch["attention_mask"].sum())
  if seen != real_tokens(pairs):
    raise RuntimeError(f"TRL tokenized {seen} ids, the pairs hold {real_tokens(pairs)}")
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  t0 = time.perf_counter()
  trainer.train()
  # The first step from the start of training (TRL compiles nothing ahead).
  return dict(first_step_s=ends[0] - t0, step_s=_median_interval(ends, a.warmup),
              peak_bytes=torch.cuda.max_memory_allocated() if cuda else None,
              device=torch.cuda.get_device_name() if cuda else "cpu",
              framework=f"torch {torch.__version__}, trl {trl.__version__}")


def table(path: str) -> str:
  """The results of `path` as a Markdown table, MFU against the device's bf16 peak."""
  from tunix_core.training import flops  # pylint: disable=g-import-not-at-top
  lines = ["| model | tokens/pair | pairs | side | step (ms) | real tokens/s | MFU | peak "
           "memory (GiB) |", "|---|---|---|---|---|---|---|---|"]
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  for r in rows:
    if "need" in r:  # an --aot row: no time
      continue
    if "error" in r:
      lines.append(f"| {r['model']} | {r['tokens']} | {r['pairs']} | {r['side']} | "
                   f"{r['error']} | | | |")
      continue
    peak = next((p for name, p in flops.PEAK_FLOPS if name in r["device"]), None)
    work = dpo_flops(MODELS[r["model"]], synthetic_pairs(r["pairs"], r["tokens"],
                                                          MODELS[r["model"]]["vocab_size"]),
                     r.get("reference", "step"), r.get("lora_rank", 0))
    mfu = f"{work / r['step_s'] / peak:.1%}" if peak else "n/a"
    mem = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else "n/a"
    lines.append(f"| {r['model']} | {r['tokens']} | {r['pairs']} | {r['side']} | "
                 f"{1e3 * r['step_s']:.1f} | {r['real_tokens'] / r['step_s']:,.0f} | {mfu} | "
                 f"{mem} |")
  return "\n".join(lines) + "\n"


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("side", choices=("ours", "trl", "table"))
  p.add_argument("results", nargs="?", help="table: the results JSONL")
  p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
  p.add_argument("--tokens", type=int, default=1024, help="L: the longest row of a pair")
  p.add_argument("--pairs", type=int, default=8, help="pairs per step (both sides)")
  p.add_argument("--steps", type=int, default=6, help="timed steps after the warm-up")
  p.add_argument("--warmup", type=int, default=2, help="steps before timing")
  p.add_argument("--reference", default="step", help="ours: --reference")
  p.add_argument("--remat", default="none", help="ours: --remat (none: the default)")
  p.add_argument("--param_dtype", default="float32", help="ours: --param_dtype")
  p.add_argument("--optimizer_dtype", default="auto", help="ours: --optimizer_dtype")
  p.add_argument("--param_rounding", default="kahan", help="ours: --param_rounding")
  p.add_argument("--lora_rank", type=int, default=0, help="ours: --lora_rank")
  p.add_argument("--quantize_base", default="", help="ours: --quantize_base (QLoRA)")
  p.add_argument("--offload_optimizer", action="store_true", help="ours: --offload_optimizer")
  p.add_argument("--liger", action="store_true", help="trl: use_liger_kernel=True")
  p.add_argument("--aot", help="ours: compile for one chip of this TPU generation (v5e, "
                 "...) ahead of time instead of running, for the compiler's memory figures")
  p.add_argument("--cache_dir", help="ours: the trainer's --compilation_cache_dir ('': "
                 "off); unset: JAX's own setting")
  p.add_argument("--out", default="gpu_results.jsonl", help="JSONL the case appends to")
  a = p.parse_args()
  if a.side == "table":
    sys.stdout.write(table(a.results))
    return 0
  config = MODELS[a.model]
  pairs = synthetic_pairs(a.pairs, a.tokens, config["vocab_size"])
  ours = ("reference", "remat", "param_dtype", "optimizer_dtype", "param_rounding",
          "lora_rank", "quantize_base", "offload_optimizer")
  flags = "".join(f" --{k}={getattr(a, k)}" for k in ours if getattr(a, k) != p.get_default(k))
  side = ("trl+liger" if a.liger else "trl") if a.side == "trl" else "ours" + flags
  case = dict(model=a.model, tokens=a.tokens, pairs=a.pairs, side=side)
  if a.side == "ours":
    case.update(reference=a.reference, lora_rank=a.lora_rank)
  try:
    run = run_trl if a.side == "trl" else aot_ours if a.aot else run_ours
    measured = run(a, config, pairs)
  except Exception as e:  # pylint: disable=broad-except  (the table says what failed)
    _append(a.out, dict(case, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
    raise
  _append(a.out, dict(case, real_tokens=real_tokens(pairs), steps=a.steps, **measured))
  return 0


if __name__ == "__main__":
  sys.exit(main())
