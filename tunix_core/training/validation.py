"""One-line checks of a run config (`TrainConfig.validate`): the first setting that
cannot work raises `ConfigError` naming its flag. Path flags may be local or remote
(`storage.paths`). `CHOICES` holds the allowed values of every choice flag."""

import importlib.util
import math

import tunix_kernels
from tunix_kernels import aot_tpu
from tunix_kernels.dpo_loss import losses as dpo_losses
from tunix_core.data import sources as data_sources
from tunix_core import model as model_lib
from tunix_core.model import quant
from tunix_core.parallel import collectives
from tunix_core.parallel import tensor_parallel
from tunix_core.storage import paths
from tunix_core.training import optim
from tunix_core.training import tpu_flags


# --chat_template values besides a path to a jinja file.
CHAT_TEMPLATES = ("auto", "none")
RESUME_MODES = ("auto", "never", "required")
REFERENCE_MODES = ("step", "precomputed", "none")  # `--reference`
# --on_nonfinite: a non-finite step ends the run unapplied, or its update is skipped.
NONFINITE_ACTIONS = ("stop", "skip")

# The allowed values of each choice setting, taken from the module that implements it;
# the trainer builds its `DEFINE_enum` flags from this table.
CHOICES = {
    "model": tuple(model_lib.PRESETS),
    "param_dtype": tuple(model_lib.DTYPES),
    "optimizer_dtype": optim.MOMENT_DTYPES,
    "param_rounding": optim.ROUNDINGS,
    "ref_dtype": ("auto",) + tuple(model_lib.DTYPES),
    "export_dtype": ("auto",) + tuple(model_lib.DTYPES),
    "compute_dtype": ("auto",) + tuple(model_lib.DTYPES),
    "reference": REFERENCE_MODES,
    "remat": ("auto",) + tuple(model_lib.REMAT_POLICIES),
    "optimizer": optim.OPTIMIZERS,
    "f_divergence_type": dpo_losses.F_DIVERGENCES,
    "logprob_impl": tunix_kernels.IMPLS,
    "attention_impl": tunix_kernels.IMPLS,
    "loss_impl": tunix_kernels.IMPLS,
    "sync_impl": ("auto",) + collectives.SYNC_IMPLS,
    "grad_sync_dtype": tuple(collectives.COMM_DTYPES),
    "resume": RESUME_MODES,
    "on_nonfinite": NONFINITE_ACTIONS,
}


class ConfigError(ValueError):
  """A setting that cannot work; the message names the flag."""


def micro_batches(cfg) -> int:
  """`--grad_accum_steps` as a count: auto is 1 until `training.fit` chooses."""
  return 1 if cfg.grad_accum_steps == "auto" else int(cfg.grad_accum_steps)


