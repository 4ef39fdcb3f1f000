"""Stopping cleanly on SIGTERM/SIGINT: the loop saves the step it reached, then exits."""

import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preempted(Exception):
  """Raised after a SIGTERM/SIGINT: `step` was saved and committed."""

  def __init__(self, step: int):
    super().__init__(f"preempted: saved step {step}")
    self.step = step


class StopSignal:
  """Turns SIGTERM/SIGINT into a flag the loop polls between steps (single process).

  With several processes JAX's preemption sync point decides instead, so that every
  process stops after the same step.
  """

  def __init__(self):
    self.received = None
    self._previous = {}

  def __enter__(self):
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signum

  def should_stop(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.received is not None

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
