"""Asynchronous Orbax checkpoints of the sharded train state, with exact resume.

A checkpoint step directory holds two items:
- `state`: params and optimizer state as the sharded `jax.Array`s they are on the mesh
  (Orbax writes each shard from the device that owns it);
- `meta` (JSON): step, data-iterator state, PRNG key data, the full run config, the
  device count the optimizer state was sharded for, and a fingerprint of every array.

Orbax writes a step into a temporary directory and renames it when complete (on object
storage, where nothing renames, it writes a commit marker last), so a process killed
mid-save leaves the previous steps intact; the leftover temporary directory is removed
on the next start. The directory may be local or `gs://` (Orbax's own support; the
probe and the quarantine go through `tunix_core.storage.paths`). Restore takes explicit
target shardings, so a checkpoint written on N devices restores on any other count (the
ZeRO optimizer state, which is laid out per device, is re-cut for the new count by
`tunix_core.parallel.zero`).

`save_state` is what the training loop calls to save: the state plus the metadata a
step carries. Finding, checking and restoring the step to resume from is
`tunix_core.checkpoints.resume`.
"""

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import time
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from jax.experimental import multihost_utils

from tunix_core.storage import paths
from tunix_core.training import offload


# TensorStore retries a failing GCS request up to 32 times, its delay growing to 32 s
# (about 15 minutes) before Orbax sees the error. A checkpoint on object storage gets a
# bound like the run's other storage calls: 5 retries, 1 s doubling to 8 s (23 s).
GCS_RETRIES = {"max_retries": 5, "initial_delay": "1s", "max_delay": "8s"}