def check(cfg, num_devices: int) -> None:
  """Raises ConfigError for the first setting of `cfg` (a `TrainConfig`) that cannot
  work on `num_devices` devices (a choice flag outside its `CHOICES` first)."""
  def need(cond, msg):
    if not cond:
      raise ConfigError(msg)

  for name, allowed in CHOICES.items():
    value = getattr(cfg, name)
    verb = "is not a preset" if name == "model" else "is unknown"
    need(value in allowed, f"--{name}={value!r} {verb}; choose one of {allowed}")
  need(cfg.steps > 0, f"--steps must be positive, got {cfg.steps}")
  need(cfg.batch_size > 0, f"--batch_size must be positive, got {cfg.batch_size}")
  k = cfg.model_parallel
  need(k >= 1 and num_devices % k == 0,
       f"--model_parallel={k} does not divide the {num_devices} devices")
  shards = num_devices // k
  what = (f"{shards} data-parallel shards ({num_devices} devices / --model_parallel={k})"
          if k > 1 else f"{num_devices} devices")
  need(cfg.batch_size % shards == 0,
       f"--batch_size={cfg.batch_size} is not divisible by the {what}")
  need(cfg.num_slices >= 0 and (cfg.num_slices == 0 or shards % cfg.num_slices == 0),
       f"--num_slices={cfg.num_slices} does not divide the {what}")
  accum = cfg.grad_accum_steps
  need(accum == "auto" or str(accum).isdigit() and int(accum) > 0,
       f"--grad_accum_steps must be auto or a positive integer, got {accum!r}")
  need(cfg.device_memory_gib >= 0, f"--device_memory_gib must be >= 0, got "
       f"{cfg.device_memory_gib}")
  need(cfg.batch_size % (shards * micro_batches(cfg)) == 0,
       f"--batch_size={cfg.batch_size} does not split into {cfg.grad_accum_steps} "
       f"micro-batches on each of the {what}")
  need(cfg.bucket_mb > 0, f"--bucket_mb must be positive, got {cfg.bucket_mb}")
  need(cfg.check_replicas_every >= 0, "--check_replicas_every must be >= 0")
  need(cfg.step_timeout >= 0, "--step_timeout must be >= 0 (0 disables the watchdog)")
  try:
    if cfg.tpu_flags != tpu_flags.AUTO:
      tpu_flags.parse(cfg.tpu_flags)
  except ValueError as e:
    raise ConfigError(f"--tpu_flags: {e}") from None
  need(not (cfg.fsdp and cfg.check_replicas_every),
       "--check_replicas_every checks replicated params; under --fsdp no param is "
       "replicated (set it to 0)")
  need(0 < cfg.max_prompt_length < cfg.max_length,
       f"--max_prompt_length={cfg.max_prompt_length} must be positive and less than "
       f"--max_length={cfg.max_length}")
  need(cfg.beta > 0, f"--beta must be positive, got {cfg.beta}")
  try:
    [float(w) for w in cfg.loss_weights.split(",")] if cfg.loss_weights else None
  except ValueError:
    need(False, f"--loss_weights={cfg.loss_weights!r} is not a comma-separated list of "
         "numbers")
  try:
    cfg.loss_spec()
  except ValueError as e:
    need(False, f"--loss_type={cfg.loss_type!r}: {e}")
  need(cfg.learning_rate > 0, f"--learning_rate must be positive, got {cfg.learning_rate}")
  need(cfg.lr_schedule in optim.SCHEDULES, f"--lr_schedule={cfg.lr_schedule!r}: choose one "
       f"of {', '.join(optim.SCHEDULES)}")
  need(cfg.warmup_steps >= 0, f"--warmup_steps must be >= 0, got {cfg.warmup_steps}")
  need(0 <= cfg.warmup_ratio < 1, f"--warmup_ratio must be in [0, 1), got {cfg.warmup_ratio}")
  need(not (cfg.warmup_steps and cfg.warmup_ratio), "set --warmup_steps or --warmup_ratio, "
       "not both")
  need(cfg.log_every > 0, f"--log_every must be positive, got {cfg.log_every}")
  need(cfg.eval_every >= 0, f"--eval_every must be >= 0, got {cfg.eval_every}")
  need(cfg.output_dir, "--output_dir is required")
  need(cfg.train_data or cfg.compile_only, "--train_data is required (but for "
       "--compile_only, which then plans for the flags' worst case)")
  for name in ("train_data", "eval_data"):
    path = getattr(cfg, name)
    try:
      path and data_sources.resolve(path)
    except data_sources.DataError as e:
      need(False, f"--{name}={path!r}: {str(e).removeprefix(path + ': ')}")
  need(not (cfg.eval_every and not cfg.eval_data), "--eval_every needs --eval_data")
  need(cfg.sample_every >= 0, f"--sample_every must be >= 0, got {cfg.sample_every}")
  need(not cfg.sample_every or cfg.sample_prompts or cfg.eval_data,
       "--sample_every needs --sample_prompts or --eval_data (where its prompts come from)")
  need(not cfg.sample_prompts or paths.isfile(cfg.sample_prompts),
       f"--sample_prompts={cfg.sample_prompts!r}: no such file")
  need(cfg.sample_max_new_tokens > 0, "--sample_max_new_tokens must be positive")
  need(not cfg.hf_model_dir or paths.isfile(paths.join(cfg.hf_model_dir, "config.json")),
       f"--hf_model_dir={cfg.hf_model_dir!r} is not a Hugging Face model directory "
       "(no config.json)")
  if k > 1:
    try:
      tensor_parallel.check(cfg.model_config(), k)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  need(cfg.chat_template in CHAT_TEMPLATES or paths.isfile(cfg.chat_template),
       f"--chat_template={cfg.chat_template!r} is neither {CHAT_TEMPLATES} nor a file")
  need(not (cfg.export_hf_dir and paths.isfile(cfg.export_hf_dir)),
       f"--export_hf_dir={cfg.export_hf_dir!r} is a file")
  need(cfg.lora_rank >= 0, f"--lora_rank must be >= 0, got {cfg.lora_rank}")
  need(cfg.lora_dropout == 0, f"--lora_dropout={cfg.lora_dropout}: only 0 is supported")
  need(not cfg.export_merged or cfg.lora_rank or cfg.lora_init,
       "--export_merged needs LoRA (--lora_rank or --lora_init)")
  need(not cfg.lora_init or paths.isdir(cfg.lora_init),
       f"--lora_init={cfg.lora_init!r} is not a directory")
  if cfg.lora_rank or cfg.lora_init:
    try:
      cfg.lora_config()
    except ValueError as e:  # hf.HFError is one too
      raise ConfigError(f"--lora_*: {e}") from None
  if cfg.quantize_base:
    check_quantize(cfg, need)
  k = cfg.online_samples
  need(k == 0 or k >= 2, f"--online_samples={k}: online DPO needs K >= 2 samples per "
       "prompt (0: offline)")
  need(not k or cfg.reward_fn or cfg.reward_model, "--online_samples needs --reward_fn "
       "(MODULE:FUNCTION) or --reward_model (HF_DIR)")
  rewards = bool(cfg.reward_fn) + bool(cfg.reward_model)
  try:
    weights = [float(w) for w in cfg.reward_weights.split(",")] if cfg.reward_weights else []
  except ValueError:
    weights = None
  need(weights is not None and all(map(math.isfinite, weights)),
       f"--reward_weights={cfg.reward_weights!r}: expected comma-separated numbers")
  need(not weights or len(weights) == rewards, f"--reward_weights has {len(weights or [])} "
       f"weight(s) for {rewards} reward(s) (--reward_fn, --reward_model)")
  need(k or not cfg.online_data_chosen, "--online_data_chosen needs --online_samples")
  need(not k or cfg.reference != "precomputed", "--reference=precomputed cannot serve "
       "--online_samples: the pairs are sampled as the run goes; use --reference=step")
  need(cfg.online_temperature > 0, "--online_temperature must be positive (K greedy "
       "samples would all be the same)")
  need(0 < cfg.online_top_p <= 1, f"--online_top_p={cfg.online_top_p} is not in (0, 1]")
  need(cfg.online_top_k >= 0, f"--online_top_k={cfg.online_top_k} is negative (0: off)")
  need(math.isfinite(cfg.online_missing_eos_penalty), "--online_missing_eos_penalty must "
       "be a finite number")
  need(cfg.online_max_new_tokens > 0, "--online_max_new_tokens must be positive")
  need(not cfg.init_from or paths.join(cfg.init_from.rstrip("/"), "") != paths.join(
      cfg.output_dir.rstrip("/"), ""), "--init_from names this run's own --output_dir "
       "(a resume needs no --init_from)")
  if cfg.target_topology != "local":
    try:
      aot_tpu.parse_topology(cfg.target_topology)
    except ValueError as e:
      raise ConfigError(f"--target_topology: {e}") from None
  steps = cfg.profile_steps
  if steps:
    first, _, last = steps.partition(":")
    need(first.isdigit() and (last or first).isdigit()
         and 1 <= int(first) <= int(last or first),
         f"--profile_steps={steps!r}: expected N:M with 1 <= N <= M (or one step N)")
  if cfg.wandb_project:
    need(importlib.util.find_spec("wandb") is not None,
         f"--wandb_project={cfg.wandb_project!r} needs wandb: pip install 'tunix-core[wandb]'")



def check_quantize(cfg, need) -> None:
  """`--quantize_base`: a known kind, under LoRA, on a model whose projections it can
  quantize, without tensor parallelism."""
  kind = cfg.quantize_base
  need(kind in quant.KINDS, f"--quantize_base={kind!r}: choose one of {quant.KINDS}")
  need(cfg.lora_rank or cfg.lora_init, f"--quantize_base={kind} needs --lora_rank (QLoRA: "
       "the quantized base is frozen, the adapters train)")
  need(cfg.model_parallel == 1, f"--quantize_base={kind} does not run under "
       "--model_parallel yet; use --fsdp")
  m = cfg.model_config()
  for name, rows in (("d_model", m.d_model), ("heads x head_dim", m.num_heads * m.head_dim),
                     ("mlp_dim", m.mlp_dim)):
    why = quant.check_shape((rows, 1), kind)
    need(why is None, f"--quantize_base={kind} cannot quantize "
         f"{cfg.hf_model_dir or cfg.model}: {why} ({name} is {rows})")
