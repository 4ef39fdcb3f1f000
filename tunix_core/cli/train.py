"""`trainer.py`'s command line: one flag per `TrainConfig` field, and `main`.

Every run flag is generated from a field of `training.config.TrainConfig` (its default
and help text); `trainer.py` adds the job's own (`--coordinator_address` and the rest,
`--library_logging`). Bad settings end the run with one `trainer.py: error:` line before
anything is compiled; every failure is one line and a status of `run.exit_status`.

Only what the flags and the job's start need is imported up front: the rest (the loop,
Orbax, the data and weight readers, the kernels' callers) is imported once the backend
has started on its thread, so that opening the chips (seconds on a TPU host) overlaps it.
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

from tunix_core.run import distributed
from tunix_core.run import exit_status
from tunix_core.run import host_buffer
from tunix_core.run import logs
from tunix_core.storage import paths
from tunix_core.training import config as config_lib

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
      _DEFINE[type(field.default)](field.name, field.default, help_text)


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


def _run(cfg, terminal) -> None:
  """Joins the job, opens the compilation cache, then compiles only or trains."""
  say = lambda line: print(line, flush=True)
  f = flags.FLAGS
  job = distributed.plan(f.coordinator_address, f.num_processes, f.process_id)
  distributed.join(job, f.coordinator_timeout, say, terminal)
  if not cfg.compile_only:  # (an ahead-of-time compile opens no chip)
    sized = host_buffer.size_for(cfg)
    if sized:
      say(sized)
    distributed.start_backend()
  # pylint: disable=g-import-not-at-top - beside the backend's start (module docstring)
  from tunix_core.aot import compile as aot
  from tunix_core.aot import levers
  from tunix_core.run import compile_cache
  from tunix_core.run import loop as train_lib
  from tunix_core.run import watchdog
  # (process_index() would start a backend, and --compile_only needs none of its own.)
  # The cache may be on the run's storage: its calls get the watchdog's bound too.
  with watchdog.Watchdog(cfg.step_timeout) as dog:
    dog.beat("start-up: the compilation cache", first=True)
    compile_cache.enable(cfg.compilation_cache_dir, cfg.output_dir, say,
                         primary=job.kwargs is None or jax.process_index() == 0)
  if cfg.compile_only:
    sys.exit(aot.compile_only(cfg, cfg.target_topology,
                              then=levers.compare if cfg.compare_levers else None))
  train_lib.train(cfg)


def main(argv):
  """The trainer: every failure ends it with one line on the terminal and its status."""
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
    _run(config_from_flags(), terminal)
  except Exception as e:  # noqa: BLE001 - one line on the terminal, the traceback in the log
    fail(*_failure(e, log_path))


def _failure(e: Exception, log_path: str) -> tuple[str, int]:
  """`(line, status)` of the run's failure `e` (its traceback, when unexpected, goes to
  the log). The error classes are looked up among the modules already imported (`e`
  cannot be one of a module never imported, and importing one here could fail again)."""
  def kinds(*names: str) -> tuple:
    found = []
    for name in names:
      module, _, cls = name.rpartition(".")
      found.append(getattr(sys.modules.get(f"tunix_core.{module}"), cls, None))
    return tuple(k for k in found if k is not None)

  if isinstance(e, kinds("checkpoints.store.CheckpointWriteError")):
    return f"error: {e} (library messages in {log_path})", exit_status.CHECKPOINT_WRITE
  if isinstance(e, kinds("training.health.NonFiniteStep")):
    return f"error: {e}", exit_status.NONFINITE
  if isinstance(e, (config_lib.ConfigError, paths.StorageError) + kinds(
      "data.DataError", "checkpoints.store.CheckpointError", "hf.config.HFError",
      "hf.tokenizer.TokenizerError", "online.RewardError")):
    return f"error: {e}", exit_status.ERROR  # bad input: one line, status 1
  if isinstance(e, kinds("run.preemption.Preempted")):
    return f"{e}; exiting with status {exit_status.PREEMPTED}", exit_status.PREEMPTED
  traceback.print_exc(file=sys.stderr)
  first_line = (str(e).splitlines() or [""])[0][:300]
  return (f"error: unexpected {type(e).__name__}: {first_line} (traceback in {log_path})",
          exit_status.ERROR)
