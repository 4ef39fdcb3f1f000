"""Reference log-probs computed once before training and kept beside the token store,
and the batches a host draws (`host_batch`).

Under `--reference=precomputed` the frozen reference runs once over a split instead of
in every step. Its log-probs are kept the way the store keeps ids (`data.store`):
ragged, the scored positions only (each pair's chosen row, then its rejected row),
float32, in `{data_cache_dir}/ref_logps_{key}.npy`, `key` naming the store, the
reference params (their on-device fingerprints: nothing is copied to the host) and the
model config. A batch's `ref_logps` `[B, 2, T]` (0 where unscored) is built when it is
drawn, for this host's pairs only.
"""

import hashlib
import json
import os
import shutil
import tempfile

import jax
from jax.experimental import multihost_utils
import numpy as np

from tunix_core.checkpoints import store as checkpoint
from tunix_core.data import store as store_lib
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.storage import paths
from tunix_core.training import step as step_lib


class RefTable:
  """The cached reference log-probs of one store's pairs, read per batch."""

  def __init__(self, path: str, pairs: store_lib.PairStore):
    self._file, self._pairs = store_lib.Ragged(path), pairs
    self._offsets = np.concatenate([[0], np.cumsum(pairs.scored())])

  def take(self, idx, only) -> np.ndarray:
    """float32 `[B, 2, T]` of the pairs `idx` at the positions `only` (0 elsewhere)."""
    idx = np.asarray(idx)
    out = np.zeros((len(idx), 2, self._pairs.meta.max_length), np.float32)
    first, ends = self._pairs.scored_spans(idx[only])
    values = self._file.read(self._offsets[idx[only]], self._offsets[idx[only] + 1])
    for b, v, f, (n0, n1) in zip(only, values, first, ends):
      out[b, 0, f:n0], out[b, 1, f:n1] = v[:n0 - f], v[n0 - f:]
    return out


def host_batch(steps: step_lib.StepFunctions, pairs, idx, ref: RefTable | None = None) -> dict:
  """The global batch of the pairs `idx` as this host builds it: only the pairs its own
  devices get are read (the rest stay padding), with their `ref_logps` when `ref`."""
  only = steps.local_positions()
  batch = pairs.take(idx, only)
  return batch if ref is None else dict(batch, ref_logps=ref.take(idx, only))


def _write_local(path: str, chunks: list[np.ndarray]) -> None:
  """`path` (local): the `.npy` of the concatenated float32 `chunks`, atomically."""
  tmp = f"{path}.{os.getpid()}.tmp"
  store_lib.write_flat(tmp, np.float32, sum(map(len, chunks)),
                       (np.ascontiguousarray(c, np.float32).tobytes() for c in chunks))
  os.replace(tmp, path)


def _save(path: str, chunks: list[np.ndarray]) -> None:
  if not paths.is_remote(path):
    paths.makedirs(os.path.dirname(path))
    _write_local(path, chunks)
    return
  local = tempfile.mkdtemp(prefix="tunix-ref-")
  try:
    _write_local(os.path.join(local, "ref.npy"), chunks)
    paths.copy_file(os.path.join(local, "ref.npy"), path)  # an object appears whole
  finally:
    shutil.rmtree(local, ignore_errors=True)


def cache_key(pairs: store_lib.PairStore, ref_params, model: str) -> str:
  """The name of `pairs`' reference log-probs under `ref_params` (any bit of them) and
  `model` (the config that computes them)."""
  return hashlib.sha256(json.dumps([os.path.basename(pairs.path.rstrip("/")),
                                    checkpoint.fingerprints(ref_params), model],
                                   sort_keys=True).encode()).hexdigest()[:24]


def precompute_ref_logps(steps: step_lib.StepFunctions, ref_params,
                         pairs: store_lib.PairStore, cache_dir: str,
                         log=lambda _: None) -> RefTable:
  """The reference log-probs of every pair of `pairs` (a token store), computed once
  and cached in `cache_dir` (local or remote) under a name that changes with the data,
  the reference params and the model config. `log` gets a progress line at every tenth
  of the batches. Every process takes part; process 0 writes (then any process that
  cannot see its file, on a disk of its own)."""
  key = cache_key(pairs, ref_params, repr((steps.mcfg, steps.cfg.logprob_impl)))
  path = paths.join(cache_dir, f"ref_logps_{key}.npy")
  found = paths.exists(path)
  if jax.process_count() > 1:  # computed by all (a collective) if any process lacks it
    found = bool(multihost_utils.process_allgather(np.array(found)).all())
  if not found:
    n, B = len(pairs), steps.cfg.batch_size
    chunks, batches = [], -(-n // B)
    for i, start in enumerate(range(0, n, B)):
      if batches >= 10 and i % (batches // 10) == 0:
        log(f"reference log-probs: batch {i + 1}/{batches}")
      idx = np.arange(start, start + B) % n  # wrap the last batch; extra pairs discarded
      logps = mesh_lib.to_host(steps.ref_logps(
          ref_params, steps.put_batch(host_batch(steps, pairs, idx))))
      keep = min(B, n - start)
      first, ends = pairs.scored_spans(idx[:keep])
      chunks += [x for b in range(keep) for x in (logps[b, 0, first[b]:ends[b, 0]],
                                                   logps[b, 1, first[b]:ends[b, 1]])]
    for writer in (True, False):  # process 0 first, then whoever does not see its file
      if writer == (jax.process_index() == 0) and not paths.exists(path):
        _save(path, chunks)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"ref_logps_{key}_{writer}")
  return RefTable(path, pairs)
