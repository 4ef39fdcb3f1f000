"""The run config: one frozen dataclass whose fields are the trainer's flags.

`TrainConfig.validate` is the one place settings are checked; every failure is a
`ConfigError` whose one-line message names the flag, before anything is compiled.
"""

import dataclasses

from tunix_kernels.dpo_loss import losses as dpo_losses
from tunix_core import model as model_lib
from tunix_core.model import lora as lora_lib
from tunix_core.training import online_config
from tunix_core.training import optimizer_flags
from tunix_core.training import optim
from tunix_core.training import tpu_flags
from tunix_core.training import validation

CHOICES = validation.CHOICES  # each choice flag's values (the trainer's enums)
ConfigError = validation.ConfigError


_flag = online_config.flag


@dataclasses.dataclass(frozen=True)
class TrainConfig(online_config.OnlineConfig, optimizer_flags.OptimizerFlags):
  """Everything a run depends on; `trainer.py` defines one flag per field, with the
  field's default and help (`metadata["help"]`), so flags, defaults, help and the docs'
  flag table (`training.flags.flag_table`, under the heading of `metadata["group"]`)
  cannot drift. Online DPO's flags come from its base `online_config.OnlineConfig`, the
  optimizer's from `optimizer_flags.OptimizerFlags`."""

  output_dir: str = _flag("", "Directory for metrics.jsonl, checkpoints, trainer.log and the "
                          "data cache; created if missing. Required.", group="run")
  steps: int = _flag(100, "Number of optimizer steps.", group="run")
  batch_size: int = _flag(8, "Preference pairs per step over all devices (2x as many "
                          "responses); must divide by the data-parallel devices.", group="run")
  seed: int = _flag(0, "Seed for params init and data shuffling.", group="run")
  log_every: int = _flag(10, "Log a metrics row every N steps (and the last).", group="run")
  sample_every: int = _flag(0, "Before step 1, every N steps and after the last, write "
                            "greedy completions of --sample_prompts (else the first eval "
                            "prompts) to samples.jsonl, TensorBoard, W&B; 0: never.", group="run")
  sample_prompts: str = _flag("", "A text file of prompts for --sample_every, one per line "
                              "(default: the first 4 prompts of --eval_data).", group="run")
  sample_max_new_tokens: int = _flag(32, "Tokens each --sample_every completion may add.",
                                     group="run")
  eval_every: int = _flag(0, "Evaluate on --eval_data every N steps and after the last "
                          "step; 0 disables evaluation.", group="run")
  save_every: int = _flag(100, "Save an asynchronous checkpoint every N steps; the last "
                          "step is always saved (0: only the last step, and on "
                          "SIGTERM/SIGINT).", group="run")
  step_timeout: float = _flag(1800.0, "Watchdog (exit status 5, stacks in trainer.log): "
                              "seconds a storage call, step, eval batch, save or unit of "
                              "start-up (a chunk tokenized, a tensor read, a reference "
                              "batch) may take; 4x for start-up, compiles, export; 0: off.",
                              group="run")
  keep: int = _flag(3, "Most recent checkpoints to keep.", group="run")
  keep_period: int = _flag(0, "Also keep every checkpoint whose step is a multiple of N, "
                           "permanently (0: none).", group="run")
  resume: str = _flag("auto", "auto: resume from the latest complete checkpoint if any, "
                      "else start fresh; never: start fresh, refusing a directory with "
                      "checkpoints; required: fail without one.", group="run")
  verify_checkpoint: bool = _flag(True, "On resume, check every restored array's "
                                  "fingerprint; a step that fails is moved aside and the "
                                  "previous one used (auto).", group="run")
  allow_data_change: bool = _flag(False, "Resume although --train_data's token store (its "
                                  "content, tokenizer, limits) differs from the checkpoint's: "
                                  "the saved epoch restarts over the new data. Off: refused.",
                                  group="run")
  compilation_cache_dir: str = _flag("auto", "Persistent compilation cache, local or gs:// "
                                     "(auto: $JAX_COMPILATION_CACHE_DIR, else {output_dir}/"
                                     "compilation_cache; empty: off).", group="run")
  on_nonfinite: str = _flag("stop", "stop: end the run (exit status 3) at a step whose "
                            "loss, metrics or gradient norm is NaN/Inf, without applying "
                            "or saving it; skip: skip such steps' updates and count them.",
                            group="run")
  tensorboard_dir: str = _flag("", "TensorBoard event files of the metrics (local or gs://; "
                               "needs the tensorboard extra). Empty: "
                               "{output_dir}/tensorboard; none: off.", group="observe")
  wandb_project: str = _flag("", "Also log the metrics, the config and the checkpoint "
                             "digests to this Weights & Biases project (needs wandb; "
                             "WANDB_MODE=offline works without a network). Empty: off.",
                             group="observe")
  profile_steps: str = _flag("", "N:M: write a JAX profiler trace of steps N to M to "
                             "{output_dir}/profile. Empty: off.", group="observe")
  train_data: str = _flag("", "Training pairs: a JSONL file, a .parquet file, a directory "
                          "or glob of Parquet shards, or a datasets.save_to_disk directory "
                          "(DIR:SPLIT for one split of several); TRL's standard or "
                          "conversational columns, the prompt explicit or implicit "
                          "(docs/data.md). Required, but for --compile_only.", group="data")
  eval_data: str = _flag("", "Evaluation pairs, same format.", group="data")
  max_length: int = _flag(64, "Tokens per response row (prompt + response).", group="data")
  max_prompt_length: int = _flag(32, "Prompt tokens kept (cut from the left); less than "
                                 "--max_length.", group="data")
  skip_bad_lines: bool = _flag(False, "Skip (and count) malformed JSONL lines.", group="data")
  data_cache_dir: str = _flag("", "Token stores and precomputed reference log-probs (local "
                              "or gs://, shareable between runs). Empty: "
                              "{output_dir}/data_cache.", group="data")
  chat_template: str = _flag("auto", "For conversational pairs: auto (the tokenizer's "
                             "own), none (conversational pairs are an error), or a path to "
                             "a jinja template file.", group="data")
  prefix_sharing: bool = _flag(True, "Compute each pair's prompt once for the policy, the "
                               "reference and the backward: one sequence prompt | chosen | "
                               "rejected in which the rejected response restarts its "
                               "positions after the prompt and never sees the chosen one; "
                               "exact.", group="data")
  packing: bool = _flag(False, "Padding-free packing: the pairs of each device's "
                        "micro-batch follow each other in one row (segment ids: attention "
                        "never crosses pairs, positions restart per pair), sized from the "
                        "data; exact and deterministic.", group="data")
  model: str = _flag("tiny", "Model preset; ignored with --hf_model_dir.", group="model")
  hf_model_dir: str = _flag("", "A Hugging Face model directory (config.json, safetensors, "
                            "tokenizer.json): its config, tokenizer and weights are the "
                            "initial policy and the reference (reloaded from here on a "
                            "resume). Llama, Mistral, Qwen2/3 and Gemma 1/2/3.",
                            group="model")
  init_from: str = _flag("", "RUN_DIR[:STEP]: start from the policy another run saved "
                         "at STEP (default its newest), which is also the reference; that "
                         "run's data position, optimizer state and step count are not "
                         "carried over. Needs the same --model or --hf_model_dir.",
                         group="model")
  param_dtype: str = _flag("float32", "Dtype of the trained params; bfloat16 trains as "
                           "float32 does: the optimizer carries what each update's rounding "
                           "drops (docs/training.md#bfloat16-params).", group="model")
  ref_dtype: str = _flag("auto", "Dtype of the frozen reference params (auto: the compute "
                         "dtype if narrower than --param_dtype, as bfloat16 on TPU and "
                         "GPU; else --param_dtype).", group="model")
  compute_dtype: str = _flag("auto", "Activation/matmul dtype (auto: bfloat16 on TPU and "
                             "GPU, float32 on CPU); params keep theirs.", group="model")
  remat: str = _flag("auto", "Rematerialisation of each layer in the backward: auto (the "
                     "cheapest of none, dots, attention, full that fits: --grad_accum_steps), "
                     "offload (matmul outputs to host memory and back), full_prefetch (full, "
                     "--fsdp's transfers under its compute).", group="model")
  export_hf_dir: str = _flag("", "After the last step, write the policy here as a Hugging "
                             "Face directory (with --hf_model_dir's config and tokenizer "
                             "files); empty: no export.", group="model")
  export_dtype: str = _flag("auto", "Dtype of the exported weights (auto: --param_dtype).",
                            group="model")
  lora_rank: int = _flag(0, "Train LoRA adapters of this rank on --lora_targets, not every "
                         "weight; the frozen base (in --ref_dtype) is the reference. 0: "
                         "full fine-tuning.", group="lora")
  lora_alpha: float = _flag(16.0, "Adapters are scaled by alpha / rank.", group="lora")
  lora_targets: str = _flag(",".join(lora_lib.TARGETS), "Comma-separated projections to "
                            "adapt, as PEFT names them.", group="lora")
  lora_rslora: bool = _flag(False, "Scale by alpha / sqrt(rank) (rsLoRA).", group="lora")
  lora_dropout: float = _flag(0.0, "Only 0: DPO runs without dropout (as TRL).", group="lora")
  lora_init: str = _flag("", "A PEFT LoRA adapter directory to start from, frozen as the "
                         "reference's; its rank, alpha, targets replace --lora_*.", group="lora")
  export_merged: bool = _flag(False, "LoRA with --export_hf_dir: also write the merged "
                              "model to {export_hf_dir}/merged.", group="lora")
  quantize_base: str = _flag("", "QLoRA: keep the frozen base's layer projections as int8, "
                             "int4 or nf4 (per 32 input rows); empty: unquantized "
                             "(docs/training.md#qlora).", group="lora")
  beta: float = _flag(0.1, "DPO temperature (KL penalty strength).", group="loss")
  loss_type: str = _flag("sigmoid", "Preference loss, or a comma-separated list of them "
                         "summed with --loss_weights: TRL 1.16's DPO loss types (sigmoid = "
                         "DPO, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, "
                         "aot, aot_unpaired, apo_zero, apo_down, discopop, sft = NLL of the "
                         "chosen response, sigmoid_norm) and the reference-free simpo, cpo, "
                         "orpo (a list of only those runs without a reference).", group="loss")
  loss_weights: str = _flag("", "Comma-separated weight of each --loss_type entry, e.g. "
                            "1.0,0.2; empty: 1.0 each.", group="loss")
  label_smoothing: float = _flag(0.0, "Assumed label-flip rate for sigmoid (conservative "
                                 "DPO), robust, aot and simpo/cpo; EXO's epsilon for "
                                 "exo_pair (which needs it in (0, 1); 1e-3 in its paper).",
                                 group="loss")
  f_divergence_type: str = _flag("reverse_kl", "f-DPO's divergence mapping the log-ratios "
                                 "before the loss: reverse_kl (DPO), forward_kl, "
                                 "js_divergence or alpha_divergence.", group="loss")
  f_alpha_divergence_coef: float = _flag(0.5, "alpha of --f_divergence_type="
                                         "alpha_divergence.", group="loss")
  discopop_tau: float = _flag(0.05, "DiscoPOP's temperature (--loss_type=discopop).",
                              group="loss")
  simpo_gamma: float = _flag(0.5, "SimPO's target reward margin (--loss_type=simpo).",
                             group="loss")
  cpo_alpha: float = _flag(1.0, "Weight of CPO's NLL term on the chosen response "
                           "(--loss_type=cpo).", group="loss")
  reference: str = _flag("step", "The frozen reference: step (its forward in every step), "
                         "precomputed (run once over the data before training, cached on "
                         "disk) or none (reference-free: its log-probs are taken as "
                         "zero).", group="loss")
  fsdp: bool = _flag(False, "Fully sharded data parallel (ZeRO-3): params, gradients, the "
                     "reference and the optimizer state split over all devices; each layer "
                     "all-gathered inside the layer scan and its gradient reduce-scattered "
                     "per layer. Off: ZeRO-1 (replicated params).", group="parallel")
  model_parallel: int = _flag(1, "Tensor parallelism: devices of the inner 'model' mesh "
                              "axis (consecutive devices); heads, MLP columns and the "
                              "vocabulary are split over them Megatron-style. 1: none.",
                              group="parallel")
  num_slices: int = _flag(0, "TPU slices the run spans: a 'slice' mesh axis in front of "
                          "'data' (and 'model'); gradients are reduce-scattered within a "
                          "slice and all-reduced across slices once per step, no per-layer "
                          "collective crosses the slow data-centre network. 0: the slices "
                          "the devices are in (1 on CPU/GPU); on CPU devices N > 1 "
                          "simulates N slices of consecutive devices.", group="parallel")
  grad_accum_steps: str = _flag("auto", "Micro-batches per step (gradients synced once; --fsdp: "
                                "per micro-batch): N, or auto: the fewest that fit "
                                "(docs/training.md#fitting-the-step).", group="parallel")
  device_memory_gib: float = _flag(0.0, "Memory per device the auto --remat and "
                                   "--grad_accum_steps fit (0: a TPU's own).", group="parallel")
  bucket_mb: float = _flag(25.0, "Gradient bucket size in MiB for the bucketed "
                           "reduce-scatter / all-gather.", group="parallel")
  sync_impl: str = _flag("auto", "auto: all_to_all on TPU over 9 to 64 data chips a "
                         "slice, else xla; xla: a psum_scatter and all_gather per bucket; "
                         "ring: a ppermute ring; all_to_all: an all_to_all and float32 sum "
                         "per bucket (docs/tpu.md#communication).", group="parallel")
  grad_sync_dtype: str = _flag("float32", "Gradients on the wire; bfloat16 halves the "
                               "bytes, summed in bfloat16 (xla) or float32.", group="parallel")
  check_replicas_every: int = _flag(0, "Also check every N steps (besides after step 1) "
                                    "that all replicas hold identical params.", group="parallel")
  logprob_impl: str = _flag("auto", "tunix_kernels.fused_logprobs impl: auto (pallas when "
                            "compiled for TPU, else xla), xla, pallas, interpret or naive "
                            "(the oracle).", group="parallel")
  attention_impl: str = _flag("auto", "Attention (tunix_kernels.attention): auto (the Pallas "
                              "kernels when compiled for TPU, for every row layout, window and "
                              "soft-cap; else xla), xla (blockwise: no [T, T] scores), pallas, "
                              "interpret (the kernels on CPU) or naive (the oracle).",
                              group="parallel")
  loss_impl: str = _flag("auto", "tunix_kernels.dpo_loss impl: auto (pallas when compiled for "
                         "TPU, else xla), xla, pallas, interpret or naive (the oracle).",
                         group="parallel")
  compile_only: bool = _flag(False, "Compile the train step these flags would run (from "
                             "--train_data, else full rows) for --target_topology, print "
                             "its plan, per-device memory and cost analysis, allocating "
                             "nothing; exit 0 if it fits, 1 if not.", group="aot")
  compare_levers: bool = _flag(False, "With --compile_only: compile the step again with each "
                               "memory lever not on (bfloat16 params, --reference="
                               "precomputed, --optimizer_dtype=float8, --offload_optimizer, "
                               "--fsdp), print what each saves, and the first combination "
                               "in that order that fits.", group="aot")
  target_topology: str = _flag("local", "Devices --compile_only compiles for: local (this "
                               "host's), or any Cloud TPU slice name (v5e-8, v5e-256, "
                               "v6e-64, v5p-128, v4-8; 2xv5e-256 for two slices; needs "
                               "libtpu, works on any host).", group="aot")
  tpu_flags: str = _flag(tpu_flags.AUTO, "XLA TPU compiler options of every step compiled for "
                         "TPU: --name=value separated by spaces, or auto: MaxText's async "
                         "collective fusion and overlap set, weight gathers fused (v5e) or "
                         "on the SparseCores (v5p, v6e), pipelined (docs/tpu.md).", group="aot")

  def validate(self, num_devices: int) -> None:
    """Raises ConfigError with one line naming the offending setting."""
    validation.check(self, num_devices)

  def loss_spec(self) -> dpo_losses.LossSpec:
    """The checked loss terms, each parameter of `LossSpec` from the flag of its name
    (ValueError naming the bad argument)."""
    weights = [float(w) for w in self.loss_weights.split(",")] if self.loss_weights else None
    return dpo_losses.make_spec(self.loss_type, weights, **{
        f.name: getattr(self, f.name) for f in dataclasses.fields(dpo_losses.LossSpec)
        if f.name not in ("loss_types", "loss_weights")})

  def optimizer_config(self) -> optim.OptimizerConfig:
    return optim.OptimizerConfig(**{f.name: getattr(self, f.name)
                                    for f in dataclasses.fields(optim.OptimizerConfig)})

  def lora_config(self) -> lora_lib.LoraConfig | None:
    """The run's adapters (None: full fine-tuning): from `--lora_init`'s adapter config
    when given, else from the --lora_* flags."""
    if self.lora_init:
      from tunix_core.hf import peft  # pylint: disable=g-import-not-at-top
      return peft.read_config(self.lora_init)
    targets = tuple(t.strip() for t in self.lora_targets.split(","))
    return lora_lib.LoraConfig(self.lora_rank, self.lora_alpha, targets,
                               self.lora_rslora) if self.lora_rank else None

  def resolved_compute_dtype(self, platform: str) -> str:
    """`--compute_dtype`, with auto: bfloat16 on TPU and GPU (tensor cores), float32 on
    CPU. `platform`: a `jax.Device.platform` ("gpu") or a backend ("cuda", "rocm")."""
    if self.compute_dtype == "auto":
      return "bfloat16" if platform in ("tpu", "gpu", "cuda", "rocm") else "float32"
    return self.compute_dtype

  def model_config(self, platform: str = "cpu") -> model_lib.ModelConfig:
    """The preset's config, or with `--hf_model_dir` the checkpoint's (`hf.HFError` if it
    cannot be represented exactly), computing as `--compute_dtype` resolves on
    `platform`; `--remat=auto` is none until `training.fit` resolves it."""
    overrides = dict(param_dtype=self.param_dtype, attention_impl=self.attention_impl,
                     compute_dtype=self.resolved_compute_dtype(platform),
                     remat="none" if self.remat == "auto" else self.remat)
    if self.hf_model_dir:
      from tunix_core.hf import config as hf_config  # pylint: disable=g-import-not-at-top
      return hf_config.read_config(self.hf_model_dir, **overrides)
    return model_lib.preset(self.model, **overrides)

  def ref_param_dtype(self, platform: str) -> str:
    """`--ref_dtype` as it resolves on `platform` (its help text)."""
    size = lambda name: model_lib.DTYPES[name].dtype.itemsize
    compute = self.resolved_compute_dtype(platform)
    auto = compute if size(compute) < size(self.param_dtype) else self.param_dtype
    return auto if self.ref_dtype == "auto" else self.ref_dtype

  def export_param_dtype(self) -> str:
    return self.param_dtype if self.export_dtype == "auto" else self.export_dtype

