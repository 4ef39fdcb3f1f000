"""A deadline on a run's blocking work (`--step_timeout`): a hung run holds every chip
and nothing restarts it, while a run that exits with a status is restarted by its
orchestrator and resumes from its newest checkpoint.

The loop names what it starts (`beat`): start-up, compiling and running the first step,
each train step, an evaluation, a save, the final wait, the export. When one is still
running after its deadline (`--step_timeout` seconds; `FIRST_FACTOR` times that for
start-up, the first step with its compilation, and the export), a background thread
prints one line naming it, for how long, and any storage call in flight, writes every
thread's stack to `sys.stderr` (the trainer routes it to `trainer.log`), and ends the
process with `EXIT_STATUS`: nothing else can interrupt a thread blocked in a collective
or a socket.
"""

import os
import sys
import threading
import time
import traceback

from tunix_core.storage import paths

EXIT_STATUS = 5     # the trainer's other statuses: 1 (error), 3, 4 and 42
FIRST_FACTOR = 4    # start-up, compilation and the first step, and the export


class Watchdog:
  """Ends the process when the current piece of work outlives its deadline; a timeout
  of 0 disables it. Use as a context manager (the thread stops on exit)."""

  def __init__(self, step_timeout: float, poll: float = 1.0):
    self.step_timeout = float(step_timeout)
    self._what, self._started, self._deadline = None, 0.0, None
    self._lock, self._done = threading.Lock(), threading.Event()
    self._poll = poll
    self._thread = None
    if self.step_timeout > 0:
      self._thread = threading.Thread(target=self._watch, name="tunix-watchdog", daemon=True)
      self._thread.start()

  def __enter__(self):
    return self

  def __exit__(self, *_):
    self._done.set()

  def beat(self, what: str, first: bool = False) -> None:
    """`what` starts now and must end within `--step_timeout` (`first`: `FIRST_FACTOR`
    times that)."""
    if self._thread is None:
      return
    now = time.monotonic()
    limit = self.step_timeout * (FIRST_FACTOR if first else 1)
    with self._lock:
      self._what, self._started, self._deadline = what, now, now + limit

  def _watch(self) -> None:
    while not self._done.wait(self._poll):
      with self._lock:
        what, started, deadline = self._what, self._started, self._deadline
      if deadline is not None and time.monotonic() > deadline:
        self._expire(what, time.monotonic() - started)

  def _expire(self, what: str, seconds: float) -> None:
    storage = paths.in_flight()
    stacks = [f"--step_timeout: {what} still running after {seconds:.0f} s; every thread:"]
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
      stacks.append(f"Thread {names.get(ident, ident)}:\n"
                    + "".join(traceback.format_stack(frame)))
    try:
      sys.stderr.write("\n".join(stacks) + "\n")
      sys.stderr.flush()
    except Exception:  # noqa: BLE001 - the exit below matters more than the stacks
      pass
    line = (f"trainer.py: error: {what} has not finished after {seconds:.0f} s "
            f"(--step_timeout={self.step_timeout:g})"
            + (f"; storage call in flight: {'; '.join(storage)}" if storage else "")
            + f"; every thread's stack is in the library log; exiting with status "
            f"{EXIT_STATUS}\n")
    sys.__stderr__.write(line)
    sys.__stderr__.flush()
    os._exit(EXIT_STATUS)  # pylint: disable=protected-access
