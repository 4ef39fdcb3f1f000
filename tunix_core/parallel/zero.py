"""ZeRO-1: a sharded optimizer over the hand-written collectives, and its state layout.

Each device keeps optimizer state for its own 1/N of every parameter only. A step
reduce-scatters the local gradients (so each device holds the mean gradient of its
piece), clips by the global norm of the whole model, applies the optax transformation
to its piece and all-gathers the updated params.

Outside `shard_map` the optimizer state is a pytree of `[N, piece]` arrays sharded over
the data axis (row `i` is device `i`'s state); on one data shard without TP,
`SingleShardOptimizer` keeps it whole, `[1, *leaf shape]` (`SingleLayout`).
`abstract_opt_state` gives its shapes for any layout, `Zero1Layout` converts it to
logical arrays and back, and
`relayout_opt_state` re-cuts a saved state for another count or for FSDP.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tunix_core.parallel import collectives


class UpdateResult(NamedTuple):
  """What `ShardedOptimizer.update` returns (inside `shard_map`, per device)."""

  params: dict          # the synced new params, full and equal on every device (FSDP:
                        # this device's new pieces)
  state: optax.OptState  # this device's new optimizer state (of its pieces)
  grad_norm: jax.Array  # float32 scalar: global norm of the mean gradient, before clipping


class ShardedOptimizer:
  """Runs an elementwise optax transformation on 1/N of the params per device.

  `tx` sees a pytree with the params' structure whose leaves are this device's 1-D
  pieces, so per-leaf masks (e.g. no weight decay on norm scales) select the right
  elements. Transformations that mix elements across a leaf (per-leaf norms, global
  norm clipping) would only see the piece; global clipping is `max_grad_norm` instead.

  The result equals replicated `optax.chain(optax.clip_by_global_norm(max_grad_norm),
  tx)` applied to the mean gradient over the axis. With `slice_axis` (several TPU
  slices, `parallel.mesh`) `axis_name` is one slice's data axis, the state is split
  within the slice and replicated across slices, and the reduce-scattered gradient
  pieces are averaged across slices once per step: an all-reduce of 1/N of the model over
  the data-centre network, the only collective that crosses it.
  """

  def __init__(self, tx: optax.GradientTransformation, plan: collectives.BucketPlan,
               axis_name, *, max_grad_norm: float | None = None, impl: str = "xla",
               comm_dtype=None, model_axis: str | None = None, split=None,
               slice_axis: str | None = None):
    if max_grad_norm is not None and not max_grad_norm > 0:
      raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
    self.tx, self.plan, self.axis_name = tx, plan, axis_name
    self.max_grad_norm, self.impl, self.comm_dtype = max_grad_norm, impl, comm_dtype
    self.model_axis, self.split, self.slice_axis = model_axis, split, slice_axis

  def _local(self, params):
    return self.plan.local_pieces(params, jax.lax.axis_index(self.axis_name))

  def init(self, params):
    """Optax state of this device's pieces of `params` (replicated, full-size in)."""
    return self.tx.init(self._local(params))

  def sync_grads(self, grads):
    """Mean gradient pieces of this device, as a tree of 1-D pieces, and the global
    gradient norm (before clipping)."""
    shards = collectives.reduce_scatter(grads, self.plan, self.axis_name, impl=self.impl,
                                        mean=True, comm_dtype=self.comm_dtype)
    pieces = self.plan.shards_to_tree(self.across_slices(shards))
    return pieces, self.global_norm(pieces)

  def across_slices(self, pieces):
    """This slice's mean gradient pieces -> the mean over every slice (identity on one
    slice): each device all-reduces only its own 1/N with its peers of the other
    slices."""
    if self.slice_axis is None:
      return pieces
    return jax.tree.map(lambda g: jax.lax.pmean(g, self.slice_axis), pieces)

  def global_norm(self, pieces):
    """The norm of the whole gradient from each device's pieces (their padding is zero,
    so the pieces' squared norms add up to the model's). Under tensor parallelism
    (`model_axis`, with `split`: a params-structured tree of bools, True for the params
    split over it) the split params' squares are summed over the model axis too, the
    replicated ones (equal on every device of it) counted once."""
    sq = lambda x: jnp.sum(jnp.square(x.astype(jnp.float32)))
    leaves = jax.tree.leaves(pieces)
    if self.model_axis is None:
      return jnp.sqrt(jax.lax.psum(sum(sq(x) for x in leaves), self.axis_name))
    split = jax.tree.leaves(self.split)
    zero = jnp.zeros((), jnp.float32)
    sharded = sum((sq(x) for x, s in zip(leaves, split) if s), zero)
    replicated = sum((sq(x) for x, s in zip(leaves, split) if not s), zero)
    total = jax.lax.psum(sharded, self.model_axis) + replicated
    return jnp.sqrt(jax.lax.psum(total, self.axis_name))

  def _apply(self, pieces, norm, state, local_params, accept):
    if self.max_grad_norm is not None:
      # Same formula as optax.clip_by_global_norm, on the global norm.
      pieces = jax.tree.map(
          lambda g: jnp.where(norm < self.max_grad_norm, g,
                              (g / norm * self.max_grad_norm).astype(g.dtype)), pieces)
    updates, new_state = self.tx.update(pieces, state, local_params)
    new_local = optax.apply_updates(local_params, updates)
    if accept is None:
      return new_local, new_state
    # The choice between new and old in the update's own elementwise pass: XLA fuses it
    # there, where choosing after the all-gather was one more pass over params and state.
    ok = accept(norm)
    keep = lambda new, old: jnp.where(ok, new, old)
    return (jax.tree.map(keep, new_local, local_params),
            jax.tree.map(keep, new_state, state))

  def update(self, grads, state, params, accept=None) -> UpdateResult:
    """Local (per-device) `grads`, this device's `state` and the replicated `params` in;
    the synced new params, the new state and the global gradient norm out. `accept`
    (optional): the global gradient norm -> a bool scalar, False to keep params and
    state as they were (a non-finite step)."""
    pieces, norm = self.sync_grads(grads)
    new_local, state = self._apply(pieces, norm, state, self._local(params), accept)
    new_params = collectives.all_gather(self.plan.tree_to_shards(new_local), self.plan,
                                        self.axis_name, impl=self.impl)
    return UpdateResult(new_params, state, norm)

  def update_sharded(self, grad_pieces, state, local_params, accept=None) -> UpdateResult:
    """FSDP: the params are sharded already (`tunix_core.parallel.fsdp`) and `grad_pieces` are the
    device-mean gradients of this device's `local_params` (the layout's reduce-scatter
    made them, within the slice). The update stays local: `params` of the result are the
    new local pieces. `accept` as in `update`."""
    grad_pieces = self.across_slices(grad_pieces)
    norm = self.global_norm(grad_pieces)
    new_local, state = self._apply(grad_pieces, norm, state, local_params, accept)
    return UpdateResult(new_local, state, norm)


