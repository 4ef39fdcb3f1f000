"""`--reward_fn=MODULE:FUNCTION`: importing the reward and calling it safely.

The reward is a Python callable `(prompts: list[str], completions: list[str]) ->
list[float]`, one finite score per completion, called on the host of the primary
process. One that cannot be imported is a `ConfigError` at start-up (before anything
compiles); one that raises, returns the wrong number of scores or a non-finite score is
a `RewardError` naming it and the step.
"""

import importlib

import numpy as np

from tunix_core.training.validation import ConfigError


class RewardError(RuntimeError):
  """The reward function failed at a step; the message names it and the step."""


def load(spec: str):
  """The callable `spec` ("MODULE:FUNCTION") names; `ConfigError` if there is none."""
  module, sep, name = spec.partition(":")
  if not (sep and module and name):
    raise ConfigError(f"--reward_fn={spec!r}: expected MODULE:FUNCTION")
  try:
    fn = getattr(importlib.import_module(module), name)
  except Exception as e:  # noqa: BLE001 - an import runs arbitrary code
    raise ConfigError(f"--reward_fn={spec!r} cannot be imported: {type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0][:200]}") from None
  if not callable(fn):
    raise ConfigError(f"--reward_fn={spec!r} is a {type(fn).__name__}, not a function")
  return fn


def score(fn, spec: str, prompts: list[str], completions: list[str], at: str) -> np.ndarray:
  """`fn`'s scores of the completions as float64 `[n]`; `RewardError` naming `spec` and
  `at` (e.g. "step 12") when it raises or returns anything but n finite numbers."""
  where = f"--reward_fn={spec} at {at}"
  try:
    scores = fn(list(prompts), list(completions))
  except Exception as e:  # noqa: BLE001 - the user's code: one line, not a traceback
    raise RewardError(f"{where} raised {type(e).__name__}: "
                      f"{(str(e).splitlines() or [''])[0][:200]}") from None
  try:
    if isinstance(scores, (str, bytes)) or not hasattr(scores, "__len__"):
      raise TypeError
    scores = np.asarray(scores, np.float64).reshape(-1)
  except (TypeError, ValueError):
    raise RewardError(f"{where} returned {type(scores).__name__}, not a list of "
                      "numbers") from None
  if len(scores) != len(completions):
    raise RewardError(f"{where} returned {len(scores)} scores for {len(completions)} "
                      "completions")
  bad = np.flatnonzero(~np.isfinite(scores))
  if len(bad):
    raise RewardError(f"{where} returned the non-finite score {scores[bad[0]]} for "
                      f"completion {bad[0]}")
  return scores
