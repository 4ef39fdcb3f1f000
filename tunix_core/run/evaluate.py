"""Evaluation: metric means of the eval step over a held-out preference set."""

import jax
import numpy as np

from tunix_core import data as data_lib
from tunix_core.run import ref_cache
from tunix_core.training import step as step_lib


def evaluate(steps: step_lib.StepFunctions, params, ref_params,
             dataset: data_lib.PreferenceDataset, ref_table: np.ndarray | None) -> dict:
  """`{"eval/<key>": mean}` over the eval set's full batches (all of one size, so the
  mean of batch means is the mean over pairs); keys as the train step's metrics."""
  totals, count = {}, 0
  B = steps.cfg.batch_size
  for start, batch in zip(range(0, len(dataset), B), data_lib.eval_batches(dataset, B)):
    batch = ref_cache.with_ref(batch, ref_table, np.arange(start, start + B))
    m = jax.device_get(steps.eval_step(params, ref_params, steps.put_batch(batch)))
    for k, v in m.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    count += 1
  return {f"eval/{k}": v / count for k, v in totals.items()}