class SingleShardOptimizer(ShardedOptimizer):
  """`ShardedOptimizer` on a data axis of one device (without TP): the pieces are the
  leaves themselves, in their own shapes, and nothing is reduced, gathered or
  flattened. On TPU a leaf's 1-D piece is a relayout copy of its 8 x 128 tiles, and the
  gradient's, the params' and the new params' copies cost more than the update itself.
  The gradient is cast to the params' dtypes, as the buckets would, and never to
  `comm_dtype`: nothing goes on the wire."""

  def _local(self, params):
    return params

  def sync_grads(self, grads):
    leaves = jax.tree.leaves(grads)
    pieces = jax.tree.unflatten(self.plan.treedef,
                                [x.astype(d) for x, d in zip(leaves, self.plan.dtypes)])
    pieces = self.across_slices(pieces)
    return pieces, self.global_norm(pieces)

  def update(self, grads, state, params, accept=None) -> UpdateResult:
    pieces, norm = self.sync_grads(grads)
    new_params, state = self._apply(pieces, norm, state, params, accept)
    return UpdateResult(new_params, state, norm)


def abstract_opt_state(layout, tx: optax.GradientTransformation, sharding):
  """ShapeDtypeStructs of the optimizer state of `tx` kept in the cut `layout` (a
  `Zero1Layout`, `fsdp.FsdpLayout` or `tensor_parallel.Stacked`; a `parallel.layout.Layout`'s
  `cut`): each device's state of its pieces, stacked on a leading `[layout.num_shards]`
  axis placed with `sharding`."""
  local = jax.eval_shape(tx.init, layout.local_shapes())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (layout.num_shards,) + x.shape, x.dtype, sharding=sharding), local)


