"""Preference data: pairs (JSONL, Parquet, save_to_disk: `data.sources`) ->
fixed-length token rows -> deterministic batches.

A record is a pair `{"prompt", "chosen", "rejected"}`, either three strings or, as in
TRL's conversational preference format, `prompt` a list of `{"role", "content"}`
messages and `chosen` / `rejected` each a list of one `{"role": "assistant", ...}`
message. Without a prompt (or with a prompt of the other format) the prompt is implicit
in `chosen` and `rejected` and is extracted as TRL does (`encode.maybe_extract_prompt`). Each pair becomes two rows of length `max_length`:

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
import tempfile
from typing import Protocol

import numpy as np

from tunix_core.data import build as data_build
from tunix_core.data import encode as data_encode
from tunix_core.data import packing
from tunix_core.data import sources
from tunix_core.data import store as store_lib
from tunix_core.storage import paths

FIELDS = data_encode.FIELDS
IGNORE_INDEX = data_encode.IGNORE_INDEX  # the target at unscored positions


DataError = sources.DataError


class Tokenizer(Protocol):
  """What the pipeline needs from a tokenizer (`ByteTokenizer`, `hf.HFTokenizer`).

  Message-list pairs also need `chat_template` (None: none) and
  `apply_chat_template(messages, add_generation_prompt=False) -> str`.
  """

  vocab_size: int
  bos_id: int | None
  eos_id: int
  pad_id: int
  fingerprint: str  # changes whenever `encode` may (a token store's key)

  def encode(self, text: str) -> list[int]:  # no special tokens added
    ...


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; then BOS, EOS and PAD. No chat template."""

  vocab_size = 259
  fingerprint = "utf-8 bytes"
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
  records, skipped = data_build.parse_lines(
      ((where, n, raw) for where, n, raw, _ in sources.records(path)), skip_bad_lines)
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
  """Encoded pairs held in memory; every array is int32 `[num_pairs, 2, max_length]`
  (chosen, rejected). The trainer reads a token store instead (`data.store.PairStore`);
  both offer `take`, `sizes` and `num_tokens`.

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

  def take(self, idx, only=None) -> dict:
    """The batch of the pairs `idx` (`take_pairs`; all of it, whatever `only` says)."""
    del only
    return take_pairs(self, idx)

  def sizes(self, share: bool):
    """The `packing.Sizes` of every pair."""
    return packing.pair_sizes(take_pairs(self, np.arange(len(self))), share)

  def num_tokens(self, idx) -> int:
    return int(self.attention_mask[np.asarray(idx)].sum())


def load_dataset(path: str, tok: Tokenizer, max_length: int, max_prompt_length: int,
                 skip_bad_lines: bool = False, *, vocab_size: int | None = None,
                 log=None) -> PreferenceDataset:
  """Reads and encodes a JSONL file in memory (through a throwaway token store: one
  encoding rule); pairs with an empty (or fully cut) response are dropped. `log` (if
  given) gets progress lines.

  Raises `DataError` (naming `path:line`) for a bad line (`read_jsonl`), a message-list
  pair when `tok` has no chat template, when the template fails on the messages, and,
  given the model's `vocab_size`, for a token id (or the pad id) that is not below it.
  """
  with tempfile.TemporaryDirectory(prefix="tunix-pairs-") as tmp:
    store = data_build.build(path, tok, tmp, max_length, max_prompt_length, skip_bad_lines,
                             workers=1, log=log)
    if vocab_size is not None:
      check_vocab(store, vocab_size)
    batch = store.take(np.arange(len(store)))
  return PreferenceDataset(**batch, num_dropped=store.num_dropped,
                           num_skipped_lines=store.num_skipped_lines,
                           num_prefix_mismatch=store.num_prefix_mismatch)


def check_vocab(store: store_lib.PairStore, vocab_size: int) -> None:
  """`DataError` unless every id of `store` (and its pad id) is below `vocab_size` (the
  model's), naming the first pair's line otherwise."""
  path = store.meta.source
  if store.meta.pad_id >= vocab_size:
    raise DataError(f"{path}: the tokenizer's pad id {store.meta.pad_id} is not below the "
                    f"model's vocabulary size {vocab_size}")
  if store.meta.max_id >= vocab_size:
    pair, top = store.first_pair_at_or_above(vocab_size)
    raise DataError(f"{path}:{store.lines[pair]}: token id {top} is not below the "
                    f"model's vocabulary size {vocab_size} (tokenizer and model differ)")


def data_change(state: dict, data_key: str | None) -> str | None:
  """Why the iterator state `state` cannot continue over the token store `data_key`, in
  one line naming `--allow_data_change`, or None: the same store, or a side without a
  key (a state saved by an earlier version, or data held in memory)."""
  saved = state.get("data_key")
  if saved is None or data_key is None or saved == data_key:
    return None
  return (f"the saved data position (epoch {state['epoch']}, pair {state['position']}) is "
          f"in the token store {saved}, but the training data now give the store "
          f"{data_key} (their content, tokenizer or length limits changed); pass "
          f"--allow_data_change to restart epoch {state['epoch']} from its start with the "
          "new data")


class BatchIterator:
  """Endless, epoch-shuffled batches of `batch_size` pairs; the tail of an epoch is dropped.

  The order of epoch `e` is a permutation drawn from `(seed, e)` alone, so the state
  `{"epoch", "position"}` (position = pairs consumed within the epoch) is enough to
  rebuild the iterator exactly where it was, over the same pairs. `data_key` (the token
  store's key, `PairStore.key`) names those pairs and goes into the state: a state of
  other pairs (`data_change`) would continue silently in another order, so it is a
  `DataError`, or under `allow_data_change` restarts its epoch at position 0 over the
  new pairs.
  """

  def __init__(self, dataset: PreferenceDataset, batch_size: int, seed: int,
               state: dict | None = None, *, data_key: str | None = None,
               allow_data_change: bool = False):
    if batch_size > len(dataset):
      raise ValueError(f"batch_size {batch_size} exceeds the {len(dataset)} pairs of the dataset")
    self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
    self.data_key, self.allow_data_change = data_key, allow_data_change
    self.epoch, self.position, self._cached = 0, 0, (None, None)
    if state is not None:
      self.set_state(state)

  def get_state(self) -> dict:
    state = {"epoch": self.epoch, "position": self.position}
    if self.data_key is not None:
      state["data_key"] = self.data_key
    return state

  def set_state(self, state: dict) -> None:
    epoch, position = int(state["epoch"]), int(state["position"])
    refusal = data_change(state, self.data_key)
    if refusal:
      if not self.allow_data_change:
        raise DataError(refusal)
      position = 0  # positions in the old order mean nothing in the new one
    if epoch < 0 or not 0 <= position <= len(self.dataset) or position % self.batch_size:
      raise ValueError(f"invalid iterator state {state} for batch size {self.batch_size} and "
                       f"{len(self.dataset)} pairs")
    self.epoch, self.position = epoch, position

  def _order(self, epoch: int) -> np.ndarray:
    if self._cached[0] != epoch:  # drawn once per epoch, not per batch
      self._cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(
          len(self.dataset)))
    return self._cached[1]

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

