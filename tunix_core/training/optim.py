"""The optimizer factory: the learning-rate schedule and the elementwise optax transform.

Clipping is not in here: `zero.ShardedOptimizer` clips by the global norm of the whole
model, which a transformation applied to one device's shard could not see.
"""

import dataclasses

import jax
import optax

OPTIMIZERS = ("adamw", "rmsprop", "sgd")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer of a step (`--optimizer`, `--learning_rate`, `--warmup_steps`,
  `--weight_decay`)."""
  optimizer: str = "adamw"
  learning_rate: float = 1e-6
  warmup_steps: int = 0
  weight_decay: float = 0.0


def make_optimizer(cfg: OptimizerConfig) -> tuple[optax.GradientTransformation,
                                                  optax.Schedule]:
  """`(tx, schedule)` of an `OptimizerConfig`.

  The schedule warms up linearly from 0 to `learning_rate`, then stays constant.
  AdamW's weight decay skips the norm scales (params whose name ends in `norm`).
  """
  if cfg.optimizer not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of {OPTIMIZERS}")
  if cfg.warmup_steps > 0:
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  else:
    schedule = optax.constant_schedule(cfg.learning_rate)
  if cfg.optimizer == "adamw":
    def decay_mask(params):
      return jax.tree_util.tree_map_with_path(
          lambda path, _: not str(path[-1].key).endswith("norm"), params)
    tx = optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask)
  elif cfg.optimizer == "rmsprop":
    tx = optax.rmsprop(schedule)
  else:
    tx = optax.sgd(schedule)
  return tx, schedule
