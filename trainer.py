"""DPO trainer: `python trainer.py --flagfile=configs/quickstart.flags`.

Every flag maps to a field of `tunix_core.train.TrainConfig`; bad settings end the run
with one error line before anything is compiled.
"""

import dataclasses
import sys

import jax
from absl import app
from absl import flags

from tunix_core import checkpoint
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
flags.DEFINE_integer("save_every", _DEF["save_every"], "Save an asynchronous checkpoint "
                     "every N steps and after the last step (0: only on SIGTERM/SIGINT).")
flags.DEFINE_integer("keep", _DEF["keep"], "Most recent checkpoints to keep.")
flags.DEFINE_integer("keep_period", _DEF["keep_period"], "Also keep every checkpoint whose "
                     "step is a multiple of N, permanently (0: none).")
flags.DEFINE_enum("resume", _DEF["resume"], ["auto", "never", "required"],
                  "auto: resume from the latest complete checkpoint if any, else start "
                  "fresh; never: start fresh, and refuse a directory that has checkpoints; "
                  "required: fail without a usable checkpoint.")
flags.DEFINE_bool("verify_checkpoint", _DEF["verify_checkpoint"], "On resume, recompute "
                  "every restored array's fingerprint and compare with the saved one.")
# Multi-process (JAX's multi-controller runtime, as on TPU pods).
flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator; "
                    "with --num_processes and --process_id calls jax.distributed.initialize.")
flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1.")
# Gradient sync.
flags.DEFINE_float("bucket_mb", _DEF["bucket_mb"], "Gradient bucket size in MiB for the "
                   "bucketed reduce-scatter / all-gather.")
flags.DEFINE_enum("sync_impl", _DEF["sync_impl"], ["xla", "ring"], "xla: one psum_scatter and "
                  "all_gather per bucket; ring: hand-written ppermute ring.")
flags.DEFINE_enum("grad_sync_dtype", _DEF["grad_sync_dtype"], ["float32", "bfloat16"],
                  "Dtype of gradients on the wire; sums accumulate in float32.")
flags.DEFINE_integer("grad_accum_steps", _DEF["grad_accum_steps"], "Micro-batches per step; "
                     "gradients are synced once per step.")
flags.DEFINE_integer("check_replicas_every", _DEF["check_replicas_every"], "Besides after "
                     "step 1, check every N steps that all replicas hold identical params "
                     "(0: only after step 1).")
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
flags.DEFINE_string("optimizer", _DEF["optimizer"], "adamw, rmsprop (the DPO paper's) or "
                    "sgd.")
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


# Exit status of a run stopped by SIGTERM/SIGINT after its checkpoint was committed.
PREEMPTED_EXIT_CODE = 42


def init_distributed() -> None:
  """Joins the multi-process job named by the flags (a no-op without them)."""
  f = flags.FLAGS
  if f.coordinator_address is None:
    return
  if f.num_processes is None or f.process_id is None:
    sys.exit("trainer.py: error: --coordinator_address needs --num_processes and --process_id")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f.coordinator_address,
                             num_processes=f.num_processes, process_id=f.process_id)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = config_from_flags()
  init_distributed()
  try:
    train_lib.train(cfg)
  except (train_lib.ConfigError, data_lib.DataError, checkpoint.CheckpointError) as e:
    sys.exit(f"trainer.py: error: {e}")
  except train_lib.Preempted as e:
    print(f"trainer.py: {e}; exiting with status {PREEMPTED_EXIT_CODE}", file=sys.stderr)
    sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
  app.run(main)
