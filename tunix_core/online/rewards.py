"""Reward functions shipped for the quickstart's tasks (`--reward_fn=MODULE:FUNCTION`).

Every reward is a plain function `(prompts: list[str], completions: list[str]) ->
list[float]`, the protocol `--reward_fn` names. The quickstart's prompts are
`"sort 7 2 9\\n"` (answer: the digits in ascending order, `"2 7 9"`) and `"max 3 8 1\\n"`
(answer: the largest digit, `"8"`); `data/make_data.py` writes them.

- `quickstart`: 1.0 for the exact answer, else partial credit below 0.8 so that
  near-misses rank above nonsense (the online run's reward, `configs/online.flags`);
- `exact_match`: 1.0 for the exact answer, else 0.0;
- `completion_length`: the completion's length in characters (for benchmarks: a reward
  that rarely ties, whatever the model).
"""

import collections


def _task(prompt: str) -> tuple[str, list[int]] | None:
  """`(task, digits)` of a quickstart prompt, None for any other text."""
  words = prompt.split()
  if len(words) < 2 or words[0] not in ("sort", "max") or not all(
      w.isdigit() for w in words[1:]):
    return None
  return words[0], [int(w) for w in words[1:]]


def _answer(task: str, digits: list[int]) -> list[int]:
  return sorted(digits) if task == "sort" else [max(digits)]


def _score(prompt: str, completion: str) -> float:
  """The partial-credit score of one completion (see `quickstart`)."""
  parsed = _task(prompt)
  if parsed is None:
    return 0.0
  task, digits = parsed
  want = _answer(task, digits)
  words = completion.split()
  if completion.strip() == " ".join(map(str, want)):
    return 1.0
  got = [int(w) for w in words if w.isdigit() and len(w) == 1]
  if not got:
    return 0.0
  # The digits taken from the prompt (as multisets), and the answer's in the right place,
  # each over the longer of answer and completion: extra or missing words cost too.
  longer = max(len(want), len(words))
  shared = sum((collections.Counter(got) & collections.Counter(digits)).values()) / longer
  placed = sum(g == w for g, w in zip(got, want)) / longer
  return 0.4 * shared + 0.35 * placed


def quickstart(prompts: list[str], completions: list[str]) -> list[float]:
  """1.0 for the exact answer; else `0.4 * shared + 0.35 * placed` < 0.8: the shares of
  the completion's digits taken from the prompt and of the answer's digits in place
  (each over the longer of answer and completion, so extra words cost too); 0.0 for
  nonsense or a prompt of no quickstart task."""
  return [_score(p, c) for p, c in zip(prompts, completions)]


def exact_match(prompts: list[str], completions: list[str]) -> list[float]:
  """1.0 where the completion is the exact answer (surrounding whitespace aside)."""
  return [float(_score(p, c) == 1.0) for p, c in zip(prompts, completions)]


def completion_length(prompts: list[str], completions: list[str]) -> list[float]:
  """The completion's length in characters."""
  del prompts
  return [float(len(c)) for c in completions]
