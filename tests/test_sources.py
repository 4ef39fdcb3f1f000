"""Preference data as users store it (`data.sources`): Parquet files, directories and
globs of shards, and `datasets.save_to_disk` directories build the token store that the
same pairs as JSONL build; implicit-prompt pairs build the store of their explicit form
(TRL's `maybe_extract_prompt`); bad tables are one line naming the file and the row or
column."""

import json
import os

import numpy as np
import pytest

from tunix_core import data
from tunix_core.data import build
from tunix_core.data import sources

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = data.ByteTokenizer()
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _pairs(n=600) -> list[dict]:
  """The first `n` of the quickstart's pairs, with an extra column."""
  with open(os.path.join(REPO, "data", "train.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line, _ in zip(f, range(n))]
  return [dict(r, solution=f"s{i}") for i, r in enumerate(rows)]


def _jsonl(path, rows) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return str(path)


def _store(path: str, out) -> list[np.ndarray]:
  build.build(path, TOK, str(out), 48, 24, workers=1, chunk_pairs=128)
  return [np.load(os.path.join(str(out), f)) for f in ("ids.npy", "offsets.npy", "lines.npy")]


def _same(a, b):
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def test_parquet_file_shards_glob_and_save_to_disk_equal_jsonl(tmp_path):
  rows = _pairs()
  want = _store(_jsonl(tmp_path / "pairs.jsonl", rows), tmp_path / "s-jsonl")
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "one.parquet", row_group_size=100)
  shards = tmp_path / "shards"
  shards.mkdir()
  for i, part in enumerate((rows[:250], rows[250:])):  # in name order, not row groups'
    pq.write_table(pa.Table.from_pylist(part), shards / f"train-{i:05d}-of-00002.parquet")
  paths = [str(tmp_path / "one.parquet"), str(shards), str(shards / "train-*.parquet")]
  datasets = pytest.importorskip("datasets")
  ds = datasets.Dataset.from_list(rows)
  ds.save_to_disk(str(tmp_path / "hf"))
  datasets.DatasetDict(train=ds, test=ds.select(range(10))).save_to_disk(
      str(tmp_path / "hfdict"))
  paths += [str(tmp_path / "hf"), str(tmp_path / "hfdict") + ":train"]
  for i, path in enumerate(paths):
    _same(_store(path, tmp_path / f"s{i}"), want)
  # The reward functions' columns: every one of a pair's row, by its number.
  store = data.PairStore(str(tmp_path / "s4"))
  got = build.read_rows(paths[-1], store.lines[[0, 7]])
  assert [got[n]["solution"] for n in store.lines[[0, 7]]] == ["s0", "s7"]
  # Store keys follow the content of every shard.
  key = lambda: build.store_key(str(shards), TOK, 48, 24, False)
  before = key()
  pq.write_table(pa.Table.from_pylist(rows[250:260]), shards / "train-00001-of-00002.parquet")
  assert key() != before
  with pytest.raises(data.DataError, match=r"hfdict holds the splits train, test: name one "
                     r"as .*hfdict:train$"):
    sources.resolve(str(tmp_path / "hfdict"))


def test_implicit_prompts_build_their_explicit_form(tmp_path):
  # Strings: the common prefix, its last space going to the responses (TRL's rule).
  implicit = [{"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"},
              {"chosen": "Say hi. hello", "rejected": "Say hi. bye"}]
  explicit = [{"prompt": "Q: 2+2? A:", "chosen": " 4", "rejected": " 5"},
              {"prompt": "Say hi.", "chosen": " hello", "rejected": " bye"}]
  _same(_store(_jsonl(tmp_path / "i.jsonl", implicit), tmp_path / "si"),
        _store(_jsonl(tmp_path / "e.jsonl", explicit), tmp_path / "se"))
  assert [build.parse_record("x", json.dumps(r).encode()) for r in implicit] == explicit
  # Messages: the common turns; also under a string prompt (UltraFeedback's layout).
  user, a, b = ({"role": r, "content": c} for r, c in
                (("user", "Hi?"), ("assistant", "Hello."), ("assistant", "Go.")))
  want = {"prompt": [user], "chosen": [a], "rejected": [b]}
  for record in ({"chosen": [user, a], "rejected": [user, b]},
                 {"prompt": "Hi?", "chosen": [user, a], "rejected": [user, b]}):
    assert build.parse_record("x", record) == want


def test_prompt_extraction_equals_trl():
  trl_data = pytest.importorskip("trl.data_utils")
  user, a, b = ({"role": r, "content": c} for r, c in
                (("user", "Hi?"), ("assistant", "Hello."), ("assistant", "Go.")))
  for record in ({"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"},
                 {"chosen": "abc", "rejected": "abd"},
                 {"chosen": [user, a], "rejected": [user, b]},
                 {"prompt": "Hi?", "chosen": [user, a], "rejected": [user, b]},
                 {"prompt": "p ", "chosen": " c", "rejected": " r"}):
    assert build.parse_record("x", dict(record)) == trl_data.maybe_extract_prompt(
        dict(record))


def test_bad_tables_are_one_line_naming_file_and_row_or_column(tmp_path):
  path = tmp_path / "bad.parquet"
  pq.write_table(pa.Table.from_pylist([{"prompt": "p", "chosen": "c"}]), path)
  with pytest.raises(data.DataError) as e:
    _store(str(path), tmp_path / "a")
  assert str(e.value) == f"{path}: no column 'rejected' (its columns: prompt, chosen)"
  rows = [{"prompt": "p", "chosen": "c", "rejected": "r"}] * 2 + [
      {"prompt": "p", "chosen": None, "rejected": "r"}]
  pq.write_table(pa.Table.from_pylist(rows), path)
  with pytest.raises(data.DataError) as e:
    _store(str(path), tmp_path / "b")
  assert str(e.value) == f"{path} row 3: field 'chosen' must be a string, got NoneType"
  for missing in (tmp_path / "none.parquet", tmp_path / "empty" / "*.parquet"):
    with pytest.raises(data.DataError, match="no such data file|no file matches"):
      sources.resolve(str(missing))
  (tmp_path / "dir").mkdir()
  with pytest.raises(data.DataError, match=r"no \*\.parquet shards and no datasets"):
    sources.resolve(str(tmp_path / "dir"))
