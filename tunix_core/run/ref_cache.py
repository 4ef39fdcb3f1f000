"""Reference log-probs computed once before training and cached on disk.

Under `--reference=precomputed` the frozen reference runs once over a dataset instead
of in every step; the table `[num_pairs, 2, T]` (float32, chosen and rejected rows of
each pair) then rides along with each batch as `ref_logps`.
"""

import hashlib
import io
import json

import jax
import numpy as np

from tunix_core import data as data_lib
from tunix_core.checkpoints import store as checkpoint
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.storage import paths
from tunix_core.training import step as step_lib


def _data_hash(dataset: data_lib.PreferenceDataset, ref_params) -> str:
  """A digest of the encoded data and the reference params; the params enter through
  their on-device fingerprints, so none of them is copied to the host."""
  h = hashlib.sha256()
  for a in (dataset.tokens, dataset.targets, dataset.attention_mask):
    h.update(np.ascontiguousarray(a).tobytes())
  h.update(json.dumps(checkpoint.fingerprints(ref_params), sort_keys=True).encode())
  return h.hexdigest()[:20]


def precompute_ref_logps(steps: step_lib.StepFunctions, ref_params,
                         dataset: data_lib.PreferenceDataset, cache_dir: str,
                         log=lambda _: None) -> np.ndarray:
  """Reference log-probs of every pair, float32 `[num_pairs, 2, T]`, cached in
  `cache_dir` (local or remote).

  The cache file name is a hash of the encoded data and the reference params (and the
  model config), so a change to either recomputes instead of reusing stale values.
  `log` gets a progress line at every tenth of the batches.
  """
  key = _data_hash(dataset, ref_params) + hashlib.sha256(
      repr((steps.mcfg, steps.cfg.logprob_impl)).encode()).hexdigest()[:8]
  path = paths.join(cache_dir, f"ref_logps_{key}.npy")
  if paths.exists(path):
    return np.load(io.BytesIO(paths.read_bytes(path)))
  n, B = len(dataset), steps.cfg.batch_size
  out = np.zeros(dataset.tokens.shape, np.float32)
  batches = -(-n // B)
  for i, start in enumerate(range(0, n, B)):
    if batches >= 10 and i % (batches // 10) == 0:
      log(f"reference log-probs: batch {i + 1}/{batches}")
    idx = np.arange(start, start + B) % n  # wrap the last batch; extra pairs are discarded
    batch = steps.put_batch(data_lib.take_pairs(dataset, idx))
    keep = min(B, n - start)
    out[start:start + keep] = mesh_lib.to_host(steps.ref_logps(ref_params, batch))[:keep]
  if jax.process_index() == 0:  # one writer per shared directory
    buffer = io.BytesIO()
    np.save(buffer, out)
    paths.write_bytes(path, buffer.getvalue())  # atomic: never a half-written cache
  return out


def with_ref(batch: dict, ref_table: np.ndarray | None, idx: np.ndarray) -> dict:
  """`batch` of the pairs `idx`, plus their rows of `ref_table` as `ref_logps` if given."""
  return batch if ref_table is None else dict(batch, ref_logps=ref_table[idx])
