"""DPO trainer: `python trainer.py --flagfile=configs/quickstart.flags`.

Every run flag maps to a field of `tunix_core.config.TrainConfig`; bad settings end the
run with one `trainer.py: error:` line before anything is compiled.
"""

import dataclasses
import os
import re
import sys
import traceback

import jax
from absl import app
from absl import flags

from tunix_core import aot
from tunix_core import checkpoint
from tunix_core import config as config_lib
from tunix_core import data as data_lib
from tunix_core import hf_config
from tunix_core import health
from tunix_core import hf_tokenizer
from tunix_core import logs
from tunix_core import preemption
from tunix_core import train as train_lib

_D = config_lib.TrainConfig  # defaults come from the config dataclass, in one place
_DEF = {f.name: f.default for f in dataclasses.fields(_D)}


def _define_choice(name: str, help_text: str) -> None:
  """A `DEFINE_enum` flag whose values are the config's `CHOICES[name]`."""
  flags.DEFINE_enum(name, _DEF[name], list(config_lib.CHOICES[name]), help_text)

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
_define_choice("resume", "auto: resume from the latest complete checkpoint if any, else "
               "start fresh; never: start fresh, and refuse a directory that has "
               "checkpoints; required: fail without a usable checkpoint.")
flags.DEFINE_bool("verify_checkpoint", _DEF["verify_checkpoint"], "On resume, recompute "
                  "every restored array's fingerprint and compare with the saved one; a "
                  "step that fails is moved aside and the previous one is used (auto).")
_define_choice("on_nonfinite", "stop: end the run (exit status 3) at a step whose loss, "
               "metrics or gradient norm is NaN/Inf, without applying or saving it; "
               "skip: skip such steps' updates and count them.")
# Multi-process (JAX's multi-controller runtime, as on TPU pods).
flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator; "
                    "with --num_processes and --process_id calls jax.distributed.initialize.")
flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1.")
# Gradient sync.
flags.DEFINE_float("bucket_mb", _DEF["bucket_mb"], "Gradient bucket size in MiB for the "
                   "bucketed reduce-scatter / all-gather.")
_define_choice("sync_impl", "xla: one psum_scatter and all_gather per bucket; ring: "
               "hand-written ppermute ring.")
_define_choice("grad_sync_dtype", "Dtype of gradients on the wire; sums accumulate in float32.")
flags.DEFINE_integer("grad_accum_steps", _DEF["grad_accum_steps"], "Micro-batches per step; "
                     "gradients are synced once per step (under --fsdp: per micro-batch).")
flags.DEFINE_bool("fsdp", _DEF["fsdp"], "Fully sharded data parallel (ZeRO-3): params, "
                  "gradients, the reference and the optimizer state split over all devices; "
                  "each layer all-gathered inside the layer scan and its gradient "
                  "reduce-scattered per layer. Off: ZeRO-1 (replicated params).")
flags.DEFINE_bool("head_on_scored", _DEF["head_on_scored"], "Run the LM head (policy and "
                  "reference) only on each row's block of scored positions, sized from the "
                  "longest scored span in the data, instead of on every position; exact.")
flags.DEFINE_bool("prefix_sharing", _DEF["prefix_sharing"], "Compute each pair's prompt once "
                  "for the policy, the reference and the backward: one sequence prompt | "
                  "chosen | rejected in which the rejected response restarts its positions "
                  "after the prompt and never sees the chosen one; exact. Needs "
                  "--head_on_scored.")
flags.DEFINE_bool("packing", _DEF["packing"], "Padding-free packing: the pairs of each "
                  "device's micro-batch follow each other in one row (segment ids: "
                  "attention never crosses pairs, positions restart per pair), sized from "
                  "the data; exact and deterministic. Needs --head_on_scored.")
