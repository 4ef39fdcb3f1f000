"""Watching a run: its metric rows in TensorBoard and Weights & Biases, and a profiler
trace of chosen steps. Each is optional and imported only when used.

- `TensorBoard`: the rows of `metrics.jsonl` as scalars (tags exactly its keys, `eval/...`
  included, at the row's step) and `--sample_every`'s completions as a text table (tag
  `samples`, rows prompt and completion), written as `tensorboard`'s own v2 summaries
  (the `tensorboard` extra). Event files cannot be appended to on object storage: for a
  `gs://` directory they are written in a local temporary directory and uploaded whole
  after every row.
- `Wandb`: the same rows (and the samples as a `wandb.Table` under `samples`) to a W&B run (`--wandb_project`; `WANDB_MODE=offline` works with
  no network), with the run config and the model's fingerprint as its config and every
  checkpoint's content digest in its summary. Its id derives from `--output_dir`, so a
  resumed run continues the same W&B run.
- `Profiler`: a JAX profiler trace of steps N..M (`--profile_steps=N:M`) into
  `{output_dir}/profile` (uploaded there from a temporary directory on object storage).

Only process 0 writes any of them.
"""

import dataclasses
import hashlib
import time

import jax
import numpy as np

from tunix_core.storage import paths
from tunix_core.storage import staging


class TensorBoard:
  """Scalars of every metrics row, and sample tables, in event files under `log_dir`
  (local or remote)."""

  def __init__(self, log_dir: str):
    # pylint: disable=g-import-not-at-top
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.proto import summary_pb2
    from tensorboard.plugins.scalar import summary_v2 as scalar
    from tensorboard.plugins.text import summary_v2 as text
    from tensorboard.summary.writer import event_file_writer
    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    self._scalar, self._text = scalar.scalar_pb, text.text_pb
    self.dir = staging.Staged(log_dir, "tunix-tensorboard-")
    self._writer = event_file_writer.EventFileWriter(self.dir.local)

  def _emit(self, step: int, summary) -> None:
    self._writer.add_event(self._event(wall_time=time.time(), step=step, summary=summary))
    self._writer.flush()
    self.dir.upload()

  def write(self, row: dict) -> None:
    summary = self._summary()
    for key, value in row.items():
      if key != "step" and isinstance(value, (int, float)):
        summary.value.extend(self._scalar(key, value).value)
    self._emit(row["step"], summary)

  def samples(self, step: int, rows: list) -> None:
    """`rows` of {"prompt", "completion"}: a two-column table (TensorBoard's text plugin
    draws a 2-D string tensor as a table)."""
    table = np.array([["prompt", "completion"]] + [[r["prompt"], r["completion"]]
                                                   for r in rows], dtype=object)
    self._emit(step, self._text("samples", table))

  def note(self, key: str, text: str) -> None:
    del key, text  # scalars only: digests go to W&B and the log

  def close(self, upload: bool = True) -> None:
    self._writer.close()
    self.dir.close(upload)


class Wandb:
  """A Weights & Biases run of `project` holding the metrics rows; its files under
  `{output_dir}/wandb` (uploaded there at the end when the output is remote)."""

  def __init__(self, project: str, cfg, source: dict):
    import wandb  # pylint: disable=g-import-not-at-top
    self.dir = staging.Staged(paths.join(cfg.output_dir, "wandb"), "tunix-wandb-")
    run_id = hashlib.sha256(cfg.output_dir.encode()).hexdigest()[:16]
    self.run = wandb.init(project=project, id=run_id, resume="allow", dir=self.dir.local,
                          name=cfg.output_dir.rstrip("/").rpartition("/")[-1],
                          config={**dataclasses.asdict(cfg), "source": source})

  def write(self, row: dict) -> None:
    self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

  def samples(self, step: int, rows: list) -> None:
    import wandb  # pylint: disable=g-import-not-at-top
    table = wandb.Table(columns=["step", "prompt", "completion"],
                        data=[[step, r["prompt"], r["completion"]] for r in rows])
    self.run.log({"samples": table}, step=step)

  def note(self, key: str, text: str) -> None:
    self.run.summary[key] = text

  def close(self, upload: bool = True) -> None:
    self.run.finish()
    self.dir.close(upload)


def open_sinks(cfg, source: dict, log) -> list:
  """The metric sinks of this run besides `metrics.jsonl` (process 0 only): TensorBoard
  unless `--tensorboard_dir=none` (one line says how to get it when the extra is
  missing), W&B when `--wandb_project` is set."""
  sinks = []
  if cfg.tensorboard_dir != "none":
    log_dir = cfg.tensorboard_dir or paths.join(cfg.output_dir, "tensorboard")
    try:
      sinks.append(TensorBoard(log_dir))
      log(f"TensorBoard: {log_dir}")
    except ImportError:
      log("TensorBoard: off (pip install 'tunix-core[tensorboard]' writes event files to "
          "--tensorboard_dir)")
  if cfg.wandb_project:
    sinks.append(Wandb(cfg.wandb_project, cfg, source))
    log(f"W&B: project {cfg.wandb_project}, run {sinks[-1].run.id}")
  return sinks


class Profiler:
  """Traces steps `first..last` (`--profile_steps=first:last`; None: never) with the JAX
  profiler into `{output_dir}/profile`."""

  def __init__(self, cfg, log):
    first, _, last = cfg.profile_steps.partition(":")
    self.range = (int(first), int(last or first)) if cfg.profile_steps else None
    self.log = log
    self.dir = None
    self.out = paths.join(cfg.output_dir, "profile")

  def before(self, step: int) -> None:
    if self.range and step == self.range[0]:
      self.dir = staging.Staged(self.out, "tunix-profile-")
      jax.profiler.start_trace(self.dir.local)

  def after(self, step: int, state) -> None:
    if self.dir is not None and step == self.range[1]:
      jax.block_until_ready(state)
      self.stop()
      self.log(f"profile of steps {self.range[0]}-{self.range[1]} written to {self.out}")

  def stop(self) -> None:
    """Ends a trace in progress (a range cut short by the run's end or an error)."""
    if self.dir is not None:
      jax.profiler.stop_trace()
      self.dir.close()  # every process its own trace (one file per host)
      self.dir = None
