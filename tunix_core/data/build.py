"""Preference pairs (JSONL, Parquet, save_to_disk: `data.sources`) -> a token store
(`data.store`), tokenized once on every core.

The source is read as a stream, in chunks of `chunk_pairs` records (a file larger than
RAM is fine); each chunk is parsed and encoded (`encode_pair`, which is `data.dataset`'s
row rule). The first chunk is encoded in the calling process; when the rest would take
longer there than starting workers costs (each imports JAX), it is encoded in a pool of
worker processes (`spawn`: the parent may already run JAX's threads), at most two chunks
per worker in flight. The ids are appended to the store in source order, so the store
is the same for any number of workers. A bad record still raises `DataError` naming
where it is (`path:line`, `shard row N`), or is counted and skipped under
`skip_bad_lines`.

A store is found again by `store_key`: the source's content digest, the tokenizer's
fingerprint and special ids, the chat template and the length limits.
"""

import collections
import hashlib
import itertools
import json
import multiprocessing
import os
import tempfile
import time

import numpy as np

from tunix_core.data import encode as data_encode
from tunix_core.data import sources
from tunix_core.data import store as store_lib
from tunix_core.storage import paths
from tunix_core.storage import staging


# Seconds a spawned worker takes to start (it imports JAX: 1.4 s measured on a loaded
# 2-core host, about 2 s in docs/data.md's runs), weighed against the work left.
_WORKER_START_S = 2.0


DataError = sources.DataError


def parse_record(where: str, raw) -> dict | None:
  """The pair `{"prompt", "chosen", "rejected"}` of one record (None: a blank line): a
  JSONL line's bytes or a table row's dict, its prompt extracted when implicit
  (`encode.maybe_extract_prompt`), or a `DataError` naming `where`
  (`data.dataset.read_jsonl` lists what is checked)."""
  record = raw
  if isinstance(raw, bytes):
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(f"{where}: not UTF-8 text ({e})") from None
    if not line.strip():
      return None
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{where}: malformed JSON ({e.msg})") from None
  if not isinstance(record, dict):
    raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
  record = data_encode.maybe_extract_prompt(record)
  error = data_encode.pair_error(record)
  if error:
    raise DataError(f"{where}: {error}")
  return {k: record[k] for k in data_encode.FIELDS}


def read_rows(path: str, numbers) -> dict:
  """`{number: record}` of the records `numbers` of the source `path` (the rows a token
  store's pairs came from, `PairStore.lines`), every column kept, an implicit prompt
  extracted as the store's pairs were (`encode.maybe_extract_prompt`); one pass."""
  return {n: data_encode.maybe_extract_prompt(row)
          for n, row in sources.read_rows(path, numbers).items()}


def parse_lines(records, skip_bad_lines: bool) -> tuple[list, int]:
  """`([(number, pair)], bad records skipped)` of `[(where, number, raw)]` records
  (`parse_record`; a bad one raises unless `skip_bad_lines`)."""
  pairs, skipped = [], 0
  for where, lineno, raw in records:
    try:
      pair = parse_record(where, raw)
    except DataError:
      if not skip_bad_lines:
        raise
      skipped += 1
      continue
    if pair is not None:
      pairs.append((lineno, pair))
  return pairs, skipped


def encode_pair(tok, pair: dict, max_length: int, max_prompt_length: int):
  """`([prompt, chosen, rejected] id lists, mismatched responses)` as the store keeps
  them (prompt with BOS, cut to its last `max_prompt_length` ids; responses cut to fit
  `max_length + 1` ids with it), or None for a pair without a scored response id in
  both rows (an empty or fully cut response: dropped). Raises `ValueError` (without the
  line) for a message-list pair the tokenizer cannot render."""
  responses = [pair["chosen"], pair["rejected"]]
  chat = isinstance(pair["prompt"], list)
  if chat and getattr(tok, "chat_template", None) is None:
    raise ValueError("a conversational pair (message lists) needs a chat template and the "
                     "tokenizer has none (set --chat_template=FILE.jinja, or write the "
                     "pairs as strings)")
  text = lambda r: r if isinstance(r, str) else r[0]["content"]
  if not all(text(r) for r in responses):
    return None
  try:
    encode = data_encode.encode_chat if chat else data_encode.encode_plain
    bos, prompt, ids, mismatches = encode(tok, pair["prompt"], responses)
  except data_encode.ChatTemplateError as e:
    raise ValueError(f"the chat template failed ({e})") from None
  prompt = bos + prompt[max(0, len(prompt) - max_prompt_length):]
  ids = [r[:max_length + 1 - len(prompt)] for r in ids]
  # A row scores from the prompt's last id on (or from the second id without a prompt).
  if any(len(prompt) + len(r) - 1 <= max(len(prompt) - 1, 0) for r in ids):
    return None
  return [prompt] + ids, mismatches


