"""Library output of a trainer process: all of it to a log file, a few lines to the terminal.

JAX, Orbax and TensorStore log through Python `logging` (absl), and their background
threads print tracebacks straight to `sys.stderr`: one failed checkpoint write alone
prints hundreds of lines. `route_library_output` sends all of that to a log file that
never raises (a full disk or a file-size limit only drops text), and lets through to the
terminal at most a few library warnings, one line each, then one line saying where the
rest went. The trainer's own progress lines go to stdout and are not touched.
"""

import io
import logging
import sys

from absl import logging as absl_logging


class SafeFile(io.TextIOBase):
  """A text stream appending to `path` that never raises: once a write fails (or the
  file cannot be opened) further text is dropped, so logging cannot crash the run."""

  def __init__(self, path: str):
    try:
      self._file = open(path, "a", encoding="utf-8", errors="replace")
    except OSError:
      self._file = None

  def writable(self) -> bool:
    return True

  def write(self, text: str) -> int:
    if self._file is not None:
      try:
        self._file.write(text)
        self._file.flush()
      except (OSError, ValueError):
        self._file = None
    return len(text)

  def flush(self) -> None:
    pass


class _TerminalHandler(logging.Handler):
  """First lines of library records on the terminal, at most `limit` of them."""

  def __init__(self, stream, limit: int | None, log_path: str):
    super().__init__()
    self.stream, self.limit, self.log_path, self.shown = stream, limit, log_path, 0

  def emit(self, record: logging.LogRecord) -> None:
    try:
      if self.limit is not None and self.shown >= self.limit:
        if self.shown == self.limit:
          self.stream.write(f"(further library messages only in {self.log_path})\n")
        self.shown += 1
        return
      message = record.getMessage().splitlines() or [""]
      self.stream.write(f"{record.levelname[0]} {record.name}: {message[0][:300]}\n")
      self.shown += 1
    except Exception:  # noqa: BLE001 - a broken terminal must not become a traceback
      pass


def route_library_output(log_path: str, *, verbose: bool = False,
                         max_terminal_lines: int = 5):
  """Sends library logging and stray `sys.stderr` output to `log_path`; returns the
  terminal's stderr stream for the trainer's own error lines.

  The terminal gets library warnings and errors (with `verbose`, INFO too and no limit),
  at most `max_terminal_lines` of them, first lines only.
  """
  terminal = sys.stderr
  sink = SafeFile(log_path)
  root = logging.getLogger()
  for handler in list(root.handlers):  # absl's handler writes to stderr itself
    root.removeHandler(handler)
  to_file = logging.StreamHandler(sink)
  to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
  to_terminal = _TerminalHandler(terminal, None if verbose else max_terminal_lines, log_path)
  to_terminal.setLevel(logging.INFO if verbose else logging.WARNING)
  root.addHandler(to_file)
  root.addHandler(to_terminal)
  root.setLevel(logging.INFO)
  absl_logging.set_verbosity(absl_logging.INFO)
  logging.captureWarnings(True)
  logging.raiseExceptions = False  # a failing handler never prints a traceback
  sys.stderr = sink  # tracebacks of background threads and unraisable exceptions
  return terminal
