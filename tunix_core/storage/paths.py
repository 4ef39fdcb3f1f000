"""Paths on local disk or object storage (`gs://bucket/path`), behind one small layer.

Everything the trainer reads or writes outside Orbax (metrics, logs, the reference
cache, the damaged-step quarantine, exports, HF directories, data) goes through here;
Orbax and TensorStore speak `gs://` themselves. A path is a plain `str`; a remote one has
a scheme and is reached through `etils.epath` (Orbax's own path library, over `gcsfs`).

Object storage has no directories (a prefix exists once an object is under it), no
append (an object is written whole) and no rename (a copy, then a delete). The functions
here give both kinds the same meaning: `makedirs` of a remote prefix does nothing,
`write_*` replace a file atomically (locally through a temporary file and a rename; an
object is replaced whole by one upload), and `move` copies every object before it
deletes any, so a failure part-way loses nothing (`storage.compose` appends to an
object).

Failures: a transient one (connection refused or reset, a timeout, HTTP 408, 429 or 5xx)
is retried with exponential backoff for at most `RETRY_SECONDS`; anything else, or a
failure that outlasts the retries, is one `StorageError` line naming the operation and
the path. `FileNotFoundError` passes through unchanged, for callers that expect it.
"""

import os
import re
import threading
import time

# The budget of this layer's retries of one operation on object storage, on top of the
# client's own (gcsfs tries each request 6 times, backing off for about 33 s).
RETRY_SECONDS = 10.0
_TRANSIENT = re.compile(r"\b(408|429|500|502|503|504)\b|timed? ?out|connection (refused|"
                        r"reset|aborted)|cannot connect|server disconnected", re.I)


class StorageError(OSError):
  """A read or write that failed; the message names the operation, the path and why."""


def is_remote(path: str) -> bool:
  return "://" in str(path)


def join(base: str, *parts: str) -> str:
  if is_remote(base):
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
  return os.path.join(base, *parts)


def _epath(path: str):
  from etils import epath  # pylint: disable=g-import-not-at-top
  return epath.Path(path)


def _reason(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _transient(e: BaseException) -> bool:
  if isinstance(e, (ConnectionError, TimeoutError)):
    return True
  return bool(_TRANSIENT.search(f"{type(e).__name__} {e}"))


# `("what path", start time)` of the call each thread runs now (what a watchdog names
# and bounds).
_IN_FLIGHT = {}


def in_flight() -> list[tuple[str, float]]:
  """The storage calls running now and for how many seconds each has, e.g.
  `("writing gs://bucket/run/metrics.jsonl", 2.5)`."""
  now = time.monotonic()
  return [(what, now - started) for what, started in list(_IN_FLIGHT.values())]


def _moved() -> None:
  """The current thread's storage call moved data just now: its clock (`in_flight`)
  restarts, so the watchdog's bound is on a stalled transfer, not on a long one."""
  key = threading.get_ident()
  if key in _IN_FLIGHT:
    _IN_FLIGHT[key] = (_IN_FLIGHT[key][0], time.monotonic())


def call(what: str, path: str, fn, writes: bool = False):
  """`fn()`, retried while it fails transiently (for `RETRY_SECONDS` at most) on a remote
  `path`; a failure is a `StorageError` "`what` `path` failed: reason" (a missing file
  stays a `FileNotFoundError` unless the call `writes`: then a missing bucket or
  directory is the failure)."""
  key = threading.get_ident()
  outer = _IN_FLIGHT.get(key)   # a call made inside another call's `fn`
  _IN_FLIGHT[key] = (f"{what} {path}", time.monotonic())
  try:
    return _call(what, path, fn, writes)
  finally:
    if outer is None:
      _IN_FLIGHT.pop(key, None)
    else:
      _IN_FLIGHT[key] = outer


def _call(what: str, path: str, fn, writes: bool):
  deadline, delay = time.monotonic() + RETRY_SECONDS, 0.5
  while True:
    try:
      return fn()
    except StorageError:
      raise
    except FileNotFoundError as e:
      if not writes:
        raise
      raise StorageError(f"{what} {path} failed: no such bucket or directory "
                         f"({_reason(e)})") from None
    except Exception as e:  # noqa: BLE001 - gcsfs, aiohttp and OS errors alike
      if is_remote(path) and _transient(e) and time.monotonic() + delay < deadline:
        time.sleep(delay)
        delay *= 2
        continue
      raise StorageError(f"{what} {path} failed: {_reason(e)}") from None


def exists(path: str) -> bool:
  return call("checking", path, lambda: _epath(path).exists())


def isdir(path: str) -> bool:
  """A local directory, or a remote prefix with an object under it."""
  return call("checking", path, lambda: _epath(path).is_dir())


def isfile(path: str) -> bool:
  return call("checking", path, lambda: _epath(path).is_file())


def listdir(path: str) -> list[str]:
  """Sorted names directly under `path` ([] when it does not exist)."""
  if not isdir(path):
    return []
  return sorted(call("listing", path, lambda: [p.name for p in _epath(path).iterdir()]))


def getsize(path: str) -> int:
  return call("reading the size of", path, lambda: _epath(path).stat().length)


def size_and_mtime(path: str) -> tuple[int, float]:
  """`(bytes, modification time in seconds)` of a file or object, in one stat."""
  stat = call("reading the size of", path, lambda: _epath(path).stat())
  return stat.length, float(stat.mtime)


def makedirs(path: str) -> None:
  """Creates a local directory and its parents; a remote prefix needs nothing."""
  if not is_remote(path):
    call("creating", path, lambda: os.makedirs(path, exist_ok=True), writes=True)


def read_bytes(path: str) -> bytes:
  return call("reading", path, lambda: _epath(path).read_bytes())


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8", errors="replace")


def write_bytes(path: str, data: bytes) -> None:
  """Replaces `path` with `data` atomically (readers see the old or the new file)."""
  if is_remote(path):
    call("writing", path, lambda: _epath(path).write_bytes(data), writes=True)
    return
  makedirs(os.path.dirname(path) or ".")
  tmp = f"{path}.{os.getpid()}.tmp"

  def write():
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)

  try:
    call("writing", path, write, writes=True)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