_WORKER = {}


def _init(settings: dict):
  _WORKER.update(settings)


def _encode_chunk(chunk: list) -> tuple:
  """One chunk `[(where, number, raw)]` -> `(ids, lengths [k, 3], numbers [k], dropped,
  skipped, mismatches)`; runs in a worker (or here), with `_WORKER`'s settings."""
  w = _WORKER
  ids, lengths, lines, dropped, mismatches = [], [], [], 0, 0
  pairs, skipped = parse_lines(chunk, w["skip_bad_lines"])
  where = {number: place for place, number, _ in chunk}
  for lineno, pair in pairs:
    try:
      encoded = encode_pair(w["tok"], pair, w["max_length"], w["max_prompt_length"])
    except ValueError as e:
      raise DataError(f"{where[lineno]}: {e}") from None
    if encoded is None:
      dropped += 1
      continue
    runs, n = encoded
    ids += [i for run in runs for i in run]
    lengths.append([len(r) for r in runs])
    lines.append(lineno)
    mismatches += n
  return (np.array(ids, np.int32), np.array(lengths, np.int64).reshape(-1, 3),
          np.array(lines, np.int32), dropped, skipped, mismatches)


def _chunks(path: str, chunk_pairs: int):
  """`(chunk, units read so far)` over the source's records, streamed
  (`sources.records`)."""
  chunk, read = [], 0
  for where, number, raw, read in sources.records(path, chunk_pairs):
    chunk.append((where, number, raw))
    if len(chunk) == chunk_pairs:
      yield chunk, read
      chunk = []
  if chunk:
    yield chunk, read


def _in_order(fn, items, pool, in_flight: int):
  """`(fn(x), tag)` for each `(x, tag)` of the iterator `items`, in its order, computed
  in `pool` (a `multiprocessing` pool; None: here). `items` is read lazily: when the
  k-th result is yielded at most `k + in_flight - 1` items have been read (here: k), so
  the lines held stay a bound of chunks whatever the file's length."""
  if pool is None:
    yield from ((fn(x), tag) for x, tag in items)
    return
  pending = collections.deque()
  for x, tag in items:
    pending.append((pool.apply_async(fn, (x,)), tag))
    if len(pending) == in_flight:
      result, tag = pending.popleft()
      yield result.get(), tag
  while pending:
    result, tag = pending.popleft()
    yield result.get(), tag


