"""DPO trainer: `python trainer.py --flagfile=configs/quickstart.flags`.

Every run flag is generated from a field of `tunix_core.training.config.TrainConfig`
(its default and help text); bad settings end the run with one `trainer.py: error:`
line before anything is compiled.
"""

import dataclasses
import logging
import os
import re
import sys
import tempfile
import traceback

import jax
from absl import app
from absl import flags

from tunix_core import data as data_lib
from tunix_core import online
from tunix_core.aot import compile as aot
from tunix_core.checkpoints import store as checkpoint
from tunix_core.hf import config as hf_config
from tunix_core.hf import tokenizer as hf_tokenizer
from tunix_core.run import compile_cache
from tunix_core.run import distributed
from tunix_core.run import logs
from tunix_core.run import loop as train_lib
from tunix_core.run import preemption
from tunix_core.run import watchdog
from tunix_core.storage import paths
from tunix_core.training import config as config_lib
from tunix_core.training import health

_FIELDS = dataclasses.fields(config_lib.TrainConfig)
_DEFINE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
           str: flags.DEFINE_string}


def define_run_flags() -> None:
  """One flag per `TrainConfig` field: its default, its help text and, for a choice
  setting, `config.CHOICES` as an enum."""
  for field in _FIELDS:
    help_text = field.metadata["help"]
    if field.name in config_lib.CHOICES:
      flags.DEFINE_enum(field.name, field.default, list(config_lib.CHOICES[field.name]),
                        help_text)
    else:
      kind = type(field.default)
      _DEFINE[kind](field.name, field.default, help_text)


define_run_flags()
# Multi-process (JAX's multi-controller runtime). On a TPU pod none is needed: each host
# joins the job from the TPU environment.
flags.DEFINE_string("coordinator_address", None, "host:port of process 0's coordinator "
                    "(with --num_processes and --process_id): for CPU hosts and tests, "
                    "over gloo. Without it a multi-host TPU job joins on its own "
                    "(docs/training.md: the rule that decides).")
flags.DEFINE_integer("num_processes", None, "Number of processes in the job.")
flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1.")
flags.DEFINE_float("coordinator_timeout", 45.0, "Seconds a multi-host job may take to join "
                   "(all hosts started, the coordinator reached) before the run ends with "
                   "status 1; raise it where hosts start far apart.")
# Terminal.
flags.DEFINE_bool("library_logging", False, "Show the INFO logging of JAX, Orbax and other "
                  "libraries on stderr (for debugging); by default at most a few of their "
                  "warnings and errors appear. All of it also goes to "
                  "{output_dir}/trainer.log.")

def config_from_flags() -> config_lib.TrainConfig:
  """The run config of the parsed flags."""
  return config_lib.TrainConfig(**{field.name: flags.FLAGS[field.name].value
                                   for field in _FIELDS})


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
# 5 (`run.watchdog.EXIT_STATUS`): a step, eval, save or storage call outlived --step_timeout
# (the watchdog's thread ends the process: a hung thread cannot be interrupted).


def _library_log_path(output_dir: str) -> str:
  """`{output_dir}/trainer.log` (one file per process), creating the directory if it can;
  for a remote `output_dir` (object storage cannot append) the same name in this
  host's temporary directory."""
  index = flags.FLAGS.process_id or 0  # not jax.process_index(): no backend has started
  name = "trainer.log" if index == 0 else f"trainer.{index}.log"
  if paths.is_remote(output_dir):
    return os.path.join(tempfile.gettempdir(), f"tunix-{os.getpid()}-{name}")
  try:
    os.makedirs(output_dir, exist_ok=True)
  except OSError:
    pass  # train() reports it as a bad --output_dir
  return os.path.join(output_dir, name)


def _exit_now(status: int) -> None:
  """Ends the process with `status` once output is flushed, without the interpreter's
  shutdown: that joins every non-daemon thread, and after a failed asynchronous save
  (the storage server gone) Orbax's signal-waiting threads (`futures.future`,
  `signaling_client.blocking_key_value_get`) wait for ever for the save's completion
  signal. That was the trainer's intermittent hang after the storage server died. By
  now `train` has closed the checkpointer (what committed stays) and the metrics."""
  sys.stdout.flush()
  logging.shutdown()   # flushes trainer.log
  os._exit(status)  # pylint: disable=protected-access


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS.output_dir:
    sys.exit("trainer.py: error: --output_dir is required")
  log_path = _library_log_path(flags.FLAGS.output_dir)
  terminal = logs.route_library_output(log_path, verbose=flags.FLAGS.library_logging)

  def fail(message: str, status: int):
    terminal.write(f"trainer.py: {message}\n")
    terminal.flush()
    _exit_now(status)

  try:
    cfg = config_from_flags()
    say = lambda line: print(line, flush=True)
    f = flags.FLAGS
    job = distributed.plan(f.coordinator_address, f.num_processes, f.process_id)
    distributed.join(job, f.coordinator_timeout, say, terminal)
    if not cfg.compile_only:  # (an ahead-of-time compile opens no chip)
      distributed.start_backend()
    # (process_index() would start a backend, and --compile_only needs none of its own.)
    # The cache may be on the run's storage: its calls get the watchdog's bound too.
    with watchdog.Watchdog(cfg.step_timeout) as dog:
      dog.beat("start-up: the compilation cache", first=True)
      compile_cache.enable(cfg.compilation_cache_dir, cfg.output_dir, say,
                           primary=job.kwargs is None or jax.process_index() == 0)
    if cfg.compile_only:
      sys.exit(aot.compile_only(cfg, cfg.target_topology))
    train_lib.train(cfg)
  except checkpoint.CheckpointWriteError as e:
    fail(f"error: {e} (library messages in {log_path})", CHECKPOINT_WRITE_EXIT_CODE)
  except health.NonFiniteStep as e:
    fail(f"error: {e}", NONFINITE_EXIT_CODE)
  except (config_lib.ConfigError, data_lib.DataError, checkpoint.CheckpointError,
          hf_config.HFError, hf_tokenizer.TokenizerError, paths.StorageError,
          online.RewardError) as e:
    fail(f"error: {e}", 1)
  except preemption.Preempted as e:
    fail(f"{e}; exiting with status {PREEMPTED_EXIT_CODE}", PREEMPTED_EXIT_CODE)
  except Exception as e:  # noqa: BLE001 - one line on the terminal, the traceback in the log
    traceback.print_exc(file=sys.stderr)
    first_line = (str(e).splitlines() or [""])[0][:300]
    fail(f"error: unexpected {type(e).__name__}: {first_line} (traceback in {log_path})", 1)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
