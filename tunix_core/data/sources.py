"""Where preference rows come from (`--train_data`, `--eval_data`): numbered records of
a JSONL file, of Parquet shards or of a `datasets.save_to_disk` directory.

- JSONL (any file not named below): one JSON object a line, numbered by line from 1,
  handed on as the line's bytes (parsed where it is encoded);
- Parquet: a `*.parquet` file, a directory of them, or a glob in the last path part
  (`dir/train-*.parquet`): the shards in name order, rows numbered from 1 across them,
  read one record batch at a time through pyarrow, never as a whole table;
- a `datasets.save_to_disk` directory (`state.json` inside; the `datasets` extra): its
  rows, memory-mapped by `datasets`. A `DatasetDict`'s directory (`dataset_dict.json`)
  takes its split as `DIR:SPLIT`, or the one split it holds.

A table's rows are handed on as dicts of its columns (nested columns as lists and dicts,
as TRL's conversational data is stored). A record is located for messages by `where`:
`path:line` for JSONL, `shard row N` (from 1 within the shard) for tables.
"""

import fnmatch
import json
import posixpath
from typing import Iterator, NamedTuple

from tunix_core.storage import digest as content_digest
from tunix_core.storage import paths


class DataError(ValueError):
  """Bad preference data; the one-line message names the file, and the line, row or
  column."""


class Source(NamedTuple):
  kind: str                 # "jsonl", "parquet" or "arrow" (save_to_disk)
  files: tuple[str, ...]    # what its content digest covers
  root: str = ""            # arrow: the dataset's directory (a split's)


def _need(module: str, extra: str, path: str):
  try:
    return __import__(module, fromlist=["_"])
  except ImportError:
    raise DataError(f"{path}: reading it needs {module} (pip install "
                    f"'tunix-core[{extra}]')") from None


def resolve(path: str) -> Source:
  """The `Source` of a data path, or `DataError` naming why it is none."""
  head, tail = posixpath.split(path)
  if any(c in tail for c in "*?["):
    names = sorted(n for n in (paths.listdir(head) if paths.isdir(head) else [])
                   if fnmatch.fnmatch(n, tail))
    if not names:
      raise DataError(f"{path}: no file matches")
    return Source("parquet", tuple(paths.join(head, n) for n in names))
  if not paths.isdir(path):
    split_dir, _, split = path.rpartition(":")
    if split_dir and "/" not in split and paths.exists(paths.join(split_dir,
                                                                  "dataset_dict.json")):
      return _arrow(paths.join(split_dir, split), path)
    if not paths.isfile(path):
      raise DataError(f"{path}: no such data file")
    return Source("parquet" if path.endswith(".parquet") else "jsonl", (path,))
  if paths.exists(paths.join(path, "dataset_dict.json")):
    splits = json.loads(paths.read_text(paths.join(path, "dataset_dict.json")))["splits"]
    if len(splits) != 1:
      raise DataError(f"{path} holds the splits {', '.join(splits)}: name one as "
                      f"{path}:{splits[0]}")
    return _arrow(paths.join(path, splits[0]), path)
  if paths.exists(paths.join(path, "state.json")):
    return _arrow(path, path)
  shards = sorted(n for n in paths.listdir(path) if n.endswith(".parquet"))
  if not shards:
    raise DataError(f"{path}: a directory with no *.parquet shards and no "
                    "datasets.save_to_disk files")
  return Source("parquet", tuple(paths.join(path, n) for n in shards))


def _arrow(root: str, path: str) -> Source:
  if not paths.exists(paths.join(root, "state.json")):
    raise DataError(f"{path}: no such split ({root} holds no save_to_disk dataset)")
  state = json.loads(paths.read_text(paths.join(root, "state.json")))
  files = [paths.join(root, f["filename"]) for f in state["_data_files"]]
  return Source("arrow", tuple(files + [paths.join(root, "state.json")]), root)


def digest(path: str) -> str:
  """A string that changes whenever any byte of the source's data does."""
  sums = [content_digest.content_digest(f) for f in resolve(path).files]
  return sums[0] if len(sums) == 1 else "files:" + ",".join(sums)


# The columns a preference table must have (`prompt` may be implicit in them).
NEEDED = ("chosen", "rejected")


def _check_columns(where: str, names) -> None:
  for name in NEEDED:
    if name not in names:
      raise DataError(f"{where}: no column {name!r} (its columns: {', '.join(names)})")


def _dataset(src: Source, path: str):
  datasets = _need("datasets", "datasets", path)
  return datasets.load_from_disk(src.root)


def _table_rows(src: Source, path: str, batch: int) -> Iterator[tuple[str, object, int]]:
  """`(shard, rows, index of the first in the shard)` record batches of a table, in
  order; rows a list of dicts, or a dict of column lists."""
  if src.kind == "arrow":
    ds = _dataset(src, path)
    _check_columns(path, ds.column_names)
    for start in range(0, len(ds), batch):
      yield src.root, ds[start:start + batch], start
    return
  pq = _need("pyarrow.parquet", "parquet", path)
  for shard in src.files:
    with paths.open_read(shard) as f:
      start, table = 0, pq.ParquetFile(f)
      _check_columns(shard, table.schema_arrow.names)
      for b in table.iter_batches(batch_size=batch):
        rows = b.to_pylist()
        yield shard, rows, start
        start += len(rows)


def num_units(path: str) -> int:
  """The source's size in the units `records` reports progress in: bytes of JSONL,
  rows of a table."""
  src = resolve(path)
  if src.kind == "jsonl":
    return paths.getsize(path)
  if src.kind == "arrow":
    return len(_dataset(src, path))
  pq = _need("pyarrow.parquet", "parquet", path)
  total = 0
  for shard in src.files:
    with paths.open_read(shard) as f:
      total += pq.ParquetFile(f).metadata.num_rows
  return total


def records(path: str, batch: int = 2000) -> Iterator[tuple[str, int, object, int]]:
  """`(where, number, raw, units read)` of every record in order: `raw` a JSONL line's
  bytes or a table row's dict, `number` from 1 over the whole source."""
  src = resolve(path)
  if src.kind == "jsonl":
    read = 0
    with paths.open_read(path) as f:
      for lineno, raw in enumerate(f, start=1):
        read += len(raw)
        yield f"{path}:{lineno}", lineno, raw, read
    return
  number = 0
  for shard, rows, start in _table_rows(src, path, batch):
    if isinstance(rows, dict):  # a datasets slice: columns of lists
      rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
    for i, row in enumerate(rows):
      number += 1
      yield f"{shard} row {start + i + 1}", number, row, number


def read_rows(path: str, numbers) -> dict:
  """`{number: dict}` of the records `numbers` (from 1; the rows a token store's pairs
  came from, `PairStore.lines`), every column kept; one pass."""
  want, rows = {int(n) for n in numbers}, {}
  for _, number, raw, _ in records(path):
    if number in want:
      rows[number] = json.loads(raw) if isinstance(raw, bytes) else raw
      if len(rows) == len(want):
        break
  return rows
