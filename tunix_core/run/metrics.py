"""Metrics: the `metrics.jsonl` writer and the progress lines of a run.

`Progress` reads a step's metrics from the device only when asked to `flush`, which the
loop does after it has queued the next step, so logging never makes the device wait.
"""

import json
import time

import jax

from tunix_core.storage import paths


class MetricsWriter:
  """Writes one JSON object per row to `{output_dir}/metrics.jsonl` (local or remote).

  A fresh run (`resume_step=0`) starts the file anew; a resumed run keeps the rows up
  to its checkpoint step and drops later ones, which the resumed run writes again.
  Locally rows are appended and flushed one by one. Object storage cannot append: there
  the whole file is uploaded again after every row (a few KB per 10 rows). Every row
  also goes to `sinks` (`run.observe`: TensorBoard, W&B), which `close` closes.
  """

  def __init__(self, output_dir: str, resume_step: int = 0, log=print, sinks=()):
    self.sinks = list(sinks)
    self.path = paths.join(output_dir, "metrics.jsonl")
    kept, dropped = [], 0
    if resume_step and paths.exists(self.path):
      for line in paths.read_text(self.path).splitlines(keepends=True):
        row = parse_row(line)
        if row is None:
          dropped += bool(line.strip())
        elif row["step"] <= resume_step:
          kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
      log(f"warning: {self.path}: dropped {dropped} unparseable or foreign line(s) "
          "(e.g. torn by a kill during a write)")
    self._lines = kept if paths.is_remote(self.path) else None
    if self._lines is None:
      self._file = open(self.path, "w", encoding="utf-8")
      self._file.writelines(kept)
      self._file.flush()
    else:
      paths.write_text(self.path, "".join(kept))

  def write(self, row: dict) -> None:
    line = json.dumps(row) + "\n"
    if self._lines is None:
      self._file.write(line)
      self._file.flush()
    else:
      self._lines.append(line)
      paths.write_text(self.path, "".join(self._lines))
    for sink in self.sinks:
      sink.write(row)

  def samples(self, step: int, rows: list) -> None:
    """`--sample_every`'s completions at `step` (dicts of "prompt", "completion") for
    the sinks (`samples.jsonl` is the sampler's own file)."""
    for sink in self.sinks:
      sink.samples(step, rows)

  def note(self, key: str, text: str) -> None:
    """A fact of the run that is not a metric (a checkpoint's digest) for the sinks."""
    for sink in self.sinks:
      sink.note(key, text)

  def close(self, upload: bool = True) -> None:
    """Closes the file and the sinks; `upload=False` (a run ending in an error, maybe of
    the storage itself) skips the sinks' last upload to object storage."""
    if self._lines is None:
      self._file.close()
    for sink in self.sinks:
      sink.close(upload)


def parse_row(line: str) -> dict | None:
  """A metrics row (a JSON object with an integer `step`), or None for anything else."""
  try:
    row = json.loads(line)
  except ValueError:
    return None
  ok = isinstance(row, dict) and isinstance(row.get("step"), int)
  return row if ok else None


def format_duration(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else \
      f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
  """Turns train and eval metrics into rows and progress lines for steps `start+1 ..
  total`.

  `tokens_per_sec` counts the non-padding tokens trained on since the previous logged
  row (`count_tokens` is told each batch), over the wall time since that row. With
  `step_flops` (model FLOPs of one step, `tunix_core.training.flops`) and `peak_flops` (of all the
  run's devices together), rows also carry `mfu`: the steps since the previous row times
  `step_flops`, over that wall time and `peak_flops`.
  """

  def __init__(self, writer: MetricsWriter | None, log, start: int, total: int,
               step_flops: float = 0.0, peak_flops: float = 0.0):
    self.writer, self.log, self.start, self.total = writer, log, start, total
    self.step_flops, self.peak_flops, self.step_at_last = step_flops, peak_flops, start
    self.t_start = self.t_last = time.perf_counter()
    self.tokens = self.tokens_at_last = 0
    self.pending = None
    self.last_train, self.last_eval = {}, {}

  def count_tokens(self, n: int) -> None:
    self.tokens += n

  def defer(self, step: int, metrics: dict) -> None:
    """Remembers `step`'s (device) metrics, to be read and logged at the next `flush`."""
    self.pending = (step, metrics, self.tokens)

  def flush(self):
    """Reads and logs the deferred step, if any (blocks until that step is done); returns
    the state's non-finite record `[count, first step, bits]` after it, or None."""
    if self.pending is None:
      return None
    step, metrics, tokens = self.pending
    self.pending = None
    m = jax.device_get(metrics)
    health = m.pop("nonfinite", None)
    m = {k: float(v) for k, v in m.items()}
    now = time.perf_counter()
    dt = now - self.t_last
    row = {"step": step, **m, "tokens_per_sec": (tokens - self.tokens_at_last) / dt}
    mfu = ""
    if self.step_flops and self.peak_flops:
      row["mfu"] = (step - self.step_at_last) * self.step_flops / dt / self.peak_flops
      mfu = f" | MFU {row['mfu']:.1%}"
    self.tokens_at_last, self.t_last, self.step_at_last = tokens, now, step
    self._write(row)
    eta = (now - self.t_start) / (step - self.start) * (self.total - step)
    self.log(f"step {step}/{self.total} | loss {m['loss']:.4f} | "
             f"acc {m['rewards/accuracies']:.3f} | margin {m['rewards/margins']:.3f} | "
             f"{row['tokens_per_sec']:,.0f} tok/s{mfu} | ETA {format_duration(eta)}")
    self.last_train = row
    return health

  def eval(self, step: int, metrics: dict) -> None:
    """Logs `{"eval/<key>": value}` metrics of the eval set at `step`."""
    self._write({"step": step, **metrics})
    self.log(f"eval @ {step} | loss {metrics['eval/loss']:.4f} | "
             f"acc {metrics['eval/rewards/accuracies']:.3f} | "
             f"margin {metrics['eval/rewards/margins']:.3f}")
    self.last_eval = metrics

  def elapsed(self) -> str:
    return format_duration(time.perf_counter() - self.t_start)

  def _write(self, row: dict) -> None:
    if self.writer is not None:
      self.writer.write(row)

  def close(self, upload: bool = True) -> None:
    if self.writer is not None:
      self.writer.close(upload)