def open_read(path: str):
  """A binary file object of `path` that seeks (remote: ranged reads, nothing more)."""
  return call("opening", path, lambda: _epath(path).open("rb"))


def touch(path: str) -> None:
  """Marks a local file as used now (its mtime: the recency a cache's bound reads); a
  remote object keeps its write time, and a file gone meanwhile is no error."""
  if not is_remote(path):
    try:
      os.utime(path)
    except OSError:
      pass


def remove(path: str) -> None:
  """Deletes a file or object, or a whole directory or prefix."""
  p = _epath(path)
  call("deleting", path, lambda: p.rmtree() if p.is_dir() else p.unlink(missing_ok=True))


def _files(root: str) -> list[str]:
  """Paths relative to `root` of every file (object) under it; locally, links to
  directories are not followed (W&B's `latest-run`)."""
  if not is_remote(root):
    return sorted(os.path.relpath(os.path.join(top, name), root)
                  for top, _, names in os.walk(root) for name in names)
  bare = lambda p: str(p).split("://", 1)[-1].rstrip("/")  # gcsfs walks without gs://
  base, out = bare(_epath(root)), []
  for top, _, names in call("listing", root, lambda: list(_epath(root).walk())):
    rel = bare(top)[len(base):].strip("/")
    out += [f"{rel}/{name}" if rel else name for name in names]
  return sorted(out)


def copy_file(src: str, dst: str) -> None:
  """Streams one file between any two places (local or remote), 16 MiB at a time (each
  block restarts the call's clock: `in_flight`)."""
  if not is_remote(dst):
    makedirs(os.path.dirname(dst) or ".")

  def copy():
    with _epath(src).open("rb") as fin, _epath(dst).open("wb") as fout:
      while block := fin.read(16 << 20):
        fout.write(block)
        _moved()

  call("copying to", dst, copy, writes=True)


def copy_tree(src: str, dst: str) -> None:
  """Copies every file under `src` to the same place under `dst`."""
  for rel in _files(src):
    copy_file(join(src, rel), join(dst, rel))


def move(src: str, dst: str) -> None:
  """Moves the file or directory `src` to `dst`: a rename on local disk; on object
  storage every object is copied before `src` is deleted, so nothing is lost."""
  if not is_remote(src) and not is_remote(dst):
    makedirs(os.path.dirname(dst))
    call("moving to", dst, lambda: os.rename(src, dst), writes=True)
    return
  if isdir(src):
    copy_tree(src, dst)
  else:
    copy_file(src, dst)
  remove(src)
