"""Preference pairs from scored samples: the best and the worst of each prompt's K.

The batch is the trainer's pair batch (`data.store.PairStore.take`'s layout: int32
`[B, 2, T]` tokens, targets, loss and attention masks), built from the sampled ids as
they are (never re-tokenized). A prompt whose K scores all tie has nothing to prefer:
its pair stays padding, scored nowhere, so it adds nothing to the loss or its gradient
(a batch-coupled loss term, `aot`, still sorts its zero log-ratio with the others); a
batch where every prompt ties scores no token and the step updates nothing
(`training.step`).
"""

import numpy as np

from tunix_core.data import encode as data_encode
from tunix_core.data import packing


def choose(scores_BxK: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(chosen [B], rejected [B], tied [B])`: the first highest and the first lowest
  scored sample of each prompt, and whether all its scores are equal."""
  return (np.argmax(scores_BxK, -1), np.argmin(scores_BxK, -1),
          scores_BxK.max(-1) == scores_BxK.min(-1))


def build(prompts: list, samples_BxKxN: np.ndarray, lengths_BxK: np.ndarray,
          scores_BxK: np.ndarray, pad_id: int, max_length: int) -> dict:
  """The pair batch of `B` prompts (id arrays) and their `K` samples each (`N` ids,
  valid up to `lengths`, an ending EOS included): for each prompt, its best sample
  chosen and its worst rejected, or padding where all tie (`choose`)."""
  B, T = len(prompts), max_length
  batch = {"tokens": np.full((B, 2, T), pad_id, np.int32),
           "targets": np.full((B, 2, T), data_encode.IGNORE_INDEX, np.int32),
           "loss_mask": np.zeros((B, 2, T), np.int32),
           "attention_mask": np.zeros((B, 2, T), np.int32)}
  for b, (best, worst, tied) in enumerate(zip(*choose(scores_BxK))):
    if tied:
      continue
    prompt = [int(t) for t in prompts[b]]
    for c, k in enumerate((best, worst)):
      response = [int(t) for t in samples_BxKxN[b, k, :lengths_BxK[b, k]]]
      row = data_encode.build_row([], prompt, response, pad_id, T, T)
      for key, x in zip(("tokens", "targets", "loss_mask"), row):
        batch[key][b, c] = x
      batch["attention_mask"][b, c, :len(prompt) + len(response) - 1] = 1
  return batch


def worst_sizes(longest_prompt: int, new_tokens: int, batch_size: int, share: bool,
                max_length: int) -> packing.Sizes:
  """The `packing.Sizes` of a batch whose every pair has the longest prompt and two
  samples of `new_tokens` ids: the step plan of an online run (any sampled batch fits)."""
  ids = np.zeros((batch_size, 1, new_tokens), np.int32)
  batch = build([np.zeros(longest_prompt, np.int32)] * batch_size,
                np.concatenate([ids, ids + 1], 1), np.full((batch_size, 2), new_tokens),
                np.tile([1.0, 0.0], (batch_size, 1)), pad_id=0, max_length=max_length)
  return packing.pair_sizes(batch, share)
