"""The optimizer's flags (`--optimizer`, `--learning_rate`, the schedule, the moments'
storage, `--offload_optimizer`): a base of `training.config.TrainConfig`; the step reads
them as an `optim.OptimizerConfig` (`TrainConfig.optimizer_config`)."""

import dataclasses

from tunix_core.training.online_config import flag


@dataclasses.dataclass(frozen=True)
class OptimizerFlags:
  """The `optimizer` flag group (docs/training.md#bfloat16-params)."""

  optimizer: str = flag("adamw", "adamw, rmsprop (the DPO paper's) or sgd.",
                        group="optimizer")
  learning_rate: float = flag(1e-6, "Peak learning rate (TRL's default).", group="optimizer")
  lr_schedule: str = flag("linear", "After the warmup: linear (to 0 at --steps, TRL's "
                          "default), cosine (a half cosine to 0 at --steps) or constant.",
                          group="optimizer")
  warmup_steps: int = flag(0, "Linear warmup steps from 0.", group="optimizer")
  warmup_ratio: float = flag(0.0, "Warmup as a share of --steps, rounded up (with "
                             "--warmup_steps 0).", group="optimizer")
  weight_decay: float = flag(0.0, "AdamW decoupled weight decay (norm scales excluded).",
                             group="optimizer")
  optimizer_dtype: str = flag("auto", "Storage of the optimizer's moments (auto: "
                              "--param_dtype; float8: 8 bits with a scale per row); "
                              "updates are computed in float32.",
                              group="optimizer")
  param_rounding: str = flag("kahan", "bfloat16 params: kahan (param + an int16 error is a "
                             "float32 master; the param its unbiased rounding), "
                             "kahan_nearest or stochastic (no error term).", group="optimizer")
  offload_optimizer: bool = flag(False, "Keep the optimizer state in host memory (JAX's "
                                 "pinned_host) between steps, moved to the devices for "
                                 "each update: device memory for transfer time.",
                                 group="optimizer")
  max_grad_norm: float = flag(1.0, "Clip gradients to this global norm; 0 disables "
                              "clipping.", group="optimizer")