flags.DEFINE_integer("model_parallel", _DEF["model_parallel"], "Tensor parallelism: devices "
                     "of the inner 'model' mesh axis (consecutive devices); heads, MLP "
                     "columns and the vocabulary are split over them Megatron-style, the "
                     "other devices / K shards hold the data (and, with --fsdp, the param "
                     "pieces). 1: none.")
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
_define_choice("model", "Model preset (tiny: CPU-sized; 125m; 1b); ignored with "
               "--hf_model_dir.")
flags.DEFINE_string("hf_model_dir", _DEF["hf_model_dir"], "A Hugging Face model directory "
                    "(config.json, safetensors, tokenizer.json): its config, tokenizer and "
                    "weights are the initial policy and the reference (reloaded from here "
                    "on a resume). Llama, Mistral, Qwen2/3 and Gemma 1/2/3.")
flags.DEFINE_string("chat_template", _DEF["chat_template"], "For conversational pairs: "
                    "auto (the tokenizer's own), none (conversational pairs are an error), "
                    "or a path to a jinja template file.")
_define_choice("param_dtype", "Dtype of the trained params and the optimizer's view of them.")
_define_choice("ref_dtype", "Dtype of the frozen reference params (auto: --param_dtype); "
               "bfloat16 halves their memory.")
flags.DEFINE_string("export_hf_dir", _DEF["export_hf_dir"], "After the last step, write the "
                    "policy here as a Hugging Face directory (with --hf_model_dir's config "
                    "and tokenizer files); empty: no export.")
_define_choice("export_dtype", "Dtype of the exported weights (auto: --param_dtype).")
_define_choice("compute_dtype", "Activation/matmul dtype; params keep --param_dtype.")
_define_choice("remat", "Rematerialisation policy of each layer in the backward pass.")
# Optimizer.
_define_choice("optimizer", "adamw, rmsprop (the DPO paper's) or sgd.")
flags.DEFINE_float("learning_rate", _DEF["learning_rate"], "Peak learning rate.")
flags.DEFINE_integer("warmup_steps", _DEF["warmup_steps"], "Linear warmup steps from 0.")
flags.DEFINE_float("weight_decay", _DEF["weight_decay"], "AdamW decoupled weight decay "
                   "(norm scales excluded).")
flags.DEFINE_float("max_grad_norm", _DEF["max_grad_norm"], "Clip gradients to this global "
                   "norm; 0 disables clipping.")
# Loss.
flags.DEFINE_float("beta", _DEF["beta"], "DPO temperature (KL penalty strength).")
_define_choice("loss_type", "DPO loss: sigmoid (DPO), ipo, hinge or robust.")
flags.DEFINE_float("label_smoothing", _DEF["label_smoothing"], "Assumed label-flip rate for "
                   "sigmoid (conservative DPO) and robust.")
flags.DEFINE_bool("reference_free", _DEF["reference_free"], "Drop the reference model "
                  "(its log-probs are taken as zero).")
flags.DEFINE_bool("precompute_ref_logps", _DEF["precompute_ref_logps"], "Run the reference "
                  "once over the data before training (cached on disk) instead of in every step.")
_define_choice("attention_impl", "Attention: auto (the Pallas flash kernels when compiled "
               "for TPU and rows are a multiple of 128 tokens without sliding window or "
               "soft-cap, else xla), xla (scores materialised), pallas.")
_define_choice("logprob_impl", "kernels.fused_logprobs impl: auto (pallas when "
               "compiled for TPU, else xla), xla, pallas, interpret or naive (the oracle).")
_define_choice("loss_impl", "kernels.dpo_loss impl: auto (pallas when compiled for "
               "TPU, else xla), xla, pallas, interpret or naive (the oracle).")

# Ahead-of-time compilation.
flags.DEFINE_bool("compile_only", _DEF["compile_only"], "Compile the train step of these "
                  "flags for --target_topology and print its per-device memory and cost "
                  "analysis, allocating nothing; exit 0 if it fits, 1 if not.")
_define_choice("target_topology", "Devices --compile_only compiles for: local (this "
               "host's) or a TPU slice (needs libtpu, works on any host).")

