"""Preference data: JSONL pairs -> fixed-length token rows -> deterministic batches.

A pair `{"prompt", "chosen", "rejected"}` becomes two rows of length `max_length`:

    tokens  = [BOS] prompt response          (then PAD)
    targets =       prompt response EOS      (tokens shifted left by one)

`loss_mask` is 1 exactly where the target is a response token or the EOS, so the first
response token is scored and the prompt and padding are not; at unscored positions the
target is `IGNORE_INDEX`. A batch of `B` pairs is a dict of int32 arrays `[B, 2, T]`,
axis 1 being (chosen, rejected): the one pair layout from here to the loss.
"""

import dataclasses
import json
from typing import Protocol

import numpy as np

from kernels import IGNORE_INDEX
FIELDS = ("prompt", "chosen", "rejected")


class DataError(ValueError):
  """Bad preference data; the message names the file and line."""


class Tokenizer(Protocol):
  """What the pipeline needs from a tokenizer; a real one can be plugged in here."""

  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]:
    ...


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; then BOS, EOS and PAD."""

  vocab_size = 259
  bos_id = 256
  eos_id = 257
  pad_id = 258

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def read_jsonl(path: str, skip_bad_lines: bool = False) -> tuple[list[dict], int]:
  """Reads preference pairs; returns `(pairs, number of bad lines skipped)`.

  Raises `DataError` naming `path:line` for malformed JSON, a record that is not an
  object, a missing or non-string field (unless `skip_bad_lines`), and for a file with
  no pairs at all. Blank lines are ignored.
  """
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.readlines()
  except FileNotFoundError:
    raise DataError(f"{path}: no such data file") from None
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text ({e})") from None

  pairs, skipped = [], 0
  for lineno, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
      for field in FIELDS:
        if field not in record:
          raise DataError(f"{path}:{lineno}: missing field {field!r}")
        if not isinstance(record[field], str):
          raise DataError(f"{path}:{lineno}: field {field!r} must be a string, "
                          f"got {type(record[field]).__name__}")
    except (json.JSONDecodeError, DataError) as e:
      if skip_bad_lines:
        skipped += 1
        continue
      if isinstance(e, DataError):
        raise
      raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
    pairs.append({k: record[k] for k in FIELDS})
  if not pairs:
    raise DataError(f"{path}: no preference pairs" + (f" ({skipped} bad lines skipped)"
                                                       if skipped else " (empty file)"))
  return pairs, skipped


def encode_row(prompt_ids: list[int], response_ids: list[int], tok: Tokenizer,
               max_length: int, max_prompt_length: int):
  """One row `(tokens, targets, loss_mask)`, each int32 `[max_length]`, or None.

  The prompt keeps its last `max_prompt_length` tokens (BOS not counted); the response
  and its EOS are cut at the end to fit. Returns None when no response token survives
  (including an empty response), since such a row has no preference signal.
  """
  prompt_ids = prompt_ids[max(0, len(prompt_ids) - max_prompt_length):]
  budget = max_length - len(prompt_ids)  # scored targets that fit; >= 1
  scored = (response_ids + [tok.eos_id])[:budget]
  if not response_ids or budget <= 0:
    return None
  seq = [tok.bos_id] + prompt_ids + scored
  n = len(seq) - 1
  tokens = np.full(max_length, tok.pad_id, np.int32)
  targets = np.full(max_length, IGNORE_INDEX, np.int32)
  loss_mask = np.zeros(max_length, np.int32)
  tokens[:n] = seq[:-1]
  first = len(prompt_ids)  # target index of the first response token
  targets[first:n] = seq[first + 1:]
  loss_mask[first:n] = 1
  return tokens, targets, loss_mask


@dataclasses.dataclass(frozen=True)
class PreferenceDataset:
  """Encoded pairs; every array is int32 `[num_pairs, 2, max_length]` (chosen, rejected)."""

  tokens: np.ndarray
  targets: np.ndarray
  loss_mask: np.ndarray
  attention_mask: np.ndarray
  num_dropped: int
  num_skipped_lines: int

  def __len__(self):
    return self.tokens.shape[0]


def load_dataset(path: str, tok: Tokenizer, max_length: int, max_prompt_length: int,
                 skip_bad_lines: bool = False) -> PreferenceDataset:
  """Reads and encodes a JSONL file; pairs with an empty (or fully cut) response are dropped."""
  if not 0 < max_prompt_length < max_length:
    raise ValueError(f"need 0 < max_prompt_length ({max_prompt_length}) < max_length "
                     f"({max_length})")
  pairs, skipped = read_jsonl(path, skip_bad_lines)
  rows, dropped = [], 0
  for pair in pairs:
    prompt = tok.encode(pair["prompt"])
    chosen = encode_row(prompt, tok.encode(pair["chosen"]), tok, max_length, max_prompt_length)
    rejected = encode_row(prompt, tok.encode(pair["rejected"]), tok, max_length,
                          max_prompt_length)
    if chosen is None or rejected is None:
      dropped += 1
      continue
    rows.append((chosen, rejected))
  if not rows:
    raise DataError(f"{path}: all {len(pairs)} pairs were dropped (empty responses)")
  tokens, targets, loss_mask = (np.stack([[c[i], r[i]] for c, r in rows]) for i in range(3))
  # Real tokens are a prefix of each row: BOS, prompt, then every response token but
  # the last target.
  lengths = (loss_mask.sum(-1) + (loss_mask.argmax(-1)))[..., None]
  attention_mask = (np.arange(max_length) < lengths).astype(np.int32)
  return PreferenceDataset(tokens, targets, loss_mask, attention_mask, dropped, skipped)


class BatchIterator:
  """Endless, epoch-shuffled batches of `batch_size` pairs; the tail of an epoch is dropped.

  The order of epoch `e` is a permutation drawn from `(seed, e)` alone, so the state
  `{"epoch", "position"}` (position = pairs consumed within the epoch) is enough to
  rebuild the iterator exactly where it was.
  """

  def __init__(self, dataset: PreferenceDataset, batch_size: int, seed: int,
               state: dict | None = None):
    if batch_size > len(dataset):
      raise ValueError(f"batch_size {batch_size} exceeds the {len(dataset)} pairs of the dataset")
    self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
    self.epoch, self.position = 0, 0
    if state is not None:
      self.set_state(state)

  def get_state(self) -> dict:
    return {"epoch": self.epoch, "position": self.position}

  def set_state(self, state: dict) -> None:
    epoch, position = int(state["epoch"]), int(state["position"])
    if epoch < 0 or not 0 <= position <= len(self.dataset) or position % self.batch_size:
      raise ValueError(f"invalid iterator state {state} for batch size {self.batch_size} and "
                       f"{len(self.dataset)} pairs")
    self.epoch, self.position = epoch, position

  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

  def next_indices(self) -> np.ndarray:
    """Advances by one batch; returns the dataset indices of its `batch_size` pairs."""
    if self.position + self.batch_size > len(self.dataset):
      self.epoch, self.position = self.epoch + 1, 0
    idx = self._order(self.epoch)[self.position:self.position + self.batch_size]
    self.position += self.batch_size
    return idx


def take_pairs(dataset: PreferenceDataset, idx: np.ndarray) -> dict:
  """Batch of the pairs `idx`: int32 arrays `[B, 2, T]` (axis 1: chosen, rejected)."""
  return {"tokens": dataset.tokens[idx], "targets": dataset.targets[idx],
          "loss_mask": dataset.loss_mask[idx], "attention_mask": dataset.attention_mask[idx]}


def eval_batches(dataset: PreferenceDataset, batch_size: int):
  """The dataset in order, in full batches (a final partial batch is left out)."""
  for start in range(0, len(dataset) - batch_size + 1, batch_size):
    yield take_pairs(dataset, np.arange(start, start + batch_size))
