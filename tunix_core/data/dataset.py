"""Preference data: JSONL pairs -> fixed-length token rows -> deterministic batches.

A line is a pair `{"prompt", "chosen", "rejected"}`, either three strings or, as in
TRL's conversational preference format, `prompt` a list of `{"role", "content"}`
messages and `chosen` / `rejected` each a list of one `{"role": "assistant", ...}`
message. Each pair becomes two rows of length `max_length`:

    tokens  = BOS prompt response            (then PAD)
    targets =     prompt response END        (tokens shifted left by one)

For string pairs BOS is the tokenizer's (none when `bos_id` is None) and END is EOS;
`prompt + response` is tokenized jointly and split at the prompt's length (see
`data.encode`, which also says what happens when a BPE merges across the seam; such
responses are counted in `num_prefix_mismatch`). For message lists the prompt is the
chat template with the generation prompt and each response is the rendering of
`prompt + [response]` minus the prompt's ids: the template writes BOS and the ends of
turns, we add nothing. With the byte tokenizer a row is exactly `[BOS] prompt response
EOS` in UTF-8 bytes.

`loss_mask` is 1 exactly where the target is a response token (including its END), so
the first response token is scored and the prompt and padding are not; at unscored
positions the target is `IGNORE_INDEX`. A batch of `B` pairs is a dict of int32 arrays
`[B, 2, T]`, axis 1 being (chosen, rejected): the one pair layout from here to the loss.

Chat template: `with_chat_template(tok, spec)` applies `--chat_template` (`auto`: the
tokenizer's own; `none`: no template, so message lists are an error; else a jinja file).
"""

import copy
import dataclasses
import json
from typing import Protocol

import numpy as np

from tunix_core.data import encode as data_encode
from tunix_core.storage import paths

FIELDS = data_encode.FIELDS
IGNORE_INDEX = data_encode.IGNORE_INDEX  # the target at unscored positions


class DataError(ValueError):
  """Bad preference data; the message names the file and line."""


