"""Metrics: the `metrics.jsonl` writer and the progress lines of a run.

`Progress` reads a step's metrics from the device only when asked to `flush`, which the
loop does after it has queued the next step, so logging never makes the device wait.
"""

import json
import threading
import time

import jax

from tunix_core.storage import compose
from tunix_core.storage import paths


# Cloud Storage caps a composed object at 1,024 components: after this many appends the
# file is written whole once (its bytes again, once per this many uploads).
APPENDS_PER_REWRITE = 500
# Train metrics that are means over a step's valid pairs (`training.accumulate`): absent from
# the row of a step that had none (`pairs` 0).
PAIR_METRICS = ("loss", "rewards/", "logps/")
# The longest wait between tries of a failed upload (doubling from 1 s), and how many
# tries `sync` waits for before it gives up (each after the path layer's own retries).
_MAX_BACKOFF_SECONDS = 60.0
_SYNC_TRIES = 3


class _Uploads:
  """Rows appended to `path` on object storage by a daemon thread: each upload sends the
  rows added since the last (`compose.append_bytes`: a compose, nothing sent again). A
  failed upload is logged once and tried again with the same rows (backing off, and at
  once on `sync`), so an append that went through with its reply lost is recognised by
  the object's size and not made twice; the rows wait in memory."""

  def __init__(self, path: str, kept: list, log):
    self.path, self.log = path, log
    self.lines = list(kept)  # every row of the file: the periodic whole rewrite's source
    text = "".join(self.lines)
    paths.write_text(path, text)
    self.sent, self.appends, self.failures, self.error = len(self.lines), 0, 0, None
    self.size = len(text.encode("utf-8"))  # bytes of the rows sent: what the object holds
    self.retry = None  # the end of the rows of a failed upload, sent again as they were
    self.closing = False
    self.cond = threading.Condition()
    self.thread = threading.Thread(target=self._run, name="metrics-uploads", daemon=True)
    self.thread.start()

  def add(self, line: str) -> None:
    with self.cond:
      self.lines.append(line)
      self.cond.notify_all()

  def _run(self) -> None:
    backoff = 1.0
    while True:
      with self.cond:
        self.cond.wait_for(lambda: self.closing or len(self.lines) > self.sent)
        start, end = self.sent, self.retry or len(self.lines)
        if start >= end:
          return  # closing: everything sent, or dropped (`close`)
      data = "".join(self.lines[start:end]).encode("utf-8")
      try:
        if self.appends >= APPENDS_PER_REWRITE:
          paths.write_text(self.path, "".join(self.lines[:end]))
          self.appends = 0
        else:
          compose.append_bytes(self.path, data, self.size)
          self.appends += 1
      except paths.StorageError as e:
        with self.cond:
          self.retry = end
          if self.error is None:
            self.log(f"warning: {e}; keeping the rows and trying again")
          self.failures, self.error = self.failures + 1, e
          self.cond.notify_all()
          self.cond.wait(timeout=backoff)  # a `sync` or `close` cuts the wait short
        backoff = min(2 * backoff, _MAX_BACKOFF_SECONDS)
        continue
      with self.cond:
        self.sent, self.error, backoff = max(self.sent, end), None, 1.0
        self.size, self.retry = self.size + len(data), None
        self.cond.notify_all()

  def sync(self) -> None:
    """Returns once every row added so far is in the object; raises the `StorageError`
    of the last upload once `_SYNC_TRIES` uploads failed after this call began."""
    with self.cond:
      target, failures = len(self.lines), self.failures
      self.cond.notify_all()
      self.cond.wait_for(lambda: self.sent >= target
                         or self.failures >= failures + _SYNC_TRIES)
      if self.sent < target:
        raise self.error

  def close(self, upload: bool) -> None:
    """Sends what is left (`upload`; raising as `sync` does) and stops the thread; rows
    still unsent are dropped (the error path uploads nothing more)."""
    try:
      if upload:
        self.sync()
    finally:
      with self.cond:
        self.closing, self.sent = True, len(self.lines)
        self.cond.notify_all()


class MetricsWriter:
  """Writes one JSON object per row to `{output_dir}/metrics.jsonl` (local or remote).

  A fresh run (`resume_step=0`) starts the file anew; a resumed run keeps the rows up
  to its checkpoint step and drops later ones, which the resumed run writes again.
  Locally rows are appended and flushed one by one. Object storage cannot append: there
  rows go up from a background thread, each upload composing the new rows onto the
  object (`_Uploads`), so the bytes sent grow with the file, not its square, and the
  loop never waits on the network but in `sync` (before a checkpoint: the rows up to a
  saved step are stored before the step commits) and `close`. Every row also goes to
  `sinks` (`run.observe`: TensorBoard, W&B), which `close` closes.
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
    self._uploads = _Uploads(self.path, kept, log) if paths.is_remote(self.path) else None
    if self._uploads is None:
      self._file = open(self.path, "w", encoding="utf-8")
      self._file.writelines(kept)
      self._file.flush()

  def write(self, row: dict) -> None:
    line = json.dumps(row) + "\n"
    if self._uploads is None:
      self._file.write(line)
      self._file.flush()
    else:
      self._uploads.add(line)
    for sink in self.sinks:
      sink.write(row)

  def sync(self) -> None:
    """Blocks until every row written so far is stored (remote: uploaded); a failed
    upload is its `StorageError`."""
    if self._uploads is not None:
      self._uploads.sync()

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
    """Closes the file (remote: uploads the rows left) and the sinks; `upload=False` (a
    run ending in an error, maybe of the storage itself) uploads nothing more."""
    if self._uploads is None:
      self._file.close()
    else:
      self._uploads.close(upload)
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
    if not m.get("pairs", 1):  # nothing to average: no loss, not a loss of 0
      m = {k: v for k, v in m.items() if not k.startswith(PAIR_METRICS)}
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
    pair = (f"loss {m['loss']:.4f} | acc {m['rewards/accuracies']:.3f} | "
            f"margin {m['rewards/margins']:.3f}" if "loss" in m
            else "no valid pair: nothing updated")
    self.log(f"step {step}/{self.total} | {pair} | "
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
