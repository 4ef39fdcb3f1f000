"""The run config: one frozen dataclass whose fields are the trainer's flags.

`TrainConfig.validate` is the one place settings are checked; every failure is a
`ConfigError` whose one-line message names the flag, before anything is compiled.
"""

import dataclasses
import os

import kernels
from kernels import attention as attention_lib
from kernels import tpu
from tunix_core import collectives
from tunix_core import model as model_lib
from tunix_core import optim
from tunix_core import tensor_parallel

RESUME_MODES = ("auto", "never", "required")
# --chat_template values besides a path to a jinja file.
CHAT_TEMPLATES = ("auto", "none")
# What a step with a non-finite loss, metric or gradient norm does: end the run (its
# update is never applied) or skip its update and count it.
NONFINITE_ACTIONS = ("stop", "skip")

# Settings that must not change across a resume (the model's own fields are checked
# separately): they decide the data order or the meaning of the optimizer state.
RESUME_FIELDS = ("max_length", "max_prompt_length", "seed", "batch_size", "optimizer",
                 "train_data", "chat_template")


class ConfigError(ValueError):
  """A setting that cannot work; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run depends on; the trainer's flags map one to one onto these fields."""

  output_dir: str
  train_data: str
  eval_data: str = ""
  model: str = "tiny"
  hf_model_dir: str = ""
  chat_template: str = "auto"
  param_dtype: str = "float32"
  ref_dtype: str = "auto"
  export_hf_dir: str = ""
  export_dtype: str = "auto"
  compute_dtype: str = "float32"
  remat: str = "none"
  max_length: int = 64
  max_prompt_length: int = 32
  skip_bad_lines: bool = False
  steps: int = 100
  batch_size: int = 8
  seed: int = 0
  optimizer: str = "adamw"
  learning_rate: float = 1e-3
  warmup_steps: int = 0
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  beta: float = 0.1
  loss_type: str = "sigmoid"
  label_smoothing: float = 0.0
  reference_free: bool = False
  precompute_ref_logps: bool = False
  logprob_impl: str = "auto"
  attention_impl: str = "auto"
  loss_impl: str = "auto"
  bucket_mb: float = 25.0
  sync_impl: str = "xla"
  grad_sync_dtype: str = "float32"
  grad_accum_steps: int = 1
  fsdp: bool = False
  model_parallel: int = 1
  head_on_scored: bool = True
  prefix_sharing: bool = True
  packing: bool = False
  check_replicas_every: int = 0
  log_every: int = 10
  eval_every: int = 0
  save_every: int = 0
  keep: int = 3
  keep_period: int = 0
  resume: str = "auto"
  verify_checkpoint: bool = True
  on_nonfinite: str = "stop"
  compile_only: bool = False
  target_topology: str = "local"

  def validate(self, num_devices: int) -> None:
    """Raises ConfigError with one line naming the offending setting."""
    def need(cond, msg):
      if not cond:
        raise ConfigError(msg)

    for name, choices in CHOICES.items():
      value = getattr(self, name)
      verb = "is not a preset" if name == "model" else "is unknown"
      need(value in choices, f"--{name}={value!r} {verb}; choose one of {choices}")
    need(self.steps > 0, f"--steps must be positive, got {self.steps}")
    need(self.batch_size > 0, f"--batch_size must be positive, got {self.batch_size}")
    k = self.model_parallel
    need(k >= 1 and num_devices % k == 0,
         f"--model_parallel={k} does not divide the {num_devices} devices")
    shards = num_devices // k
    what = (f"{shards} data-parallel shards ({num_devices} devices / --model_parallel={k})"
            if k > 1 else f"{num_devices} devices")
    need(self.batch_size % shards == 0,
         f"--batch_size={self.batch_size} is not divisible by the {what}")
    need(self.grad_accum_steps > 0, f"--grad_accum_steps must be positive, got "
         f"{self.grad_accum_steps}")
    need(self.batch_size % (shards * self.grad_accum_steps) == 0,
         f"--batch_size={self.batch_size} does not split into {self.grad_accum_steps} "
         f"micro-batches on each of the {what}")
    need(self.bucket_mb > 0, f"--bucket_mb must be positive, got {self.bucket_mb}")
    need(self.head_on_scored or not (self.prefix_sharing or self.packing),
         "--prefix_sharing and --packing run the LM head on scored positions only; with "
         "--head_on_scored=false set both to false")
    need(self.check_replicas_every >= 0, "--check_replicas_every must be >= 0")
    need(not (self.fsdp and self.check_replicas_every),
         "--check_replicas_every checks replicated params; under --fsdp no param is "
         "replicated (set it to 0)")
    need(0 < self.max_prompt_length < self.max_length,
         f"--max_prompt_length={self.max_prompt_length} must be positive and less than "
         f"--max_length={self.max_length}")
    need(self.beta > 0, f"--beta must be positive, got {self.beta}")
    need(self.learning_rate > 0, f"--learning_rate must be positive, got {self.learning_rate}")
    need(self.log_every > 0, f"--log_every must be positive, got {self.log_every}")
    need(self.eval_every >= 0, f"--eval_every must be >= 0, got {self.eval_every}")
    need(not (self.reference_free and self.precompute_ref_logps),
         "--precompute_ref_logps makes no sense with --reference_free")
    for name in ("train_data", "eval_data"):
      path = getattr(self, name)
      need(name == "eval_data" and not path or os.path.isfile(path),
           f"--{name}={path!r}: no such file")
    need(not (self.eval_every and not self.eval_data), "--eval_every needs --eval_data")
    need(not self.hf_model_dir or os.path.isfile(os.path.join(self.hf_model_dir, "config.json")),
         f"--hf_model_dir={self.hf_model_dir!r} is not a Hugging Face model directory "
         "(no config.json)")
    if k > 1:
      try:
        tensor_parallel.check(self.model_config(), k)
      except ValueError as e:
        raise ConfigError(str(e)) from None
    need(self.chat_template in CHAT_TEMPLATES or os.path.isfile(self.chat_template),
         f"--chat_template={self.chat_template!r} is neither {CHAT_TEMPLATES} nor a file")
    need(not (self.export_hf_dir and os.path.isfile(self.export_hf_dir)),
         f"--export_hf_dir={self.export_hf_dir!r} is a file")

  def model_config(self) -> model_lib.ModelConfig:
    """The preset's config, or with `--hf_model_dir` the checkpoint's (`hf.HFError` if it
    cannot be represented exactly)."""
    overrides = dict(param_dtype=self.param_dtype, compute_dtype=self.compute_dtype,
                     remat=self.remat, attention_impl=self.attention_impl)
    if self.hf_model_dir:
      from tunix_core import hf_config  # pylint: disable=g-import-not-at-top
      return hf_config.read_config(self.hf_model_dir, **overrides)
    return model_lib.preset(self.model, **overrides)

  def ref_param_dtype(self) -> str:
    return self.param_dtype if self.ref_dtype == "auto" else self.ref_dtype

  def export_param_dtype(self) -> str:
    return self.param_dtype if self.export_dtype == "auto" else self.export_dtype


# The allowed values of each choice setting, taken from the module that implements it;
# the trainer builds its `DEFINE_enum` flags from this table.
CHOICES = {
    "model": tuple(model_lib.PRESETS),
    "param_dtype": tuple(model_lib.DTYPES),
    "ref_dtype": ("auto",) + tuple(model_lib.DTYPES),
    "export_dtype": ("auto",) + tuple(model_lib.DTYPES),
    "compute_dtype": tuple(model_lib.DTYPES),
    "remat": tuple(model_lib.REMAT_POLICIES),
    "optimizer": optim.OPTIMIZERS,
    "loss_type": kernels.LOSS_TYPES,
    "logprob_impl": kernels.LOGPROB_IMPLS,
    "attention_impl": attention_lib.ATTENTION_IMPLS,
    "loss_impl": kernels.DPO_LOSS_IMPLS,
    "sync_impl": collectives.IMPLS,
    "grad_sync_dtype": tuple(collectives.COMM_DTYPES),
    "resume": RESUME_MODES,
    "on_nonfinite": NONFINITE_ACTIONS,
    "target_topology": ("local",) + tuple(tpu.TOPOLOGIES),
}
