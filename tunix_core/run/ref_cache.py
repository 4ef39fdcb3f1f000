"""Reference log-probs computed once before training and kept beside the token store,
and the batches a host draws (`host_batch`).

Under `--reference=precomputed` the frozen reference runs once over a split instead of
in every step. Its log-probs are kept the way the store keeps ids (`data.store`):
ragged, the scored positions only (each pair's chosen row, then its rejected row),
float32, in `{data_cache_dir}/ref_logps_{key}.npy`, `key` naming the store, the
reference params (their on-device fingerprints: nothing is copied to the host) and the
model config. A batch's `ref_logps` `[B, 2, T]` (0 where unscored) is built when it is
drawn, for this host's pairs only.

The pass is written as it goes, in chunks of consecutive pairs (about 1% of the pass,
at most `CHUNK_PAIRS`), each a `.npy` under `ref_logps_{key}.chunks-{process}/` named by
its pairs `{first}-{end}.npy` that appears whole or not at all (`paths.write_bytes`: a
rename on disk, one upload on object storage): a pass killed part-way resumes after its
last complete chunk. The finished pass is joined into the one `.npy` above (written
through a temporary file, so it too appears only whole) and its chunks are removed.
"""

import hashlib
import io
import json
import os
import re

import jax
from jax.experimental import multihost_utils
import numpy as np

from tunix_core.checkpoints import store as checkpoint
from tunix_core.data import store as store_lib
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.storage import paths
from tunix_core.storage import staging
from tunix_core.training import step as step_lib

CHUNK_PAIRS = 16384   # a chunk's pairs at most: their log-probs are held until written
_CHUNK = re.compile(r"^(\d+)-(\d+)\.npy$")


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


def cache_key(pairs: store_lib.PairStore, ref_params, model: str) -> str:
  """The name of `pairs`' reference log-probs under `ref_params` (any bit of them) and
  `model` (the config that computes them)."""
  return hashlib.sha256(json.dumps([os.path.basename(pairs.path.rstrip("/")),
                                    checkpoint.fingerprints(ref_params), model],
                                   sort_keys=True).encode()).hexdigest()[:24]


def _chain(parts: str) -> list[tuple[int, int]]:
  """`(first, end)` of the complete chunks under `parts` that cover the pairs from the
  first on without a gap, in order."""
  ends = {}
  for m in filter(None, map(_CHUNK.match, paths.listdir(parts))):
    if int(m[2]) > int(m[1]):
      ends[int(m[1])] = max(ends.get(int(m[1]), 0), int(m[2]))
  chain, at = [], 0
  while at in ends:
    chain.append((at, ends[at]))
    at = ends[at]
  return chain


def _chunk(parts: str, first: int, end: int) -> str:
  return paths.join(parts, f"{first:010d}-{end:010d}.npy")


def _write_chunk(parts: str, first: int, end: int, values: list[np.ndarray]) -> None:
  """The chunk of pairs `first` to `end`, whose log-probs are `values`, appears whole."""
  buf = io.BytesIO()
  np.save(buf, np.concatenate(values).astype(np.float32))
  paths.write_bytes(_chunk(parts, first, end), buf.getvalue())


def _join(parts: str, path: str, pairs: store_lib.PairStore, beat) -> None:
  """Writes `path`: the values of the chunks under `parts` for every pair of `pairs`, in
  order, streamed (one chunk held at a time, `beat` naming each) into a local file
  renamed or uploaded whole."""
  chain = _chain(parts)
  if not chain or chain[-1][1] != len(pairs):
    raise RuntimeError(f"{parts}: the chunks cover {chain[-1][1] if chain else 0} of "
                       f"{len(pairs)} pairs")
  count = int(pairs.scored().sum())
  def read(first: int, end: int) -> np.ndarray:
    beat(f"reference log-probs: joining pairs {first:,}-{end:,} into {path}")
    return np.load(io.BytesIO(paths.read_bytes(_chunk(parts, first, end))))

  chunks = (read(*span) for span in chain)
  uploading = lambda: beat(f"reference log-probs: uploading {path}", open_ended=True)
  with staging.staged_file(path, uploading) as tmp:  # block by block, its clock restarting
    store_lib.write_flat(tmp, np.float32, count, (c.astype(np.float32).tobytes()
                                                  for c in chunks))


