"""Gives every test 8 simulated CPU devices; must run before JAX initialises a backend."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session, inherited by the trainer
# subprocesses: the tests compile the same small steps again and again (every resume,
# every restore on another layout), and a hit skips XLA's compile. Keyed on the HLO and
# the compile options, so a hit is the very executable a compile would have built.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="tunix-tests-jax-cache-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache,
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

# JAX's own "try not to do much optimization work" (XLA's CPU backend at -O0): the tests'
# programs are tiny, so compiling them costs more than running them (the fast tier: 2:08
# against 2:38). Only the CPU machine code changes: floats can move in the last bits, as
# between two host CPUs (which the pinned golden values allow). The TPU compiler ignores
# it: the ahead-of-time statistics the tests check are byte for byte the same. Trainer
# subprocesses inherit it; a value already in the environment wins.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import chex  # noqa: E402  (after JAX_PLATFORMS, before any backend starts)

chex.set_n_cpu_devices(8)

# The repository itself is not put on sys.path: the tests import the installed packages
# (`pip install -e '.[test]'`), `tunix_kernels` among them, so that a folder named
# `kernels` never shadows Hugging Face's package of that name beside transformers.


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gcs():
  """One in-memory Cloud Storage server on loopback for the session (`tests/gcs.py`),
  with this process's clients pointed at it; skips without the emulator."""
  import gcs as gcs_lib  # pylint: disable=g-import-not-at-top
  server = gcs_lib.Server()
  saved = {k: os.environ.get(k) for k in gcs_lib.env(server.url)}
  os.environ.update(gcs_lib.env(server.url))
  yield server
  server.stop()
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
