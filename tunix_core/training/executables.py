"""The train step's executable, kept whole across restarts of a run on TPU.

JAX's persistent cache (`run.compile_cache`) keys an executable by its lowered program,
so a restart still traces and lowers the step before the cache can answer: 3-4 s of a
TPU host's start-up for SmolLM2-135M's step (docs/tpu.md#start-up). Beside JAX's
entries, in the same directory and under the same size bound, `compile_step` keeps the
step's serialized executable (`jax.experimental.serialize_executable`) under a key known
before any tracing, `step-{key}-cache`, made of:

- the step plan (`repr`: model shapes, dtypes, layout, kernels, remat, loss, compiler
  options) and the step's abstract inputs (shapes, dtypes, shardings);
- the mesh: its axes, and each device's id, kind, coordinates and process;
- the code: a digest of every source and data file of `tunix_core` and `tunix_kernels`
  (not code patched at run time: a test's poisoned objective would not change the key,
  which is one reason the store is used on TPU only; no store where the packages are
  not plain files to read);
- the toolchain: the Python, jax, jaxlib, optax, numpy and ml_dtypes versions, the
  backend's platform version (libtpu's build), `XLA_FLAGS` and every `LIBTPU_*`
  environment variable, and JAX's configuration but for `_NOT_IN_KEY` (where the cache
  lives, what is logged).

A restart deserializes the step onto its devices (2.1-2.3 s on one v5e chip) and never
traces it; the hit touches the entry (`paths.touch`: the recency the bound reads). A step the
compiler refuses for memory (`memory_refusal`: HBM or a kernel's VMEM, nothing else) is
remembered (`refused-{key}-cache`, named in its line): `training.fit` does not compile
that candidate again on a restart. Any other failure of a compile is raised as it is and
compiled again on the next start. Where the store is used (`store_dir`): the compilation
cache is on, the devices are TPUs and the job is one process (a multi-host executable is
not serialized here). An entry that does not load is one line, compiled again and
rewritten. Entries are pickles: the cache directory must be as trusted as the code
(JAX's `deserialize_and_load` says the same of what it loads).
"""

import functools
import hashlib
import importlib.metadata
import json
import os
import pickle
import platform
import re
import sys
import threading
import weakref

import jax
from jax.experimental import serialize_executable

import tunix_kernels
from tunix_core.storage import paths
from tunix_core.training import memory
from tunix_core.training import validation

_FILES = (".py", ".json")  # a package's sources and its tuned tables
# The compilers' own settings in the environment (a chip's topology is in the devices').
_ENV = ("XLA_FLAGS", "LIBTPU_")
_NOT_IN_KEY = {  # JAX settings that change no program: where the cache is, what is logged
    "jax_compilation_cache_dir", "jax_enable_compilation_cache",
    "jax_compilation_cache_max_size", "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes", "jax_raise_persistent_cache_errors",
    "jax_log_compiles", "jax_explain_cache_misses", "jax_logging_level",
    "jax_debug_log_modules", "jax_log_checkpoint_residuals"}


def store_dir(devices) -> str | None:
  """Where step executables are kept for `devices` (module docstring), else None."""
  if (devices[0].platform != "tpu" or jax.process_count() != 1
      or not jax.config.jax_enable_compilation_cache or _code_digest() is None):
    return None
  return jax.config.jax_compilation_cache_dir or None


@functools.cache
def _code_digest() -> str | None:
  """sha256 of every source and data file of `tunix_core` and `tunix_kernels`; None when
  this module's own file was not among them (packages in an archive)."""
  h, read = hashlib.sha256(), set()
  for package in (os.path.dirname(os.path.dirname(__file__)),
                  os.path.dirname(tunix_kernels.__file__)):
    for root, dirs, files in os.walk(package):
      dirs.sort()
      for name in sorted(f for f in files if f.endswith(_FILES)):
        path = os.path.join(root, name)
        h.update(os.path.relpath(path, package).encode())
        with open(path, "rb") as f:
          h.update(hashlib.sha256(f.read()).digest())
        read.add(os.path.realpath(path))
  return h.hexdigest() if os.path.realpath(__file__) in read else None


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "none"


