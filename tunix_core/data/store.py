"""The token store: preference pairs tokenized once (`data.build`), kept as ragged int32
runs, read pair by pair.

A store is a directory (local or `gs://`) of NumPy files and a `meta.json` written last
(a store without it is incomplete and gets built again):

- `ids.npy`, int32 `[total]`: pair `i` is three runs back to back, from
  `offsets[3i]` to `offsets[3i + 3]`: the prompt (BOS included, already cut to its last
  `--max_prompt_length` ids), then the chosen and the rejected response (each ending in
  its END and already cut so that prompt + response is at most `max_length + 1` ids);
- `offsets.npy`, int64 `[3 pairs + 1]`; `lines.npy`, int32 `[pairs]`: each pair's line
  in the JSONL (errors found later still name `path:line`).

Nothing is padded on disk; a batch's fixed-length rows (`[B, 2, T]` tokens, targets, loss
and attention masks, exactly what `data.encode.build_row` makes) are built when it is
drawn, and the step plan's statistics (`packing.Sizes`) follow from the offsets alone.

Reading: offsets and line numbers stay in memory (28 bytes a pair); each drawn pair is
one positioned read (`os.pread` locally, concurrent ranged reads on object storage), so
a process holds only the batch it draws, and `take(idx, only=...)` reads only the pairs
this host's devices get. Grain's samplers draw their own shuffle, so they cannot replay
`BatchIterator`'s order or the `{epoch, position}` state old checkpoints hold; the files
are standard `.npy` and this reader is the little that is left.
"""

import dataclasses
import io
import json
import os

import numpy as np

from tunix_core.data import encode as data_encode
from tunix_core.data import packing
from tunix_core.storage import paths

FORMAT = 1
FILES = ("ids.npy", "offsets.npy", "lines.npy")


@dataclasses.dataclass(frozen=True)
class Meta:
  """What `meta.json` records: the row shape, the ids' range and the build's counts."""

  max_length: int
  max_prompt_length: int
  pad_id: int
  max_id: int
  num_dropped: int
  num_skipped_lines: int
  num_prefix_mismatch: int
  source: str  # the JSONL it was built from
  format: int = FORMAT


class Ragged:
  """A flat 1-D `.npy` file read by element ranges, never whole."""

  def __init__(self, path: str):
    self.path = path
    with paths.open_read(path) as f:
      fmt = np.lib.format
      header = (fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0)
                else fmt.read_array_header_2_0)
      _, _, self.dtype = header(f)
      self.start = f.tell()
    self._fd = None if paths.is_remote(path) else os.open(path, os.O_RDONLY)

  def read(self, starts, ends) -> list[np.ndarray]:
    """The runs `[start, end)` (element indices) as arrays of the file's dtype."""
    item = self.dtype.itemsize
    lo = [self.start + int(s) * item for s in starts]
    hi = [self.start + int(e) * item for e in ends]
    if self._fd is not None:
      blobs = [os.pread(self._fd, b - a, a) for a, b in zip(lo, hi)]
    else:
      import fsspec  # pylint: disable=g-import-not-at-top  (gcsfs, as under epath)
      fs, name = fsspec.core.url_to_fs(self.path)
      blobs = paths.call("reading", self.path, lambda: fs.cat_ranges(
          [name] * len(lo), lo, hi, on_error="raise")) if lo else []
    return [np.frombuffer(b, self.dtype) for b in blobs]

  def __del__(self):
    if getattr(self, "_fd", None) is not None:
      os.close(self._fd)


def write_flat(path: str, dtype, count: int, parts) -> None:
  """Writes the local file `path`: a 1-D `.npy` of `count` elements of `dtype`, from the
  byte strings `parts` (streamed: none is held beyond its write)."""
  with open(path, "wb") as f:
    np.lib.format.write_array_header_1_0(
        f, {"descr": np.dtype(dtype).str, "fortran_order": False, "shape": (count,)})
    for part in parts:
      f.write(part)


def _load_small(path: str) -> np.ndarray:
  return np.load(io.BytesIO(paths.read_bytes(path)))


