"""safetensors files on object storage, read by byte ranges.

`safetensors.safe_open` needs a local file to memory-map. On `gs://` a `RangedFile`
gives the part of its interface the weights reader uses (`keys`, `get_slice(name)` with
`get_shape()` and basic-slice indexing) and reads only what is asked: the header once,
then for each index the rows of the tensor's first dimension it spans. A device's block
of a tensor split on its first dimension costs exactly its own bytes; a block split on
another dimension costs the whole rows it crosses.
"""

import json
import struct

import ml_dtypes
import numpy as np

from tunix_core.storage import paths

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
          "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
          "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class RangedFile:
  """The tensors of one safetensors file at `path` (any `storage.paths` path).
  `RangedFile.fetched` counts the bytes every instance of this process has read."""

  fetched = 0

  def __init__(self, path: str):
    self.path = path
    self._file = paths.open_read(path)
    (size,) = struct.unpack("<Q", self._read(0, 8))
    header = json.loads(self._read(8, size))
    header.pop("__metadata__", None)
    self._header, self._base = header, 8 + size

  def _read(self, start: int, size: int) -> bytes:
    def read():
      self._file.seek(start)
      return self._file.read(size)
    data = paths.call("reading", self.path, read)
    RangedFile.fetched += len(data)
    if len(data) != size:
      raise paths.StorageError(f"reading {self.path} failed: {size} bytes at {start} "
                               f"asked, {len(data)} read (a truncated file)")
    return data

  def keys(self) -> list[str]:
    return list(self._header)

  def get_slice(self, name: str) -> "_Slice":
    return _Slice(self, self._header[name])

  def __enter__(self):
    return self

  def __exit__(self, *_):
    self._file.close()


class _Slice:
  """One tensor of a `RangedFile`; indexing reads only the rows the index spans."""

  def __init__(self, file: RangedFile, entry: dict):
    self._file, self.shape = file, tuple(entry["shape"])
    self.dtype = np.dtype(DTYPES[entry["dtype"]])
    self._start = entry["data_offsets"][0]

  def get_shape(self) -> list[int]:
    return list(self.shape)

  def __getitem__(self, index) -> np.ndarray:
    index = index if isinstance(index, tuple) else (index,)
    if not self.shape:
      return np.frombuffer(self._file._read(self._file._base + self._start,  # pylint: disable=protected-access
                                            self.dtype.itemsize), self.dtype).reshape(())
    first = index[0] if index else slice(None)
    if not isinstance(first, slice) or first.step not in (None, 1):
      raise IndexError(f"only basic slices are read by range, got {index!r}")
    lo, hi, _ = first.indices(self.shape[0])
    hi = max(hi, lo)
    row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
    data = self._file._read(self._file._base + self._start + lo * row, (hi - lo) * row)  # pylint: disable=protected-access
    rows = np.frombuffer(data, self.dtype).reshape((hi - lo,) + self.shape[1:])
    return rows[(slice(None),) + tuple(index[1:])]
