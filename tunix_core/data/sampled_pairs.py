"""Preference pairs from scored samples: the best and the worst of each prompt's K.

Candidates past the K samples (`--online_data_chosen`: the data's chosen response) may
be chosen, never rejected: the rejected side is always the policy's own sample. The
batch is the trainer's pair batch (`data.store.PairStore.take`'s layout: int32
`[B, 2, T]` tokens, targets, loss and attention masks), built from the sampled ids as
they are (never re-tokenized). A prompt with nothing to prefer (its best candidate
scored no higher than its worst sample) keeps its pair as padding, scored nowhere: the
step's loss, gradient and metrics are means over the other pairs
(`training.accumulate`; a batch-coupled loss term, `aot`, still sorts its zero
log-ratio with the others), and a batch where no prompt has anything to prefer updates
nothing.
"""

import numpy as np

from tunix_core.data import encode as data_encode
from tunix_core.data import packing


def choose(scores_BxC: np.ndarray, samples: int | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(chosen [B], rejected [B], tied [B])` of `C` scored candidates per prompt: the
  first highest scored candidate, the first lowest of the first `samples` (all by
  default), and whether those two scores are equal (nothing to prefer)."""
  own_BxK = scores_BxC[:, :samples]
  return (np.argmax(scores_BxC, -1), np.argmin(own_BxK, -1),
          scores_BxC.max(-1) == own_BxK.min(-1))


def build(prompts: list, samples_BxCxN: np.ndarray, lengths_BxC: np.ndarray,
          scores_BxC: np.ndarray, pad_id: int, max_length: int,
          samples: int | None = None) -> dict:
  """The pair batch of `B` prompts (id arrays) and their `C` candidates each (`N` ids,
  valid up to `lengths`, an ending EOS included; the first `samples` of them, all by
  default, the policy's): for each prompt, its best candidate chosen and its worst
  sample rejected, or padding where they tie (`choose`)."""
  B, T = len(prompts), max_length
  batch = {"tokens": np.full((B, 2, T), pad_id, np.int32),
           "targets": np.full((B, 2, T), data_encode.IGNORE_INDEX, np.int32),
           "loss_mask": np.zeros((B, 2, T), np.int32),
           "attention_mask": np.zeros((B, 2, T), np.int32)}
  for b, (best, worst, tied) in enumerate(zip(*choose(scores_BxC, samples))):
    if tied:
      continue
    prompt = [int(t) for t in prompts[b]]
    for c, k in enumerate((best, worst)):
      response = [int(t) for t in samples_BxCxN[b, k, :lengths_BxC[b, k]]]
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