def _encoded(path, settings, workers, chunk_pairs, log):
  """The chunks' `_encode_chunk` results in source order, with a progress line at every
  tenth of a source of 256 KiB or 2,560 rows or more. The first chunk is encoded here;
  the time it took times the chunks left (estimated from the source's bytes or rows)
  decides the rest: in a pool of up to `workers` processes, started at once, when it
  would finish first, else here."""
  total, tenths, pairs = sources.num_units(path), 0, 0
  jsonl = sources.resolve(path).kind == "jsonl"
  big, unit = ((256 << 10), "file") if jsonl else (2560, "rows")
  chunks = _chunks(path, chunk_pairs)
  _init(settings)
  first = next(chunks, None)
  if first is None:
    return
  start = time.perf_counter()
  head = [(_encode_chunk(first[0]), first[1])]
  left = -(-total // first[1]) - 1
  procs = min(workers, left)
  pool = None
  # The pool takes its start plus the rest's time over `procs`.
  if procs > 1 and (time.perf_counter() - start) * left > _WORKER_START_S * procs / (procs - 1):
    pool = multiprocessing.get_context("spawn").Pool(procs, _init, (settings,))
  try:
    # Two chunks per worker in flight: the workers never wait, memory stays bounded.
    for result, done in itertools.chain(head, _in_order(_encode_chunk, chunks, pool,
                                                         2 * procs)):
      pairs += len(result[2])
      if log and total >= big and done * 10 // total > tenths:
        tenths = done * 10 // total
        log(f"{path}: tokenized {pairs:,} pairs ({done * 100 // total}% of the {unit})")
      yield result
  finally:
    if pool is not None:
      pool.terminate()


def tokenizer_key(tok) -> dict:
  """What of a tokenizer decides a store's ids."""
  return {"tokenizer": tok.fingerprint, "bos": tok.bos_id, "eos": tok.eos_id,
          "pad": tok.pad_id, "chat_template": getattr(tok, "chat_template", None)}


def store_key(path: str, tok, max_length: int, max_prompt_length: int,
              skip_bad_lines: bool) -> str:
  """The name a store of this data, tokenizer and limits is kept under."""
  key = dict(tokenizer_key(tok), format=store_lib.FORMAT,
             data=sources.digest(path), max_length=max_length,
             max_prompt_length=max_prompt_length, skip_bad_lines=skip_bad_lines)
  return "pairs-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def build(path: str, tok, out_dir: str, max_length: int, max_prompt_length: int,
          skip_bad_lines: bool = False, workers: int | None = None,
          chunk_pairs: int = 2000, log=None, beat=None) -> store_lib.PairStore:
  """Tokenizes the preference data `path` (`data.sources`) into a store at `out_dir` (local or remote; `meta.json`
  written last) and opens it. `workers`: processes (default: every core); `beat`, if
  given, is called with a name for the work after each chunk (a watchdog's beat)."""
  if not 0 < max_prompt_length < max_length:
    raise ValueError(f"need 0 < max_prompt_length ({max_prompt_length}) < max_length "
                     f"({max_length})")
  workers = workers or os.cpu_count() or 1
  settings = dict(tok=tok, path=path, max_length=max_length,
                  max_prompt_length=max_prompt_length, skip_bad_lines=skip_bad_lines)
  lengths, lines, counts, max_id = [], [], np.zeros(3, np.int64), 0
  with tempfile.TemporaryDirectory(prefix="tunix-store-") as tmp, \
      staging.staged_dir(out_dir) as local:
    raw_path = os.path.join(tmp, "ids.raw")
    with open(raw_path, "wb") as raw:
      for ids, lens, lns, *n in _encoded(path, settings, workers, chunk_pairs, log):
        raw.write(ids.tobytes())
        max_id = max(max_id, int(ids.max(initial=0)))
        lengths.append(lens)
        lines.append(lns)
        counts += n
        if beat:  # the deadline bounds the wait for each chunk, not the file's length
          beat(f"tokenizing {path} ({len(lengths)} chunks of {chunk_pairs} records done)")
    lengths = np.concatenate(lengths or [np.zeros((0, 3), np.int64)])
    if not len(lengths):
      if counts[0]:
        raise DataError(f"{path}: all {counts[0]} pairs were dropped (empty responses)")
      raise DataError(f"{path}: no preference pairs" + (
          f" ({counts[1]} bad lines skipped)" if counts[1] else " (empty file)"))
    offsets = np.concatenate([[0], np.cumsum(lengths.reshape(-1))]).astype(np.int64)
    with open(raw_path, "rb") as raw:
      store_lib.write_flat(os.path.join(local, "ids.npy"), np.int32, int(offsets[-1]),
                           iter(lambda: raw.read(16 << 20), b""))
    np.save(os.path.join(local, "offsets.npy"), offsets)
    np.save(os.path.join(local, "lines.npy"), np.concatenate(lines))
  meta = store_lib.Meta(max_length=max_length, max_prompt_length=max_prompt_length,
                        pad_id=tok.pad_id, max_id=max_id,
                        num_dropped=int(counts[0]), num_skipped_lines=int(counts[1]),
                        num_prefix_mismatch=int(counts[2]), source=path)
  paths.write_text(paths.join(out_dir, "meta.json"), json.dumps(meta.__dict__))
  return store_lib.PairStore(out_dir)
