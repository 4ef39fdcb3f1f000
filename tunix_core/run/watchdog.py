"""A deadline on a run's blocking work (`--step_timeout`): a hung run holds every chip
and nothing restarts it, while a run that exits with a status is restarted by its
orchestrator and resumes from its newest checkpoint.

The loop names each piece of work as it starts it (`beat`): each unit of start-up (a
chunk of the data tokenized, a weight tensor read, a reference batch), compiling the
first step, each train step (named by the step whose batch it reads and dispatches),
each evaluation batch, a sampling, a save, the final wait, the export. A beat restarts
the deadline, so the deadline bounds a stall, never the length of healthy work made of
many units. The deadline is `--step_timeout` seconds; `FIRST_FACTOR` times that for
start-up, the export, and work that compiles (the first two train steps, and the first
evaluation, sampling, save and reference batch of the process). Besides, every storage
call (`storage.paths`, in any thread) must end within `--step_timeout` on its own,
whatever the work around it: a storage server that never answers ends the run as
quickly at start-up as mid-run.

When a deadline passes, a background thread prints one line naming the work (or the
storage call), for how long, and any storage call in flight, writes every thread's
stack to `sys.stderr` (the trainer routes it to `trainer.log`), and ends the process
with `exit_status.WATCHDOG`: nothing else can interrupt a thread blocked in a collective
or a socket.
"""

import os
import sys
import threading
import time
import traceback

from tunix_core.run import exit_status
from tunix_core.storage import paths

FIRST_FACTOR = 4    # start-up, compiles and the export


class Watchdog:
  """Ends the process when the current piece of work outlives its deadline, or a storage
  call outlives `step_timeout`; a timeout of 0 disables it. Use as a context manager
  (the thread stops on exit)."""

  def __init__(self, step_timeout: float, poll: float = 1.0):
    self.step_timeout = float(step_timeout)
    self._what, self._started, self._deadline = None, 0.0, None
    self._kinds = set()   # the kinds of work started once (compiled) in this process
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

  def beat(self, what: str, first: bool = False, kind: str | None = None,
           open_ended: bool = False) -> None:
    """`what` starts now and must end within `--step_timeout`: `FIRST_FACTOR` times that
    when `first`, or when it is the first work of `kind` (e.g. "evaluation") in this
    process, which compiles. `open_ended`: work whose length is not a stall, bounded
    elsewhere: a wait for another process's work (its own watchdog bounds it unit by
    unit, and a dead process ends the job) or a bulk transfer (each storage call's
    clock restarts as data moves): no deadline of its own; storage calls still bounded."""
    first = first or (kind is not None and kind not in self._kinds)
    self._kinds.add(kind)
    if self._thread is None:
      return
    now = time.monotonic()
    limit = self.step_timeout * (FIRST_FACTOR if first else 1)
    with self._lock:
      self._what, self._started = what, now
      self._deadline = None if open_ended else now + limit

  def _watch(self) -> None:
    while not self._done.wait(self._poll):
      with self._lock:
        what, started, deadline = self._what, self._started, self._deadline
      now = time.monotonic()
      if deadline is not None and now > deadline:
        self._expire(what, now - started)
      for call, seconds in paths.in_flight():
        if seconds > self.step_timeout:
          self._expire(f"the storage call {call} (during {what})", seconds, skip=call)

  def _expire(self, what: str, seconds: float, skip: str | None = None) -> None:
    storage = [call for call, _ in paths.in_flight() if call != skip]
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
            f"{exit_status.WATCHDOG}\n")
    sys.__stderr__.write(line)
    sys.__stderr__.flush()
    os._exit(exit_status.WATCHDOG)  # pylint: disable=protected-access