def step_key(steps) -> str:
  """The store's key of `steps.train_step` (`training.step.StepFunctions`)."""
  mesh = steps.mesh
  devices = [(d.id, d.device_kind, getattr(d, "coords", None), d.process_index)
             for d in mesh.devices.flat]
  config = {k: v for k, v in jax.config.values.items() if k not in _NOT_IN_KEY}
  parts = (repr(steps.plan), repr(jax.tree.map(repr, steps.abstract_inputs())),
           repr(dict(mesh.shape)), repr(devices), _code_digest(), sys.version,
           platform.machine(),
           [_version(p) for p in ("jax", "jaxlib", "optax", "numpy", "ml_dtypes")],
           getattr(mesh.devices.flat[0].client, "platform_version", ""),
           sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV)),
           repr(sorted(config.items())))
  return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


class Refused(validation.ConfigError):
  """The compiler refused the step for memory (now or, kept in the store, before):
  `kind` "hbm" (the step's buffers; `needed`: the bytes per device the compiler
  counted, where it said) or "vmem" (a Pallas kernel's tiles)."""

  def __init__(self, message: str, kind: str = "hbm", needed: int | None = None):
    super().__init__(message)
    self.kind, self.needed = kind, needed


# What the TPU compiler says when it refuses a program for memory, and nothing else: a
# host's RESOURCE_EXHAUSTED while compiling, or a compiler bug, is not a verdict on the
# program and is not remembered.
_HBM = re.compile(r"Ran out of memory (?:on|in memory space) hbm", re.IGNORECASE)
_VMEM = re.compile(r"CompileTimeScopedVmemOom|exceeded scoped vmem limit", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
KERNELS = ("attention_fwd", "attention_bwd", "attention_dq", "attention_dkv",
           "fused_logprobs_fwd", "fused_logprobs_bwd", "fused_logprobs_dhidden",
           "fused_logprobs_dweight", "dpo_loss_fwd", "dpo_loss_bwd")


def _bytes(number: str, unit: str) -> int:
  return int(float(number) * _UNITS[unit.upper()[:1]])


def memory_refusal(e: BaseException, held: int = 0) -> Refused | None:
  """`e`, an error of XLA's compile, as a `Refused` when the compiler refused the
  program for memory: HBM (naming the bytes against the capacity; `held`: what the
  step's arguments hold beside the temporaries the compiler counts) or a Pallas kernel's
  VMEM (naming the kernel and its scoped allocation); None for any other failure. The
  one place this is decided (`compile_step`, `aot.compile`)."""
  text = str(e)
  if _VMEM.search(text):
    kernel = next((k for k in KERNELS if k in text), "a Pallas kernel")
    size = re.search(r"[Ss]coped allocation with size ([\d.]+)([KMG]?)\S* and limit "
                     r"([\d.]+)([KMG]?)", text)
    what = (f"{_bytes(*size.groups()[:2]) / 2**20:.1f} MiB of scoped VMEM against a limit "
            f"of {_bytes(*size.groups()[2:]) / 2**20:.1f} MiB" if size else _first_line(e))
    return Refused(f"the kernel {kernel} does not fit VMEM: its tiles need {what}; its "
                   "tile choice should never allow this (please report it); "
                   "--attention_impl=xla or --logprob_impl=xla avoid the kernel", "vmem")
  if not _HBM.search(text):
    return None
  temps = re.search(r"HLO temporaries \(([\d.]+)([KMGT]?)\)\D+([\d.]+)([KMGT]?)", text)
  used = re.search(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm", text)
  if temps:
    needed, limit = held + _bytes(*temps.groups()[:2]), _bytes(*temps.groups()[2:])
  elif used:
    needed, limit = _bytes(*used.groups()[:2]), _bytes(*used.groups()[2:])
  else:
    needed = limit = None
  figure = (f"{needed / 2**30:.3g} GiB per device against {limit / 2**30:.3g} GiB of HBM "
            if needed else "")
  return Refused(f"the train step does not fit HBM: {figure}(the compiler: "
                 f"{_first_line(e)}); more --grad_accum_steps, --remat=full, --fsdp or a "
                 "smaller --batch_size may", "hbm", needed)


def _first_line(e: BaseException) -> str:
  return (str(e).splitlines() or [type(e).__name__])[0][:300]


class TrainStep:
  """`steps.train_step(state, frozen, batch)` through `compiled` (its first call traces
  nothing); inputs it was not compiled for (a sharding or dtype other than the step's
  abstract inputs') go to the jitted step, which compiles for them as before."""

  def __init__(self, steps, compiled, log=print):
    self._jitted, self._compiled, self._log = steps.train_step, compiled, log

  def __call__(self, state, frozen, batch):
    if self._compiled is not None:
      try:
        return self._compiled(state, frozen, batch)
      except (TypeError, ValueError) as e:  # JAX's checks of the arguments, before any run
        self._compiled = None
        self._log(f"train step: its inputs differ from its abstract inputs' "
                  f"({_first_line(e)}); the jitted step compiles for them")
    return self._jitted(state, frozen, batch)


def compile_step(steps, where: str | None, log=print):
  """`steps.train_step` compiled for its abstract inputs (`jax.stages.Compiled`), loaded
  from the store at `where` when it holds it (`store_dir`; None: no store), else
  compiled (through JAX's cache) and kept there. Raises `Refused` when the compiler
  refuses it for memory. Once per `steps`: `--remat=auto`'s measure and the run's first
  step get the same executable."""
  with _lock:  # one compile per `steps`, whichever thread asks first
    if steps not in _compiled:
      _compiled[steps] = _compile_step(steps, where, log)
    return _compiled[steps]


_compiled = weakref.WeakKeyDictionary()  # StepFunctions -> its train step's executable
_lock = threading.Lock()


def _compile(steps, lowered):
  """`lowered.compile()`, XLA's refusal for memory raised as `Refused` (with what
  `steps`' arguments hold beside the temporaries it counts)."""
  try:
    return lowered.compile()
  except Exception as e:  # noqa: BLE001 - only a refusal is translated
    raise memory_refusal(e, memory.shard_bytes(steps.abstract_inputs())) or e


def _compile_step(steps, where, log):
  lower = lambda: steps.train_step.lower(*steps.abstract_inputs())
  if where is None:
    return _compile(steps, lower())
  key = step_key(steps)
  entry, refused = (paths.join(where, f"{kind}-{key}-cache") for kind in ("step", "refused"))
  if paths.exists(entry):
    try:
      payload, in_tree, out_tree = pickle.loads(paths.read_bytes(entry))
      compiled = serialize_executable.deserialize_and_load(
          payload, in_tree, out_tree, execution_devices=list(steps.mesh.devices.flat))
      jax.monitoring.record_event(STORE_HIT)
      paths.touch(entry)
      return compiled
    except Exception as e:  # noqa: BLE001 - any damage is a miss
      log(f"compilation cache: step executable {key[:16]}... does not load "
          f"({type(e).__name__}: {_first_line(e)}); compiling again")
  elif paths.exists(refused):
    kept = _verdict(paths.read_text(refused))
    if kept is not None:  # else not a verdict this version wrote: compiled again
      raise Refused(f"{kept['message']} (remembered in {refused}: delete it to compile "
                    "again)", kept["kind"], kept["needed"])
  try:
    compiled = _compile(steps, lower())
  except Refused as refusal:
    _write(refused, json.dumps(dict(message=str(refusal), kind=refusal.kind,
                                    needed=refusal.needed)).encode(), log)
    raise
  try:
    payload = pickle.dumps(serialize_executable.serialize(compiled))
  except Exception as e:  # noqa: BLE001 - not every executable serializes
    log(f"compilation cache: the step's executable is not kept ({type(e).__name__})")
    return compiled
  _write(entry, payload, log)
  return compiled


def _verdict(text: str) -> dict | None:
  """A remembered refusal (`{"message", "kind", "needed"}`), or None if `text` is not one."""
  try:
    kept = json.loads(text)
    return kept if {"message", "kind", "needed"} <= set(kept) else None
  except (ValueError, TypeError):
    return None


STORE_HIT = "/tunix/compilation_cache/step_executable_hits"  # a `jax.monitoring` event


def _write(path: str, data: bytes, log) -> None:
  try:
    paths.write_bytes(path, data)
  except OSError as e:  # paths.StorageError included: a cache never ends the run
    log(f"compilation cache: {path} not written ({type(e).__name__})")
