"""DPO trainer: `python trainer.py --flagfile=configs/quickstart.flags`.

Every flag maps to a field of `tunix_core.train.TrainConfig`; bad settings end the run
with one error line before anything is compiled.
"""

import dataclasses
import sys

from absl import app
from absl import flags

from tunix_core import data as data_lib
from tunix_core import train as train_lib

_D = train_lib.TrainConfig  # defaults come from the config dataclass, in one place
_DEF = {f.name: f.default for f in dataclasses.fields(_D)}

# Run and output.
flags.DEFINE_string("output_dir", None, "Directory for metrics.jsonl, checkpoints and the "
                    "reference log-prob cache; created if missing.")
flags.DEFINE_integer("steps", _DEF["steps"], "Number of optimizer steps.")
flags.DEFINE_integer("batch_size", _DEF["batch_size"], "Preference pairs per step over all "
                     "devices (2x as many rows); must divide by the device count.")
flags.DEFINE_integer("seed", _DEF["seed"], "Seed for params init and data shuffling.")
flags.DEFINE_integer("log_every", _DEF["log_every"], "Log a metrics row every N steps.")
flags.DEFINE_integer("eval_every", _DEF["eval_every"], "Evaluate on --eval_data every N "
                     "steps and after the last step; 0 disables evaluation.")
flags.DEFINE_integer("save_every", _DEF["save_every"], "Checkpoint every N steps (0: never). "
                     "Reserved: checkpointing is not built yet, a non-zero value is an error.")
flags.DEFINE_integer("keep", _DEF["keep"], "Most recent checkpoints to keep (reserved).")
flags.DEFINE_enum("resume", _DEF["resume"], ["auto", "never", "required"],
                  "auto: resume from the latest checkpoint if any; never; required: fail "
                  "without one (reserved until checkpointing lands).")
# Data.
flags.DEFINE_string("train_data", None, "Training pairs, JSONL with prompt/chosen/rejected.")
flags.DEFINE_string("eval_data", _DEF["eval_data"], "Evaluation pairs, same format.")
flags.DEFINE_integer("max_length", _DEF["max_length"], "Tokens per row (prompt + response).")
flags.DEFINE_integer("max_prompt_length", _DEF["max_prompt_length"], "Prompt tokens kept "
                     "(cut from the left); must be less than --max_length.")
flags.DEFINE_bool("skip_bad_lines", _DEF["skip_bad_lines"], "Skip malformed JSONL lines and "
                  "report their count instead of failing.")
# Model.
flags.DEFINE_string("model", _DEF["model"], "Model preset: tiny, 125m or 1b.")
flags.DEFINE_enum("compute_dtype", _DEF["compute_dtype"], ["float32", "bfloat16"],
                  "Activation/matmul dtype; params stay float32.")
flags.DEFINE_enum("remat", _DEF["remat"], ["none", "full", "dots", "dots_no_batch"],
                  "Rematerialisation policy of each layer in the backward pass.")
# Optimizer.
flags.DEFINE_string("optimizer", _DEF["optimizer"], "adamw or rmsprop (the DPO paper's).")
flags.DEFINE_float("learning_rate", _DEF["learning_rate"], "Peak learning rate.")
flags.DEFINE_integer("warmup_steps", _DEF["warmup_steps"], "Linear warmup steps from 0.")
flags.DEFINE_float("weight_decay", _DEF["weight_decay"], "AdamW decoupled weight decay "
                   "(norm scales excluded).")
flags.DEFINE_float("max_grad_norm", _DEF["max_grad_norm"], "Clip gradients to this global "
                   "norm; 0 disables clipping.")
# Loss.
flags.DEFINE_float("beta", _DEF["beta"], "DPO temperature (KL penalty strength).")
flags.DEFINE_string("loss_type", _DEF["loss_type"], "sigmoid, ipo, hinge or robust.")
flags.DEFINE_float("label_smoothing", _DEF["label_smoothing"], "Assumed label-flip rate for "
                   "sigmoid (conservative DPO) and robust.")
flags.DEFINE_bool("reference_free", _DEF["reference_free"], "Drop the reference model "
                  "(its log-probs are taken as zero).")
flags.DEFINE_bool("precompute_ref_logps", _DEF["precompute_ref_logps"], "Run the reference "
                  "once over the data before training (cached on disk) instead of in every step.")
flags.DEFINE_string("logprob_impl", _DEF["logprob_impl"], "kernels.fused_logprobs impl: "
                    "auto (pallas on TPU, else xla), xla, pallas, interpret or reference.")
flags.DEFINE_string("loss_impl", _DEF["loss_impl"], "kernels.dpo_loss impl: auto (pallas on "
                    "TPU, else xla), xla, pallas, interpret or reference.")

flags.mark_flags_as_required(["output_dir", "train_data"])


def config_from_flags() -> train_lib.TrainConfig:
  values = {f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(_D)}
  return train_lib.TrainConfig(**values)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = config_from_flags()
  if cfg.save_every:
    sys.exit("trainer.py: error: --save_every: checkpointing is not built yet; leave it at 0")
  try:
    train_lib.train(cfg)
  except (train_lib.ConfigError, data_lib.DataError) as e:
    sys.exit(f"trainer.py: error: {e}")


if __name__ == "__main__":
  app.run(main)