class PairStore:
  """The pairs of one store (module docstring); `len(store)` pairs."""

  def __init__(self, path: str):
    self.path = path
    self.meta = Meta(**json.loads(paths.read_text(paths.join(path, "meta.json"))))
    self.offsets = _load_small(paths.join(path, "offsets.npy"))
    self.lines = _load_small(paths.join(path, "lines.npy"))
    self._ids = Ragged(paths.join(path, "ids.npy"))
    lengths_Px3 = np.diff(self.offsets).reshape(-1, 3)
    # Row lengths: prompt + response minus the one id only ever a target.
    self._prompt, self._chosen = lengths_Px3[:, 0], lengths_Px3[:, 1]
    self._rows_Px2 = lengths_Px3[:, :1] + lengths_Px3[:, 1:] - 1
    self._first = np.maximum(self._prompt - 1, 0)  # each row's first scored position
    self.last_read = np.zeros(0, np.int64)  # the pairs the last `take` read

  @property
  def key(self) -> str:
    """The store's directory name: its `data.build.store_key` where the trainer keeps it
    (`run.source`), which a checkpoint's data state carries (`data.BatchIterator`)."""
    return self.path.rstrip("/").rsplit("/", 1)[-1]

  @staticmethod
  def complete(path: str) -> bool:
    return paths.exists(paths.join(path, "meta.json"))

  def __len__(self) -> int:
    return len(self.lines)

  num_dropped = property(lambda self: self.meta.num_dropped)
  num_skipped_lines = property(lambda self: self.meta.num_skipped_lines)
  num_prefix_mismatch = property(lambda self: self.meta.num_prefix_mismatch)

  def runs(self, idx) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`(prompt, chosen, rejected)` ids of each pair `idx`, read from the store."""
    idx = np.asarray(idx, np.int64)
    flat = self._ids.read(self.offsets[3 * idx], self.offsets[3 * idx + 3])
    return [tuple(np.split(f, np.cumsum(np.diff(self.offsets[3 * i:3 * i + 3]))))
            for i, f in zip(idx, flat)]

  def prompt_lengths(self) -> np.ndarray:
    """Ids of each pair's prompt, int64 `[pairs]`."""
    return self._prompt

  def chosen_lengths(self) -> np.ndarray:
    """Ids of each pair's chosen response as stored (its ending included unless the
    row was cut at `--max_length`), int64 `[pairs]`."""
    return self._chosen

  def scored(self) -> np.ndarray:
    """Scored positions of each pair (both rows), int64 `[pairs]`."""
    return (self._rows_Px2 - self._first[:, None]).sum(-1)

  def scored_spans(self, idx) -> tuple[np.ndarray, np.ndarray]:
    """`(first [B], ends [B, 2])`: the pairs `idx`'s rows score positions `first` to
    `ends` (exclusive) of their `[2, T]` rows."""
    idx = np.asarray(idx)
    return self._first[idx], self._rows_Px2[idx]

  def num_tokens(self, idx) -> int:
    """Real (attended) tokens of the pairs `idx`, both rows."""
    return int(self._rows_Px2[np.asarray(idx)].sum())

  def sizes(self, share: bool) -> packing.Sizes:
    """The `packing.Sizes` of every pair, as `packing.pair_sizes` measures rows: shared,
    a pair holds its prompt once, when its rows start with the same ids up to the first
    scored one (always, unless there is no prompt: then the responses' first ids)."""
    tokens = self._rows_Px2.sum(-1)
    if share:
      same = self._prompt > 0
      bare = np.flatnonzero(~same)
      same[bare] = [c[0] == r[0] for _, c, r in self.runs(bare)]
      tokens = tokens - np.where(same, self._first + 1, 0)
    return packing.Sizes(tokens=tokens, scored=self.scored(),
                         longest=self._rows_Px2.max(-1))

  def take(self, idx, only=None) -> dict:
    """The batch of the pairs `idx`: int32 arrays `[B, 2, T]` (axis 1: chosen, rejected;
    `data.dataset`'s layout). `only` (positions in `idx`): read and fill just those, the
    rest stay padding (a host builds only its own devices' pairs)."""
    B, T = len(idx), self.meta.max_length
    positions = np.arange(B) if only is None else np.asarray(only)
    batch = {"tokens": np.full((B, 2, T), self.meta.pad_id, np.int32),
             "targets": np.full((B, 2, T), data_encode.IGNORE_INDEX, np.int32),
             "loss_mask": np.zeros((B, 2, T), np.int32),
             "attention_mask": np.zeros((B, 2, T), np.int32)}
    self.last_read = np.asarray(idx)[positions]
    for b, (prompt, *responses) in zip(positions, self.runs(self.last_read)):
      for c, response in enumerate(responses):
        row = data_encode.build_row([], list(prompt), list(response), self.meta.pad_id, T, T)
        for key, x in zip(("tokens", "targets", "loss_mask"), row):
          batch[key][b, c] = x
        batch["attention_mask"][b, c, :len(prompt) + len(response) - 1] = 1
    return batch

  def first_pair_at_or_above(self, vocab_size: int) -> tuple[int, int]:
    """`(pair, its largest id)` of the first pair holding an id `>= vocab_size` (reads
    the whole store: an error path); `(-1, -1)` when there is none."""
    for start in range(0, len(self), 4096):
      for i, runs in enumerate(self.runs(np.arange(start, min(start + 4096, len(self))))):
        top = max(int(r.max(initial=0)) for r in runs)
        if top >= vocab_size:
          return start + i, top
    return -1, -1