def _bound_gcs_retries() -> None:
  """Puts `GCS_RETRIES` into the TensorStore contexts Orbax creates (its defaults are
  module dicts it copies per context); an Orbax without them keeps TensorStore's."""
  try:
    from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
    for context in (tensorstore_utils._BASE_TS_CONTEXT,  # pylint: disable=protected-access
                    tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):  # pylint: disable=protected-access
      context["gcs_request_retries"] = dict(GCS_RETRIES)
  except (ImportError, AttributeError):
    pass


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used; the message says which and why."""


def _mix(x):
  """A 32-bit avalanche mix (murmur3's finalizer), so equal inputs do not cancel."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _fingerprint(x):
  if x.dtype.itemsize != 4:
    x = x.astype(jnp.float32)  # exact for bf16 / f16 / small ints
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  position = _mix(jnp.arange(1, bits.size + 1, dtype=jnp.uint32))
  return jnp.stack([jnp.sum(_mix(bits), dtype=jnp.uint32),
                    jnp.sum(_mix(bits ^ position), dtype=jnp.uint32)])


def fingerprints(tree) -> dict:
  """`{path: 16 hex digits}` of every array, computed on device.

  Two wrapping 32-bit sums of mixed bit patterns (one also mixed with each element's
  position): exact to the bit and independent of how the array is sharded.
  """
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  # One program for the arrays on the devices: several small programs with collectives
  # in flight at once can deadlock XLA's CPU runtime.
  there = [i for i, (_, x) in enumerate(flat) if not offload.on_host(x)]
  values = dict(zip(there, jax.device_get(jax.jit(lambda xs: [_fingerprint(x) for x in xs])(
      [flat[i][1] for i in there]))))
  # Arrays in host memory (--offload_optimizer), one at a time on the devices, each
  # finished before the next: together they may not fit there.
  for i, (_, x) in enumerate(flat):
    if offload.on_host(x):
      device = x.sharding.with_memory_kind("device")
      values[i] = jax.device_get(jax.jit(lambda y: _fingerprint(jax.device_put(y, device)))(x))
  return {jax.tree_util.keystr(path): f"{int(values[i][0]):08x}{int(values[i][1]):08x}"
          for i, (path, _) in enumerate(flat)}


class CheckpointWriteError(CheckpointError):
  """Writing a checkpoint failed (no space, permission, file too large); the message names
  the step, the directory, the OS error and the newest complete checkpoint."""


def _os_error(e: BaseException) -> str:
  """The OS-level cause of a failed write, as `strerror` text where one can be found."""
  seen = e
  while seen is not None:
    if isinstance(seen, OSError) and seen.strerror:
      return seen.strerror
    seen = seen.__cause__ or seen.__context__
  text = str(e)
  code = re.search(r"os_error_code='?(\d+)", text)  # TensorStore's form
  if code:
    return os.strerror(int(code.group(1)))
  return text.splitlines()[0][:300] if text else type(e).__name__


@contextlib.contextmanager
def _quiet_absl(quiet: bool):
  """absl logging above warnings while in the block, if `quiet`."""
  before = absl_logging.get_verbosity()
  if quiet:
    absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    yield
  finally:
    absl_logging.set_verbosity(before)


class Checkpointer:
  """Saves and restores `{"params", "opt_state"}` plus JSON metadata under `directory`.

  A failure while writing (now or in the background) surfaces from the next `save`,
  `wait` or `close` as one `CheckpointWriteError`; the step being written stays in its
  temporary directory for Orbax to clean up, never half-committed.
  """

  def __init__(self, directory: str, *, keep: int = 3, keep_period: int | None = None,
               async_save: bool = True, read_only: bool = False):
    """`read_only`: another run's checkpoints (`--init_from`), which this process only
    reads: nothing is created, cleaned up or deleted there (that run may still be
    writing)."""
    self.directory = directory
    self._writing = None  # the step whose save was started and not yet committed
    self._committed = None  # the newest step this process saw complete (named in errors)
    if paths.is_remote(directory):
      _bound_gcs_retries()
    try:
      if not read_only:
        paths.makedirs(directory)
        probe = paths.join(directory, f".write_probe_{uuid.uuid4().hex}")
        paths.write_text(probe, "ok")
        paths.remove(probe)
    except OSError as e:
      raise CheckpointError(f"checkpoint directory {directory} is not writable: {e}") from None
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else keep, keep_period=keep_period,
        save_interval_steps=0 if read_only else 1, read_only=read_only,
        create=not read_only, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only)
    with _quiet_absl(read_only):  # Orbax warns that a read-only directory is read-only
      self.manager = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "meta"))

  def steps(self) -> list[int]:
    """Steps with a complete checkpoint, oldest first (temporary directories excluded)."""
    self.manager.reload()
    steps = sorted(self.manager.all_steps())
    if steps:
      self._committed = max(steps[-1], self._committed or 0)
    return steps

  def _write_failed(self, step, e: BaseException) -> CheckpointWriteError:
    # The newest committed step as this process last saw it, not a fresh listing: the
    # storage that failed the write would fail (and retry) the listing too, delaying
    # the error line by the client's whole retry budget.
    newest = f"step {self._committed}" if self._committed is not None else "none"
    return CheckpointWriteError(
        f"writing checkpoint step {step} to {self.directory} failed: {_os_error(e)}; "
        f"newest complete checkpoint: {newest}")

  def save(self, step: int, state: dict, meta: dict) -> None:
    """Starts writing `state` at `step`; returns once the arrays are copied off device."""
    try:
      self.wait()  # a failure of the previous save is reported as that step's
      self._writing = step
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    except CheckpointWriteError:
      raise
    except Exception as e:  # noqa: BLE001 - Orbax and TensorStore raise many kinds
      raise self._write_failed(step, e) from None

  def wait(self) -> None:
    """Blocks until every started save has been committed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._write_failed(self._writing, e) from None
    if self._writing is not None:
      self._committed = max(self._writing, self._committed or 0)
    self._writing = None

  def read_meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state: dict) -> dict:
    """The state at `step`, placed as `abstract_state` (ShapeDtypeStructs with shardings)."""
    return self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))["state"]

  def restore_params(self, step: int, abstract_params: dict) -> dict:
    """The params alone of the state at `step` (its optimizer state is not read)."""
    item = {"params": abstract_params}
    args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype,
                                                       global_shape=a.shape), item)
    return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item, restore_args=args, partial_restore=True)))["state"]["params"]

  def reject(self, step: int) -> str:
    """Moves step `step` aside to `{directory}.rejected/<step>-<time>` (never deletes it),
    so that the step can be written again; returns the new path."""
    target = paths.join(f"{self.directory.rstrip('/')}.rejected",
                        f"{step}-{time.strftime('%Y%m%dT%H%M%S')}")
    if jax.process_index() == 0:  # on object storage a copy, then a delete
      paths.move(paths.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"checkpoint_reject_{step}")
    self.manager.reload()
    return target

  def close(self, quiet: bool = False) -> None:
    """Waits for pending saves and closes; a failed save raises `CheckpointWriteError`
    unless `quiet` (when another error is already being raised)."""
    try:
      self.wait()
    except CheckpointWriteError:
      if not quiet:
        raise
    finally:
      # The manager removes leftover temporary directories in the background from its
      # start; let that finish first, or it can remove the step a later writer (a run
      # resuming here) is saving. Orbax (0.12) has no public wait for it: the private
      # method is called directly, so a rename fails here and in tests/test_storage.py
      # instead of silently not waiting.
      self.manager._maybe_await_cleanup_tmp_directory()  # pylint: disable=protected-access
      try:
        self.manager.close()
      except Exception:  # noqa: BLE001 - a failed save was already reported by wait
        pass


def save_state(ckpt: Checkpointer, step: int, state: dict, *, data_state: dict,
               num_shards: int, rng_key: jax.Array, config, model_config,
               nonfinite: list[int], source: dict | None = None,
               layout: str = "zero1", model_parallel: int = 1) -> str:
  """Starts an asynchronous save of `state` (logical params, optimizer state cut by
  `layout`, "zero1", "single" or "fsdp", for `num_shards` data shards of `model_parallel`-way
  slices) at `step` with its metadata
  (`nonfinite`: the state's `[count, first step, bits]`, read by the caller; `source`:
  where the initial policy came from, `run.source.source`); returns a short digest of
  the state's fingerprints for the log."""
  to_save = {"params": state["params"], "opt_state": state["opt_state"]}
  prints = fingerprints(to_save)
  ckpt.save(step, to_save, {
      "step": step, "data_state": data_state, "num_shards": num_shards, "layout": layout,
      "model_parallel": model_parallel,
      "rng_key": np.asarray(jax.random.key_data(rng_key)).tolist(),
      "config": dataclasses.asdict(config), "model_config": dataclasses.asdict(model_config),
      "fingerprints": prints, "source": source or {},
      "nonfinite": [int(x) for x in nonfinite]})
  return hashlib.sha256(json.dumps(prints, sort_keys=True).encode()).hexdigest()[:16]