def _writes(parts0: str, key: str) -> bool:
  """Whether this process writes the pass of `key`: process 0, and any process that
  cannot see what process 0 writes (a disk of its own): a token process 0 leaves under
  `parts0` (its chunks' directory) for this run."""
  if jax.process_count() == 1:
    return True
  token = str(int(multihost_utils.broadcast_one_to_all(  # int32: JAX's default width
      np.random.default_rng().integers(1 << 30, dtype=np.int32))))
  marker = paths.join(parts0, "writer")
  if jax.process_index() == 0:
    paths.write_text(marker, token)
  multihost_utils.sync_global_devices(f"ref_logps_{key} writer")  # the same on all
  return jax.process_index() == 0 or not (paths.exists(marker)
                                          and paths.read_text(marker) == token)


def precompute_ref_logps(steps: step_lib.StepFunctions, ref_params,
                         pairs: store_lib.PairStore, cache_dir: str,
                         log=lambda _: None, beat=lambda *_, **__: None) -> RefTable:
  """The reference log-probs of every pair of `pairs` (a token store), computed once
  and cached in `cache_dir` (local or remote) under a name that changes with the data,
  the reference params and the model config; a pass cut short resumes after its last
  complete chunk (module docstring). `log` gets a progress line at every tenth of the
  batches, `beat` the name of each batch as it starts. Every process takes part (each
  batch is a collective); process 0 writes, and any process that cannot see its files:
  only those receive the log-probs, the others never hold any of the table."""
  key = cache_key(pairs, ref_params, repr((steps.mcfg, steps.plan.logprob_impl)))
  path = paths.join(cache_dir, f"ref_logps_{key}.npy")
  have = paths.exists(path)
  found = have
  if jax.process_count() > 1:  # computed by all (a collective) if any process lacks it
    found = bool(multihost_utils.process_allgather(np.array(found)).all())
  if found:
    return RefTable(path, pairs)
  parts = paths.join(cache_dir, f"ref_logps_{key}.chunks-{jax.process_index()}")
  # A writer that sees the table already (another host lacked it) only takes part.
  writer = _writes(paths.join(cache_dir, f"ref_logps_{key}.chunks-0"), key) and not have
  n, B = len(pairs), steps.plan.batch_size
  chain = _chain(parts) if writer else []
  done = chain[-1][1] if chain else (0 if writer else n)
  if jax.process_count() > 1:  # every process starts where the writer furthest behind is
    done = int(multihost_utils.process_allgather(np.array(done)).min())
  if done:
    log(f"reference log-probs: resuming after pair {done:,} of {n:,} (the complete "
        "chunks of an interrupted pass)")
  batches = -(-n // B)
  per_chunk = B * max(1, min(batches // 100, CHUNK_PAIRS // B))
  values, first = [], done
  for start in range(done, n, B):
    i = start // B
    if batches >= 10 and i % (batches // 10) == 0:
      log(f"reference log-probs: batch {i + 1}/{batches}")
    beat(f"reference log-probs: batch {i + 1}/{batches} of {pairs.meta.source}")
    idx = np.arange(start, start + B) % n  # wrap the last batch; extra pairs discarded
    # Only a writer receives the batch's log-probs (the others take part in the gather).
    logps = mesh_lib.to_host(steps.ref_logps(
        ref_params, steps.put_batch(host_batch(steps, pairs, idx))), keep=writer)
    keep = min(B, n - start)
    if writer:
      spans = zip(*pairs.scored_spans(idx[:keep]))
      values += [x for b, (f, e) in enumerate(spans)
                 for x in (logps[b, 0, f:e[0]], logps[b, 1, f:e[1]])]
      if start + keep - first >= per_chunk or start + keep == n:
        _write_chunk(parts, first, start + keep, values)
        values, first = [], start + keep
  if writer:
    _join(parts, path, pairs, beat)
    paths.remove(parts)
  if jax.process_count() > 1:
    beat(f"reference log-probs: waiting for {path}", open_ended=True)  # for the writers
    multihost_utils.sync_global_devices(f"ref_logps_{key}")
  return RefTable(path, pairs)