class Tokenizer(Protocol):
  """What the pipeline needs from a tokenizer (`ByteTokenizer`, `hf.HFTokenizer`).

  Message-list pairs also need `chat_template` (None: none) and
  `apply_chat_template(messages, add_generation_prompt=False) -> str`.
  """

  vocab_size: int
  bos_id: int | None
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]:  # no special tokens added
    ...


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; then BOS, EOS and PAD. No chat template."""

  vocab_size = 259
  bos_id = 256
  eos_id = 257
  pad_id = 258

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def with_chat_template(tok: Tokenizer, chat_template: str) -> Tokenizer:
  """`tok` with the chat template `--chat_template` names: `"auto"` keeps the tokenizer's
  own, `"none"` removes it, anything else is the path of a jinja file that replaces it.

  Returns a shallow copy when the template changes (`tok` itself is never modified).
  Raises `DataError` for a missing file, or a template for a tokenizer that cannot render
  one (the byte tokenizer).
  """
  if chat_template == "auto":
    return tok
  template = None
  if chat_template != "none":
    try:
      template = paths.read_bytes(chat_template).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
      raise DataError(f"{chat_template}: cannot read the chat template ({e})") from None
  if not hasattr(tok, "apply_chat_template"):
    if template is None:
      return tok
    raise DataError(f"{chat_template}: {type(tok).__name__} cannot render chat templates")
  tok = copy.copy(tok)
  tok.chat_template = template
  return tok


def _read_records(path: str, skip_bad_lines: bool) -> tuple[list[tuple[int, dict]], int]:
  """`([(line number, pair)], bad lines skipped)`; see `read_jsonl`."""
  try:
    lines = paths.read_bytes(path).decode("utf-8").splitlines(keepends=True)
  except FileNotFoundError:
    raise DataError(f"{path}: no such data file") from None
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text ({e})") from None

  records, skipped = [], 0
  for lineno, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
      error = data_encode.pair_error(record)
      if error:
        raise DataError(f"{path}:{lineno}: {error}")
    except (json.JSONDecodeError, DataError) as e:
      if skip_bad_lines:
        skipped += 1
        continue
      if isinstance(e, DataError):
        raise
      raise DataError(f"{path}:{lineno}: malformed JSON ({e.msg})") from None
    records.append((lineno, {k: record[k] for k in FIELDS}))
  if not records:
    raise DataError(f"{path}: no preference pairs" + (f" ({skipped} bad lines skipped)"
                                                       if skipped else " (empty file)"))
  return records, skipped


def read_jsonl(path: str, skip_bad_lines: bool = False) -> tuple[list[dict], int]:
  """Reads preference pairs; returns `(pairs, number of bad lines skipped)`.

  Raises `DataError` naming `path:line` for malformed JSON, a record that is not an
  object, a missing field, fields that are neither three strings nor a message-list
  prompt with one-assistant-message `chosen` and `rejected` (each message an object with
  string `role` and `content`), unless `skip_bad_lines`; and for a file with no pairs at
  all. Blank lines are ignored.
  """
  records, skipped = _read_records(path, skip_bad_lines)
  return [pair for _, pair in records], skipped


def encode_row(prompt_ids: list[int], response_ids: list[int], tok: Tokenizer,
               max_length: int, max_prompt_length: int):
  """One row `(tokens, targets, loss_mask)`, each int32 `[max_length]`, or None, for
  `[BOS] prompt response EOS` (BOS when `tok.bos_id` is not None).

  The prompt keeps its last `max_prompt_length` tokens (BOS not counted); the response
  and its EOS are cut at the end to fit. Returns None when no response token survives
  (including an empty response), since such a row has no preference signal.
  """
  if not response_ids:
    return None
  bos = [] if tok.bos_id is None else [tok.bos_id]
  return data_encode.build_row(bos, prompt_ids, response_ids + [tok.eos_id], tok.pad_id,
                               max_length, max_prompt_length)


@dataclasses.dataclass(frozen=True)
class PreferenceDataset:
  """Encoded pairs; every array is int32 `[num_pairs, 2, max_length]` (chosen, rejected).

  `num_prefix_mismatch` counts responses (not pairs) whose joint `prompt + response`
  tokens did not start with the prompt's tokens (see `data.encode`).
  """

  tokens: np.ndarray
  targets: np.ndarray
  loss_mask: np.ndarray
  attention_mask: np.ndarray
  num_dropped: int
  num_skipped_lines: int
  num_prefix_mismatch: int = 0

  def __len__(self):
    return self.tokens.shape[0]


def _response_text(response) -> str:
  return response if isinstance(response, str) else response[0]["content"]


def load_dataset(path: str, tok: Tokenizer, max_length: int, max_prompt_length: int,
                 skip_bad_lines: bool = False, *, vocab_size: int | None = None,
                 log=None) -> PreferenceDataset:
  """Reads and encodes a JSONL file; pairs with an empty (or fully cut) response are dropped.
  `log` (if given) gets a progress line at every tenth of a file of 10,000 pairs or more.

  Raises `DataError` (naming `path:line`) for a message-list pair when `tok` has no chat
  template, when the template fails on the messages, and, given the model's
  `vocab_size`, for a token id (or the pad id) that is not below it.
  """
  if not 0 < max_prompt_length < max_length:
    raise ValueError(f"need 0 < max_prompt_length ({max_prompt_length}) < max_length "
                     f"({max_length})")
  records, skipped = _read_records(path, skip_bad_lines)
  rows, lines, dropped, mismatches = [], [], 0, 0
  tenth = len(records) // 10 if log and len(records) >= 10_000 else 0
  for i, (lineno, pair) in enumerate(records):
    if tenth and i % tenth == 0:
      log(f"{path}: encoding pair {i + 1:,} of {len(records):,}")
    responses = [pair["chosen"], pair["rejected"]]
    chat = isinstance(pair["prompt"], list)
    if chat and getattr(tok, "chat_template", None) is None:
      raise DataError(f"{path}:{lineno}: a conversational pair (message lists) needs a chat "
                      f"template and the tokenizer has none (set --chat_template=FILE.jinja, "
                      f"or write the pairs as strings)")
    if not all(_response_text(r) for r in responses):
      dropped += 1
      continue
    try:
      encode = data_encode.encode_chat if chat else data_encode.encode_plain
      bos, prompt, ids, n = encode(tok, pair["prompt"], responses)
    except data_encode.ChatTemplateError as e:
      raise DataError(f"{path}:{lineno}: the chat template failed ({e})") from None
    row = [data_encode.build_row(bos, prompt, r, tok.pad_id, max_length, max_prompt_length)
           for r in ids]
    if any(r is None for r in row):
      dropped += 1
      continue
    mismatches += n
    rows.append(row)
    lines.append(lineno)
  if not rows:
    raise DataError(f"{path}: all {len(records)} pairs were dropped (empty responses)")
  tokens, targets, loss_mask = (np.stack([[c[i], r[i]] for c, r in rows]) for i in range(3))
  if vocab_size is not None:
    _check_vocab(path, tokens, targets, lines, tok.pad_id, vocab_size)
  # Real tokens are a prefix of each row: BOS, prompt, then every response token but
  # the last target.
  lengths = (loss_mask.sum(-1) + (loss_mask.argmax(-1)))[..., None]
  attention_mask = (np.arange(max_length) < lengths).astype(np.int32)
  return PreferenceDataset(tokens, targets, loss_mask, attention_mask, dropped, skipped,
                           mismatches)


def _check_vocab(path, tokens, targets, lines, pad_id, vocab_size):
  """`DataError` at the first pair holding an id >= `vocab_size` (the model's)."""
  if pad_id >= vocab_size:
    raise DataError(f"{path}: the tokenizer's pad id {pad_id} is not below the model's "
                    f"vocabulary size {vocab_size}")
  top = np.maximum(tokens.max((1, 2)), targets.max((1, 2)))
  bad = np.flatnonzero(top >= vocab_size)
  if bad.size:
    raise DataError(f"{path}:{lines[bad[0]]}: token id {top[bad[0]]} is not below the "
                    f"model's vocabulary size {vocab_size} (tokenizer and model differ)")


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