# Terminal.
flags.DEFINE_bool("library_logging", False, "Show the INFO logging of JAX, Orbax and other "
                  "libraries on stderr (for debugging); by default at most a few of their "
                  "warnings and errors appear. All of it also goes to "
                  "{output_dir}/trainer.log.")

flags.mark_flags_as_required(["output_dir", "train_data"])


def config_from_flags() -> config_lib.TrainConfig:
  values = {f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(_D)}
  return config_lib.TrainConfig(**values)


def _flag_error(e: flags.Error) -> str:
  """absl's parse error as our one-line message (a bad choice names the choices)."""
  m = re.match(r"flag --(\w+)=(.*): value should be one of", str(e), re.DOTALL)
  if m and m.group(1) in config_lib.CHOICES:
    name, value = m.groups()
    return f"--{name}={value!r} is unknown; choose one of {config_lib.CHOICES[name]}"
  return str(e).splitlines()[0]


def parse_flags(argv: list[str]) -> list[str]:
  """Parses the command line; a bad flag ends the run with one `trainer.py: error:` line
  instead of absl's usage dump."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"trainer.py: error: {_flag_error(e)}")




# Exit statuses besides 0 (done) and 1 (a bad setting, bad data or an unusable checkpoint).
NONFINITE_EXIT_CODE = 3          # a step was NaN/Inf under --on_nonfinite=stop
CHECKPOINT_WRITE_EXIT_CODE = 4   # writing a checkpoint failed (disk full, permissions, ...)
PREEMPTED_EXIT_CODE = 42         # stopped by SIGTERM/SIGINT after its checkpoint committed


def init_distributed() -> None:
  """Joins the multi-process job named by the flags (a no-op without them)."""
  f = flags.FLAGS
  if f.coordinator_address is None:
    return
  if f.num_processes is None or f.process_id is None:
    raise config_lib.ConfigError("--coordinator_address needs --num_processes and "
                                 "--process_id")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f.coordinator_address,
                             num_processes=f.num_processes, process_id=f.process_id)


def _library_log_path(output_dir: str) -> str:
  """`{output_dir}/trainer.log` (one file per process), creating the directory if it can."""
  try:
    os.makedirs(output_dir, exist_ok=True)
  except OSError:
    pass  # train() reports it as a bad --output_dir
  index = flags.FLAGS.process_id or 0  # not jax.process_index(): no backend has started
  name = "trainer.log" if index == 0 else f"trainer.{index}.log"
  return os.path.join(output_dir, name)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = config_from_flags()
  log_path = _library_log_path(cfg.output_dir)
  terminal = logs.route_library_output(log_path, verbose=flags.FLAGS.library_logging)

  def fail(message: str, status: int):
    terminal.write(f"trainer.py: {message}\n")
    terminal.flush()
    sys.exit(status)

  try:
    init_distributed()
    if cfg.compile_only:
      sys.exit(aot.compile_only(cfg, cfg.target_topology))
    train_lib.train(cfg)
  except checkpoint.CheckpointWriteError as e:
    fail(f"error: {e} (library messages in {log_path})", CHECKPOINT_WRITE_EXIT_CODE)
  except health.NonFiniteStep as e:
    fail(f"error: {e}", NONFINITE_EXIT_CODE)
  except (config_lib.ConfigError, data_lib.DataError, checkpoint.CheckpointError,
          hf_config.HFError, hf_tokenizer.TokenizerError) as e:
    fail(f"error: {e}", 1)
  except preemption.Preempted as e:
    fail(f"{e}; exiting with status {PREEMPTED_EXIT_CODE}", PREEMPTED_EXIT_CODE)
  except Exception as e:  # noqa: BLE001 - one line on the terminal, the traceback in the log
    traceback.print_exc(file=sys.stderr)
    first_line = (str(e).splitlines() or [""])[0][:300]
    fail(f"error: unexpected {type(e).__name__}: {first_line} (traceback in {log_path})", 1)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
