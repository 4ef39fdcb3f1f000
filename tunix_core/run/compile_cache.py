"""The run's persistent compilation cache: a restart loads the step instead of compiling it.

JAX's own cache (`jax_compilation_cache_dir`) does the work; this module points it at a
directory every restart of the run finds, checks that it can be written, bounds its size
and reports what the first step got from it.

- Where: `--compilation_cache_dir`; `auto` is `$JAX_COMPILATION_CACHE_DIR` when set, else
  `{output_dir}/compilation_cache`, so a resumed run (on this host or, with a `gs://`
  output directory, on any new host of a pod) finds what its first start compiled.
- What a key covers (JAX's `cache_key.get`): the optimised-for HLO module (so the plan's
  shapes, shardings, dtypes and kernels), the compile options (the device assignment and
  so the topology's size and layout, the TPU compiler flags), the backend's platform
  and platform version (libtpu's build), the jax/jaxlib version and the accelerator's
  kind. Another topology, jax or libtpu, or plan never loads a wrong executable.
- Bound: at start-up the primary process drops the least recently used entries past
  `MAX_BYTES`, 20 GB (recency is a hit's touch on local disk; on object storage the
  write time). JAX's own eviction is left off: it locks the directory on every read and
  works only on local disk.
- Failure is never fatal: an unwritable directory is one line and the run goes on
  uncached; an entry that does not decompress (a write cut short by a kill) is one line,
  compiled again and removed by process 0 (JAX alone would warn on every start and never
  rewrite it). A multi-host run writes from process 0 only (JAX's rule): its other hosts
  gain from the cache when it is shared (`gs://`).
"""

import collections
import os
import threading
import time

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from tunix_core.storage import paths
from tunix_core.training import executables

AUTO = "auto"
MAX_BYTES = 20 * 10**9  # the bound `enable` keeps the cache under at start-up
_ENTRY = "-cache"  # JAX's file name suffix of an entry: {key}-cache
_EVENTS = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses",
           "/jax/compilation_cache/compile_requests_use_cache",
           "/jax/core/compile/backend_compile_duration",  # a compile or a cache load
           executables.STORE_HIT)  # the step's serialized executable, loaded whole
# Per thread: the step compiles beside the start-up's own compiles (`Warmup`).
_counts = collections.defaultdict(lambda: dict.fromkeys(_EVENTS, 0))
_said = {"log": print}  # where a damaged entry is reported: the latest `enable`'s `log`


def _count(event: str, **_) -> None:
  if event in _EVENTS:  # recorded by the thread that compiles
    _counts[threading.get_ident()][event] += 1


jax.monitoring.register_event_listener(_count)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _seconds, **kw: _count(event, **kw))


def resolve_dir(setting: str, output_dir: str) -> str:
  """The cache directory of `--compilation_cache_dir=setting` ('' : off)."""
  if setting == AUTO:
    return (os.environ.get("JAX_COMPILATION_CACHE_DIR")
            or paths.join(output_dir, "compilation_cache"))
  return setting


def enable(setting: str, output_dir: str, log, *, max_bytes: int = MAX_BYTES,
           primary: bool = True) -> str | None:
  """Points JAX's persistent cache at the run's directory before anything compiles;
  returns it, or None when the cache is off or unusable (one line says why)."""
  path = resolve_dir(setting, output_dir)
  _said["log"] = log
  if not path:
    _disable()
    log("compilation cache: off (--compilation_cache_dir='')")
    return None
  try:
    paths.makedirs(path)
    probe = paths.join(path, f".probe-{os.getpid()}")
    paths.write_bytes(probe, b"")
    paths.remove(probe)
  except OSError as e:  # paths.StorageError included
    _disable()
    log(f"compilation cache: {path} is not writable ({_first_line(e)}); running uncached")
    return None
  if primary and max_bytes > 0:
    try:
      _prune(path, max_bytes)
    except OSError as e:
      log(f"compilation cache: old entries of {path} not dropped ({_first_line(e)})")
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_compilation_cache_max_size", -1)  # bounded by `_prune`
  # Every executable: a run's dozen small ones (init, checks, eval) cost seconds too.
  # A threshold set in the environment is the user's and stays.
  for name in ("min_compile_time_secs", "min_entry_size_bytes"):
    if f"JAX_PERSISTENT_CACHE_{name.upper()}" not in os.environ:
      jax.config.update(f"jax_persistent_cache_{name}", 0)
  _guard_entries()
  jax_cache.reset_cache()  # a cache opened earlier in this process opens here again
  return path


def _disable() -> None:
  """No persistent cache from here on, also where one was opened earlier in this process
  (JAX keeps an opened cache until it is reset)."""
  jax.config.update("jax_enable_compilation_cache", False)
  jax_cache.reset_cache()


def _first_line(e: BaseException) -> str:
  return (str(e).splitlines() or [type(e).__name__])[0][:200]


