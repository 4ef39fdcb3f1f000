"""Reward functions `tests/test_online.py` passes as `--reward_fn=online_rewards:NAME`
(the trainer subprocesses get `tests/` on their PYTHONPATH)."""

import math

calls = 0


def checksum(prompts, completions):
  """A deterministic score that rarely ties even for an untrained model's samples."""
  return [float(sum(map(ord, c)) % 7) for c in completions]


def raises_at_third_call(prompts, completions):
  """`checksum` for two calls (two steps), then an error."""
  global calls
  calls += 1
  if calls == 3:
    raise KeyError("no score for this one")
  return checksum(prompts, completions)


def one_short(prompts, completions):
  return [1.0] * (len(completions) - 1)


def not_finite(prompts, completions):
  return [math.nan] + [1.0] * (len(completions) - 1)


NOT_CALLABLE = 3


def ones(prompts, completions):
  """How many "1" characters the completion holds: a reward an untrained policy can
  climb."""
  return [float(c.count("1")) for c in completions]


def trl_accuracy(prompts, completions, completion_ids, solution, **kwargs):
  """A reward written for TRL's trainers: keyword arguments, message lists, the data's
  `solution` column. 1.0 where the answer's text is the solution."""
  assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts), prompts
  assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
  assert len(completion_ids) == len(completions) and "chosen" in kwargs
  return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]
