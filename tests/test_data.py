"""Data pipeline: row layout and masks by hand, truncation, drops, iterator state, bad input."""

import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tunix_core import data

TOK = data.ByteTokenizer()
BOS, EOS, PAD, IGN = TOK.bos_id, TOK.eos_id, TOK.pad_id, data.IGNORE_INDEX
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, lines, name="pairs.jsonl"):
  path = tmp_path / name
  path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
  return str(path)


def _pair(p, c, r):
  return json.dumps({"prompt": p, "chosen": c, "rejected": r})


def test_row_layout_and_mask():
  # "ab" -> "xy": tokens BOS a b x y PAD.., targets a b x y EOS.., scored: x y EOS.
  tokens, targets, mask = data.encode_row(TOK.encode("ab"), TOK.encode("xy"), TOK, 8, 4)
  a, b, x, y = (ord(ch) for ch in "abxy")
  np.testing.assert_array_equal(tokens, [BOS, a, b, x, y, PAD, PAD, PAD])
  np.testing.assert_array_equal(targets, [IGN, IGN, x, y, EOS, IGN, IGN, IGN])
  np.testing.assert_array_equal(mask, [0, 0, 1, 1, 1, 0, 0, 0])
  assert targets[2] == x  # the first response token is scored


def test_truncation_prompt_left_response_right():
  # Prompt "abcdef" with max_prompt_length 3 keeps "def"; response "uvwxyz" in a row of 6
  # keeps 3 scored targets "u v w", with no EOS since the response was cut.
  tokens, targets, mask = data.encode_row(TOK.encode("abcdef"), TOK.encode("uvwxyz"), TOK, 6, 3)
  d, e, f, u, v, w = (ord(ch) for ch in "defuvw")
  np.testing.assert_array_equal(tokens, [BOS, d, e, f, u, v])
  np.testing.assert_array_equal(targets, [IGN, IGN, IGN, u, v, w])
  np.testing.assert_array_equal(mask, [0, 0, 0, 1, 1, 1])


def test_dataset_batches_and_drops(tmp_path):
  path = _write(tmp_path, [_pair("q1", "good", "bad"), _pair("q2", "", "bad"),
                           _pair("q3", "yes", "no"), ""])
  ds = data.load_dataset(path, TOK, max_length=16, max_prompt_length=8)
  assert len(ds) == 2 and ds.num_dropped == 1
  batch = data.take_pairs(ds, np.array([1, 0]))
  assert batch["tokens"].shape == (2, 2, 16)  # [pairs, (chosen, rejected), T]
  assert TOK.decode(batch["tokens"][0, 0]) == "q3yes"  # BOS and PAD decode to nothing
  decoded = [[TOK.decode(row[m > 0]) for row, m in zip(rows, masks)]
             for rows, masks in zip(batch["targets"], batch["loss_mask"])]
  assert decoded == [["yes", "no"], ["good", "bad"]]  # pair 1, then pair 0
  # Attention covers BOS + prompt + response (the EOS is only a target).
  np.testing.assert_array_equal(batch["attention_mask"].sum(-1), [[1 + 2 + 3, 1 + 2 + 2],
                                                                   [1 + 2 + 4, 1 + 2 + 3]])
  assert (batch["targets"][batch["loss_mask"] == 0] == IGN).all()


def test_iterator_is_deterministic_and_resumes(tmp_path):
  lines = [_pair(f"p{i}", f"c{i}", f"r{i}") for i in range(10)]
  ds = data.load_dataset(_write(tmp_path, lines), TOK, 16, 8)
  it = data.BatchIterator(ds, batch_size=3, seed=7)
  seen = [it.next_indices() for _ in range(3)]  # one epoch (10 // 3 = 3 batches)
  assert sorted(np.concatenate(seen).tolist()) == sorted(set(np.concatenate(seen).tolist()))
  state = it.get_state()
  assert state == {"epoch": 0, "position": 9}
  rest = [it.next_indices() for _ in range(4)]
  resumed = data.BatchIterator(ds, batch_size=3, seed=7, state=json.loads(json.dumps(state)))
  for want in rest:
    np.testing.assert_array_equal(resumed.next_indices(), want)
  assert resumed.get_state() == it.get_state() == {"epoch": 2, "position": 3}
  other = data.BatchIterator(ds, batch_size=3, seed=8)
  assert not all(np.array_equal(other.next_indices(), s) for s in seen)
  with pytest.raises(ValueError, match="invalid iterator state"):
    data.BatchIterator(ds, batch_size=3, seed=7, state={"epoch": 0, "position": 4})


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a", "chosen": "b"', "malformed JSON"),
    ('{"prompt": "a", "chosen": "b"}', "missing field 'rejected'"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}', "field 'chosen' must be a string"),
    ('["a", "b", "c"]', "expected a JSON object"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
  path = _write(tmp_path, [_pair("p", "c", "r"), line])
  with pytest.raises(data.DataError, match=f"pairs.jsonl:2: {message}"):
    data.read_jsonl(path)
  pairs, skipped = data.read_jsonl(path, skip_bad_lines=True)
  assert len(pairs) == 1 and skipped == 1


def test_empty_and_missing_files(tmp_path):
  with pytest.raises(data.DataError, match="empty.jsonl: no preference pairs"):
    data.read_jsonl(_write(tmp_path, [], "empty.jsonl"))
  with pytest.raises(data.DataError, match="no such data file"):
    data.read_jsonl(str(tmp_path / "nope.jsonl"))
  with pytest.raises(data.DataError, match="all 1 pairs were dropped"):
    data.load_dataset(_write(tmp_path, [_pair("p", "", "r")]), TOK, 16, 8)
  with pytest.raises(ValueError, match="max_prompt_length"):
    data.load_dataset(_write(tmp_path, [_pair("p", "c", "r")]), TOK, 8, 8)


def test_shipped_data_regenerates_identically(tmp_path):
  subprocess.run([sys.executable, os.path.join(REPO, "data", "make_data.py"),
                  "--out_dir", str(tmp_path)], check=True, capture_output=True)
  for name in ("train.jsonl", "eval.jsonl"):
    assert filecmp.cmp(tmp_path / name, os.path.join(REPO, "data", name), shallow=False)
  pairs, _ = data.read_jsonl(os.path.join(REPO, "data", "eval.jsonl"))
  for p in pairs:  # the rule that makes chosen better holds on every pair
    digits = [int(x) for x in p["prompt"].split()[1:]]
    if p["prompt"].startswith("sort"):
      assert p["chosen"] == " ".join(map(str, sorted(digits))) != p["rejected"]
      assert sorted(p["rejected"].split()) == sorted(p["chosen"].split())
    else:
      assert int(p["chosen"]) == max(digits) > int(p["rejected"])
