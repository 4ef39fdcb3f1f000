"""`--reward_fn=MODULE:FUNCTION`: importing the reward and calling it as TRL does.

TRL calls a reward function with keyword arguments: `fn(prompts=..., completions=...,
completion_ids=..., **columns) -> list[float]`, one finite score per completion. The
prompts and completions are message lists for conversational data (the completion one
assistant message), strings otherwise; `completion_ids` are each completion's ids up to
and including its EOS; `columns` every other column of the data's row (a reference
answer, say), one value per completion. A function that takes `**kwargs` gets them all;
one that names some gets those by name; one with neither a `prompts` nor a `completions`
parameter (the plain `(prompts, completions)` protocol under other names) is called
with the two positionally. Conversational data gives message lists to every form. One that cannot be imported is a `ConfigError` at start-up (before
anything compiles); one that raises, returns the wrong number of scores or a non-finite
score is a `RewardError` naming it and the step.
"""

import importlib
import inspect

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


def _call(fn, inputs: dict):
  """`fn` called on `inputs` (`prompts`, `completions`, `completion_ids`, columns) as
  its signature allows (module docstring)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # a builtin without a signature: the plain protocol
    params = ()
  if any(p.kind == p.VAR_KEYWORD for p in params):
    return fn(**inputs)
  named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  if named & {"prompts", "completions"}:
    return fn(**{k: v for k, v in inputs.items() if k in named})
  return fn(inputs["prompts"], inputs["completions"])


def score(fn, name: str, at: str, **inputs) -> np.ndarray:
  """`fn`'s scores of `inputs["completions"]` as float64 `[n]`; `RewardError` naming
  it (`name`, e.g. "--reward_fn=m:f") and `at` (e.g. "step 12") when it raises or
  returns anything but n finite numbers."""
  where, n = f"{name} at {at}", len(inputs["completions"])
  try:
    scores = _call(fn, inputs)
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
  if len(scores) != n:
    raise RewardError(f"{where} returned {len(scores)} scores for {n} completions")
  bad = np.flatnonzero(~np.isfinite(scores))
  if len(bad):
    raise RewardError(f"{where} returned the non-finite score {scores[bad[0]]} for "
                      f"completion {bad[0]}")
  return scores
