"""The step plan: every static choice of a run's train step, made once.

A `StepPlan` is built in one place (`make_plan`) from the run config, the data's
statistics and the devices, and fixes what the compiled step is: the row layout and its
static shapes (`data.packing.Spec`: plain, shared, packed; row length, LM-head slots,
pairs per micro-batch), pairs per device and micro-batches, the reference mode, the
parameter layout, the model config with its resolved dtypes and attention impl, the
loss, the optimizer and the gradient sync. The trainer, `--compile_only`, the benchmarks
and the tests all build `step.StepFunctions` from a plan and nothing else (never from
the run config), so what is compiled, measured and tested is what runs.

Without data (`--compile_only` with no `--train_data`) the plan is sized for the worst
case of the flags (`worst_case_sizes`): every row full (`--max_length` tokens) with a
prompt of `--max_prompt_length` tokens.
"""

import dataclasses

import numpy as np
from tunix_kernels.dpo_loss import losses as dpo_losses

from tunix_core import model as model_lib
from tunix_core.data import packing
from tunix_core.data import sampled_pairs
from tunix_core.model import lora as lora_lib
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.training import optim
from tunix_core.training import tpu_flags
from tunix_core.training import validation
from tunix_core.training.config import ConfigError, TrainConfig


# The data-parallel chips of one slice over which `--sync_impl=auto` reduce-scatters with
# an all_to_all on TPU (8 keep a real reduce-scatter; 64, a v5p-128, compile; 256 did not).
ALL_TO_ALL_CHIPS = range(9, 65)


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The static choices of a train step (hashable; see the module docstring)."""

  model: model_lib.ModelConfig      # with compute dtype and remat resolved
  rows: packing.Spec                # one device's micro-batch of model rows
  data_shards: int                  # data-parallel devices, of all slices
  model_parallel: int               # devices of the "model" axis (1: no TP)
  batch_size: int                   # pairs per step over every device
  max_length: int                   # T of the step's pair batch [B, 2, T]
  max_prompt_length: int            # prompt ids a planned row holds (`flops`)
  loss: dpo_losses.LossSpec         # the loss terms and their parameters
  optimizer: optim.OptimizerConfig
  micro_batches: int = 1            # --grad_accum_steps (auto: 1 until `fit` chooses)
  # "step" (the frozen reference's forward in every step), "precomputed" (its log-probs
  # ride with the batch) or "none" (reference-free, also when every loss type is).
  reference: str = "step"
  ref_dtype: str = "float32"        # the frozen reference's params
  ref_adapters: bool = False        # LoRA: the reference is the base with --lora_init's
  logprob_impl: str = "auto"        # `tunix_kernels.fused_logprobs`' impl
  loss_impl: str = "auto"           # `tunix_kernels.dpo_loss`' impl
  fsdp: bool = False                # else ZeRO-1
  offload_optimizer: bool = False   # optimizer state in host memory between steps
  bucket_bytes: int = 25 << 20      # gradient buckets of the sync
  grad_sync_dtype: str = "float32"  # gradients on the wire
  max_grad_norm: float | None = 1.0  # None: no clipping
  remat_auto: bool = False          # `training.fit` picks `model.remat`
  micro_batches_auto: bool = False  # `training.fit` picks `micro_batches`
  num_slices: int = 1               # the "slice" axis (1: none); "data" is
                                    # data_shards / num_slices devices
  lora: lora_lib.LoraConfig | None = None  # adapters train, the base is frozen
  quantize_base: str = ""           # QLoRA: the frozen base's `model.quant` kind
  compiler_options: tuple = ()      # (name, value) of --tpu_flags on TPU, else none
  sync_impl: str = "xla"            # --sync_impl resolved (`collectives.SYNC_IMPLS`)
  padded_pairs: bool = False        # online DPO: tied prompts are padding pairs

  @property
  def pairs_per_device(self) -> int:
    return self.batch_size // self.data_shards

  @property
  def layout(self) -> str:
    lora = (f"{'Q' * bool(self.quantize_base)}LoRA r={self.lora.rank} on "
            f"{len(self.lora.targets)} projection(s), "
            f"{self.quantize_base + ' ' if self.quantize_base else ''}base "
            if self.lora else "")
    return lora + ("FSDP" if self.fsdp else "ZeRO-1") + (
        f" x TP {self.model_parallel}" if self.model_parallel > 1 else "") + (
        f", data across {self.num_slices} slices" if self.num_slices > 1 else "") + (
        ", optimizer state in host memory" if self.offload_optimizer else "")

  def describe(self) -> str:
    """The plan in one line."""
    r = self.rows
    return (f"plan: {r.layout} rows, {r.rows} x {r.length} tokens and {r.head} LM-head "
            f"slots per {r.pairs} pair(s); {self.pairs_per_device} pair(s) per device in "
            f"{self.micro_batches} micro-batch(es); reference: {self.reference}; "
            f"{self.layout} over {self.data_shards * self.model_parallel} device(s); "
            f"{self.model.param_dtype} params, {self.model.compute_dtype} compute, "
            f"remat {self.model.remat}, attention {self.model.attention_impl}")


def pairs_per_group(cfg: TrainConfig, num_devices: int) -> int:
  """Pairs one device computes at once (one micro-batch): the one place this is worked
  out."""
  data_shards = num_devices // cfg.model_parallel
  return cfg.batch_size // (data_shards * validation.micro_batches(cfg))


def data_sizes(cfg: TrainConfig, splits) -> packing.Sizes:
  """The `packing.Sizes` of every pair of `splits` (token stores, or
  `PreferenceDataset`s; the training data first), the same on every host. Online
  (`--online_samples`), the training pairs are sampled: sized as the longest prompt
  with two samples of `--online_max_new_tokens` ids (a `ConfigError` if that row
  exceeds `--max_length`, or if `--online_data_chosen` meets a chosen response longer
  than a sample may be)."""
  sizes = [d.sizes(cfg.prefix_sharing) for d in splits]
  if cfg.online_samples:
    longest, new = int(splits[0].prompt_lengths().max()), cfg.online_max_new_tokens
    if longest + new > cfg.max_length:
      raise ConfigError(f"--online_max_new_tokens={new} with the longest prompt of "
                        f"--train_data ({longest} ids) exceeds --max_length="
                        f"{cfg.max_length}")
    chosen = int(splits[0].chosen_lengths().max()) if cfg.online_data_chosen else 0
    if chosen > new:
      raise ConfigError(f"--online_data_chosen: the longest chosen response of "
                        f"--train_data ({chosen} ids) exceeds --online_max_new_tokens={new}")
    sizes[0] = sampled_pairs.worst_sizes(longest, new, cfg.batch_size, cfg.prefix_sharing,
                                        cfg.max_length)
  return packing.Sizes.join(sizes)


def worst_case_sizes(cfg: TrainConfig) -> packing.Sizes:
  """The documented worst case of the flags, for a whole batch: every prompt
  `P = --max_prompt_length` tokens and every response the rest of a full row of
  `T = --max_length` tokens. Shared, a pair holds `2T - P` tokens; each row scores at
  most `T - P + 1` positions (a tokenizer without BOS scores from the prompt's last
  token on). Data with shorter prompts and longer responses makes longer shared rows:
  plan from `--train_data` to compile the exact step."""
  T, P = cfg.max_length, cfg.max_prompt_length
  every = lambda n: np.full(cfg.batch_size, n)  # a whole batch of such pairs
  return packing.Sizes(tokens=every(2 * T - P if cfg.prefix_sharing else 2 * T),
                       scored=every(2 * (T - P + 1)), longest=every(T))


def make_plan(cfg: TrainConfig, devices, sizes: packing.Sizes | None = None,
              model_config: model_lib.ModelConfig | None = None, *,
              fit: tuple[str, int] | None = None) -> StepPlan:
  """The plan of `cfg`'s step on `devices` for data of these `sizes` (None: the worst
  case of the flags); `model_config` overrides the flags' model; `fit`: the `(remat,
  micro_batches)` `training.fit` chose for `--remat=auto` / `--grad_accum_steps=auto`
  (the plan still says they were auto). Raises `config.ConfigError` for settings that
  cannot work on these devices."""
  cfg.validate(len(devices))
  auto = dict(remat_auto=cfg.remat == "auto",
              micro_batches_auto=cfg.grad_accum_steps == "auto")
  if fit is not None:
    cfg = dataclasses.replace(cfg, remat=fit[0], grad_accum_steps=fit[1])
  platform = devices[0].platform
  mcfg = model_config or cfg.model_config(platform)
  if fit is not None:
    mcfg = dataclasses.replace(mcfg, remat=fit[0])
  if mcfg.attention_impl == "auto":  # the Pallas kernels on TPU, for every row layout
    mcfg = dataclasses.replace(mcfg, attention_impl="pallas" if platform == "tpu" else "xla")
  sizes = worst_case_sizes(cfg) if sizes is None else sizes
  rows = packing.make_spec(sizes, pairs_per_group(cfg, len(devices)), cfg.prefix_sharing,
                           cfg.packing, cfg.max_length)
  try:
    slices = mesh_lib.resolve_slices(devices, cfg.num_slices)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  lora = cfg.lora_config()
  if lora is not None:
    mcfg = dataclasses.replace(mcfg, lora_scale=lora.scale)
  options = tpu_flags.options(cfg.tpu_flags, devices[0]) if platform == "tpu" else {}
  sync_impl = cfg.sync_impl
  if sync_impl == "auto":
    # TPU's compiler makes a psum_scatter beyond a v5e-8 an all-reduce, twice an
    # all_to_all's bytes; on 8 chips it stays a reduce-scatter (and holds less than an
    # all_to_all: the 7B v5e-8 step with bf16 sync fits only so), and an all_to_all
    # over 256 chips did not compile in 18 minutes (docs/tpu.md#communication).
    per_slice = len(devices) // cfg.model_parallel // slices
    sync_impl = "all_to_all" if platform == "tpu" and per_slice in ALL_TO_ALL_CHIPS else "xla"
  loss = cfg.loss_spec()
  return StepPlan(
      model=mcfg, rows=rows, data_shards=len(devices) // cfg.model_parallel,
      model_parallel=cfg.model_parallel, batch_size=cfg.batch_size,
      max_length=cfg.max_length, max_prompt_length=cfg.max_prompt_length, loss=loss,
      optimizer=cfg.optimizer_config(), micro_batches=validation.micro_batches(cfg),
      reference="none" if loss.reference_free else cfg.reference,
      ref_dtype=cfg.ref_param_dtype(platform), ref_adapters=bool(lora and cfg.lora_init),
      logprob_impl=cfg.logprob_impl, loss_impl=cfg.loss_impl, fsdp=cfg.fsdp,
      offload_optimizer=cfg.offload_optimizer, bucket_bytes=int(cfg.bucket_mb * 2**20),
      grad_sync_dtype=cfg.grad_sync_dtype,
      max_grad_norm=cfg.max_grad_norm or None, **auto,
      num_slices=slices, lora=lora, quantize_base=cfg.quantize_base,
      compiler_options=tuple(sorted(options.items())), sync_impl=sync_impl,
      padded_pairs=bool(cfg.online_samples))