def _prune(path: str, max_bytes: int) -> None:
  """Drops the least recently used entries until the cache holds at most `max_bytes`."""
  entries = []
  for name in paths.listdir(path):
    if name.endswith(_ENTRY):
      entry = paths.join(path, name)
      try:
        size, mtime = paths.size_and_mtime(entry)
      except OSError:
        continue  # removed by another process since the listing
      entries.append((mtime, size, entry))
  total = sum(size for _, size, _ in entries)
  for _, size, entry in sorted(entries):
    if total <= max_bytes:
      break
    paths.remove(entry)
    total -= size


def _guard_entries() -> None:
  """Wraps the cache JAX opens so that a damaged entry is removed, and a hit touches
  its file (the recency `_prune` reads)."""
  from jax._src import compilation_cache as jax_impl  # pylint: disable=g-import-not-at-top
  make = getattr(jax_impl, "get_file_cache", None)
  decompress = getattr(jax_impl, "decompress_executable", None)
  if make is None or decompress is None or getattr(make, "_tunix_guarded", False):
    return  # another jax: its own read errors stay warnings

  def get_file_cache(path):
    made = make(path)
    return made if made is None else (_CheckedCache(made[0], path, decompress), made[1])

  get_file_cache._tunix_guarded = True  # pylint: disable=protected-access
  jax_impl.get_file_cache = get_file_cache


class _CheckedCache:
  """JAX's file cache with a checked `get` (everything else is the file cache's own): an
  entry read back must decompress, or it is reported once and missed, and process 0 (the
  one JAX writes from, so never a reader of its own half-written entry) removes it so
  that it is written again."""

  def __init__(self, base, path: str, decompress):
    self._base, self._dir, self._decompress = base, path, decompress

  def __getattr__(self, name):
    return getattr(self._base, name)

  def get(self, key: str) -> bytes | None:
    value = self._base.get(key)
    if value is None:
      return None
    entry = paths.join(self._dir, key + _ENTRY)
    try:
      self._decompress(value)
    except Exception as e:  # noqa: BLE001 - any damage is a miss
      removed = jax.process_index() == 0
      _said["log"](f"compilation cache: entry {key[:40]}... is damaged ({type(e).__name__}: "
                   f"{_first_line(e)}); {'removed, ' if removed else ''}compiling again")
      if removed:
        try:
          paths.remove(entry)
        except OSError:
          pass
      return None
    paths.touch(entry)
    return value


def _mine() -> dict:
  return _counts[threading.get_ident()]


class FirstCompile:
  """Times a block that compiles (the first dispatch of the step) and says whether its
  executable came from the cache."""

  def __enter__(self):
    self._before, self._start = dict(_mine()), time.perf_counter()
    return self

  def __exit__(self, *exc):
    self.seconds = time.perf_counter() - self._start
    delta = {event: _mine()[event] - self._before[event] for event in _EVENTS}
    self.hits, self.writes, self.lookups, self.compiles, self.loaded = (
        delta[e] for e in _EVENTS)
    return False

  def describe(self, what: str) -> str:
    where = jax.config.jax_compilation_cache_dir
    if self.loaded and not self.compiles:
      return (f"{what}: loaded from the compilation cache in {self.seconds:.1f} s "
              f"({where}; its whole executable, not traced)")
    if not self.compiles:
      return f"{what}: already compiled in this process ({self.seconds:.1f} s)"
    if not (self.lookups and where and jax.config.jax_enable_compilation_cache):
      return f"{what}: compiled in {self.seconds:.1f} s (no compilation cache)"
    if self.hits and self.hits == self.lookups:
      return (f"{what}: loaded from the compilation cache in {self.seconds:.1f} s "
              f"({where})")
    stored = "; stored for the next start" if self.writes else ""
    return (f"{what}: compiled in {self.seconds:.1f} s (not in the compilation cache at "
            f"{where}{stored})")


class Warmup:
  """Compiles on a thread, beside the rest of the start-up (initialisation, restore, the
  reference pass), so that the first call finds the executable in memory: `choose()`
  first (`--remat=auto`'s choice, which compiles its candidates; by default nothing),
  then `compile_(what it chose)`, kept as `compiled`. `choice` waits for the first,
  `describe` for both. A start-up that fails first leaves the thread to finish (a
  daemon: the trainer's exit does not wait for it)."""

  def __init__(self, compile_, choose=lambda: None):
    self._error = self._chosen = self.compiled = None
    self._chose = threading.Event()

    def run():
      try:
        with FirstCompile() as self._timed:
          try:
            self._chosen = choose()
          finally:
            self._chose.set()
          self.compiled = compile_(self._chosen)
      except BaseException as e:  # noqa: BLE001 - raised again by `choice` or `describe`
        self._error = e

    self._thread = threading.Thread(target=run, name="compile-step", daemon=True)
    self._thread.start()

  def choice(self):
    """Waits for `choose`; what it returned (or its error, raised again here)."""
    self._chose.wait()
    if self._chosen is None and self._error is not None:
      self._thread.join()
      raise self._error
    return self._chosen

  def describe(self, what: str) -> str:
    """Waits for the compile; its line (or its error, raised again here)."""
    start = time.perf_counter()
    self._thread.join()
    if self._error is not None:
      raise self._error
    return (f"{self._timed.describe(what)}, beside the start-up (which then waited "
            f"{time.perf_counter() - start:.1f} s for it)")