class Zero1Layout:
  """ZeRO-1's cut of a params-structured tree (the optimizer state's `mu`, `nu`): each leaf
  flattened, zero-padded and split into `[N, piece]` rows (`plan.local_pieces`).
  `fsdp.FsdpLayout` has the same two conversions for its own cut; `parallel.layout.Zero1`
  is the whole ZeRO-1 parameter layout built on it."""

  def __init__(self, plan: collectives.BucketPlan):
    self.plan, self.num_shards = plan, plan.num_shards
    self.treedef = plan.treedef

  def to_logical(self, tree):
    leaves = jax.tree.leaves(tree)
    return jax.tree.unflatten(self.treedef, [
        x.reshape(-1)[:int(np.prod(shape))].reshape(shape)
        for x, shape in zip(leaves, self.plan.shapes)])

  def to_pieces(self, tree):
    leaves = jax.tree.leaves(tree)
    return jax.tree.unflatten(self.treedef, [self.plan.leaf_pieces(x, i)
                                             for i, x in enumerate(leaves)])

  def local_shapes(self):
    """ShapeDtypeStructs of one device's pieces (1-D, `[piece]` per leaf)."""
    return jax.tree.unflatten(self.treedef, [
        jax.ShapeDtypeStruct((self.plan.piece_size(i),), d)
        for i, d in enumerate(self.plan.dtypes)])


class SingleLayout:
  """`SingleShardOptimizer`'s cut: every leaf whole, as one `[1, *shape]` row (the
  row's leading 1 costs no copy)."""

  num_shards = 1

  def __init__(self, plan: collectives.BucketPlan):
    self.plan, self.treedef = plan, plan.treedef

  def to_logical(self, tree):
    return jax.tree.map(lambda x: x[0], tree)

  def to_pieces(self, tree):
    return jax.tree.map(lambda x: x[None], tree)

  def local_shapes(self):
    """ShapeDtypeStructs of the leaves, each in its own shape."""
    return jax.tree.unflatten(self.treedef, [
        jax.ShapeDtypeStruct(shape, d) for shape, d in zip(self.plan.shapes, self.plan.dtypes)])


def relayout_opt_state(opt_state, old, new):
  """Optimizer state laid out by `old`, re-cut as `new` (each a `Zero1Layout`,
  `SingleLayout` or `fsdp.FsdpLayout`, for any device counts): ZeRO-1 on 8 -> 4 -> 1 devices, ZeRO-1 <-> FSDP.

  Subtrees shaped like the params (adam's `mu`, `nu`, ...) are joined into logical
  arrays and cut again. Other leaves (step counts) are equal on every device and are
  re-broadcast.
  """
  def is_param_tree(x):
    return not isinstance(x, jax.Array) and jax.tree.structure(x) == old.treedef

  def cut(subtree):
    if not is_param_tree(subtree):
      return jnp.broadcast_to(subtree[:1], (new.num_shards,) + subtree.shape[1:])
    return new.to_pieces(old.to_logical(subtree))

  return jax.tree.map(cut, opt_state, is_leaf=is_param_tree)
