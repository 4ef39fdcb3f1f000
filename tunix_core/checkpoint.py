"""Asynchronous Orbax checkpoints of the sharded train state, with exact resume.

A checkpoint step directory holds two items:
- `state`: params and optimizer state as the sharded `jax.Array`s they are on the mesh
  (Orbax writes each shard from the device that owns it);
- `meta` (JSON): step, data-iterator state, PRNG key data, the full run config, the
  device count the optimizer state was sharded for, and a fingerprint of every array.

Orbax writes a step into a temporary directory and renames it when complete, so a
process killed mid-save leaves the previous steps intact; the leftover temporary
directory is removed on the next start. Restore takes explicit target shardings, so a
checkpoint written on N devices restores on any other count (the ZeRO optimizer state,
which is laid out per device, is re-cut for the new count).
"""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from tunix_core import collectives


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
  # One program for all arrays: several small programs with collectives in flight at
  # once can deadlock XLA's CPU runtime.
  values = jax.device_get(jax.jit(lambda xs: [_fingerprint(x) for x in xs])(
      [x for _, x in flat]))
  return {jax.tree_util.keystr(path): f"{int(v[0]):08x}{int(v[1]):08x}"
          for (path, _), v in zip(flat, values)}


class Checkpointer:
  """Saves and restores `{"params", "opt_state"}` plus JSON metadata under `directory`."""

  def __init__(self, directory: str, *, keep: int = 3, keep_period: int | None = None,
               async_save: bool = True):
    self.directory = directory
    try:
      os.makedirs(directory, exist_ok=True)
      probe = os.path.join(directory, f".write_probe_{os.getpid()}")
      with open(probe, "w") as f:
        f.write("ok")
      os.remove(probe)
    except OSError as e:
      raise CheckpointError(f"checkpoint directory {directory} is not writable: {e}") from None
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, keep_period=keep_period,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "meta"))

  def steps(self) -> list[int]:
    """Steps with a complete checkpoint, oldest first (temporary directories excluded)."""
    self.manager.reload()
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: dict, meta: dict) -> None:
    """Starts writing `state` at `step`; returns once the arrays are copied off device."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

  def wait(self) -> None:
    """Blocks until every started save has been committed."""
    self.manager.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]

  def restore(self, step: int, abstract_state: dict) -> dict:
    """The state at `step`, placed as `abstract_state` (ShapeDtypeStructs with shardings)."""
    return self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))["state"]

  def close(self) -> None:
    self.manager.close()


def find_restorable(ckpt: Checkpointer, required: bool) -> tuple[int | None, dict | None]:
  """The newest step whose metadata reads back, and that metadata.

  A step directory that cannot be read (corrupt or partial) is skipped with a warning
  in favour of the previous one; with `required` it is an error instead.
  """
  for step in reversed(ckpt.steps()):
    try:
      return step, ckpt.read_meta(step)
    except Exception as e:  # noqa: BLE001 - Orbax raises many kinds on a damaged step
      msg = f"checkpoint step {step} in {ckpt.directory} is unreadable ({type(e).__name__}: {e})"
      if required:
        raise CheckpointError(msg) from None
      logging.warning("%s; trying the previous one", msg)
  return None, None


def relayout_opt_state(opt_state, plan_old: collectives.BucketPlan,
                       plan_new: collectives.BucketPlan):
  """ZeRO optimizer state saved for `plan_old.num_shards` devices, re-cut for
  `plan_new.num_shards`.

  Per-device state leaves have a leading device axis. Subtrees shaped like the params
  (adam's `mu`, `nu`, ...) hold `[N, piece]` pieces of each param: they are joined into
  whole params and split again. Other leaves (step counts) are equal on every device
  and are re-broadcast.
  """
  def is_param_tree(x):
    return not isinstance(x, jax.Array) and jax.tree.structure(x) == plan_old.treedef

  def cut(subtree):
    if not is_param_tree(subtree):
      return jnp.broadcast_to(subtree[:1], (plan_new.num_shards,) + subtree.shape[1:])
    leaves = jax.tree.leaves(subtree)
    out = []
    for i, x in enumerate(leaves):
      size = int(np.prod(plan_old.shapes[i]))
      flat = x.reshape(-1)[:size]
      pad = plan_new.piece_size(i) * plan_new.num_shards - size
      out.append(jnp.pad(flat, (0, pad)).reshape(plan_new.num_shards, -1))
    return jax.tree.unflatten(plan_old.treedef, out)

  return jax.tree.map(cut, opt_state, is_leaf=is_param_tree)


def config_mismatch(saved: dict, current: dict, fields) -> str | None:
  """A message naming the first field in `fields` whose saved value differs, or None."""
  for field in fields:
    if field in saved and saved[field] != current.get(field):
      return (f"checkpoint was written with {field}={saved[field]!r} but this run has "
              f"{field}={current.get(field)!r}")
  return None
