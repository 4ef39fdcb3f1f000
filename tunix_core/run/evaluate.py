"""Evaluation: metric means of the eval step over every pair of a held-out preference set.

The eval step is compiled for `--batch_size` pairs. A last, partial batch of `n` pairs is
padded to the full size with copies of its first pair, and the copies are taken out
again: with `m` the padded batch's means and `m1` the means of a batch of that pair
alone, the `n` pairs' means are `(B m - (B - n) m1) / n`. This is exact for every metric
and for every loss that is a mean of per-pair terms: all but the terms that couple a
batch's pairs (`tunix_kernels.dpo_loss.losses`: `aot` and `aot_unpaired` sort its log-ratios;
`sft` and the NLL of `cpo` and `orpo` average over its chosen tokens), whose last batch
it approximates.
"""

import jax
import numpy as np

from tunix_core.run import ref_cache
from tunix_core.training import step as step_lib


def evaluate(steps: step_lib.StepFunctions, params, ref_params, dataset,
             ref_table: ref_cache.RefTable | None, beat=None) -> dict:
  """`{"eval/<key>": mean over the eval set's pairs}`; keys as the train step's metrics.
  `dataset`: a token store (`data.store.PairStore`) or a `data.PreferenceDataset`;
  `beat`, if given, is called with each batch's name as it starts (a watchdog's beat)."""
  B = steps.plan.batch_size

  def means(idx: np.ndarray) -> dict:
    batch = ref_cache.host_batch(steps, dataset, idx, ref_table)
    m = jax.device_get(steps.eval_step(params, ref_params, steps.put_batch(batch)))
    return {k: float(v) for k, v in m.items()}

  totals = {}
  for start in range(0, len(dataset), B):
    if beat:
      beat(f"batch {start // B + 1}/{-(-len(dataset) // B)}")
    idx = np.arange(start, min(start + B, len(dataset)))
    n = len(idx)
    m = means(np.concatenate([idx, np.full(B - n, idx[0])]))
    if n < B:
      alone = means(np.full(B, idx[0]))
      m = {k: (B * v - (B - n) * alone[k]) / n for k, v in m.items()}
    for k, v in m.items():
      totals[k] = totals.get(k, 0.0) + n * v
  return {f"eval/{k}": v / len(dataset) for k, v in totals.items()}
