"""ZeRO-style sharded optimizer over the hand-written collectives (call inside shard_map).

Each device keeps optimizer state for its own 1/N of every parameter only. A step
reduce-scatters the local gradients (so each device holds the mean gradient of its
piece), clips by the global norm of the whole model, applies the optax transformation
to its piece and all-gathers the updated params.
"""

import jax
import jax.numpy as jnp
import optax

from tunix_core import collectives


class ShardedOptimizer:
  """Runs an elementwise optax transformation on 1/N of the params per device.

  `tx` sees a pytree with the params' structure whose leaves are this device's 1-D
  pieces, so per-leaf masks (e.g. no weight decay on norm scales) select the right
  elements. Transformations that mix elements across a leaf (per-leaf norms, global
  norm clipping) would only see the piece; global clipping is `max_grad_norm` instead.

  The result equals replicated `optax.chain(optax.clip_by_global_norm(max_grad_norm),
  tx)` applied to the mean gradient over the axis.
  """

  def __init__(self, tx: optax.GradientTransformation, plan: collectives.BucketPlan,
               axis_name, *, max_grad_norm: float | None = None, impl: str = "xla",
               comm_dtype=None):
    if max_grad_norm is not None and not max_grad_norm > 0:
      raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
    self.tx, self.plan, self.axis_name = tx, plan, axis_name
    self.max_grad_norm, self.impl, self.comm_dtype = max_grad_norm, impl, comm_dtype

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
    pieces = self.plan.shards_to_tree(shards)
    # Padding is zero, so the pieces' squared norms add up to the model's.
    local_sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(pieces))
    return pieces, jnp.sqrt(jax.lax.psum(local_sq, self.axis_name))

  def update(self, grads, state, params, *, return_grad_norm=False):
    """Local (per-device) `grads` in; synced new params (full, replicated) and state out.

    With `return_grad_norm=True` also returns the global norm of the mean gradient.
    """
    pieces, norm = self.sync_grads(grads)
    if self.max_grad_norm is not None:
      # Same formula as optax.clip_by_global_norm, on the global norm.
      pieces = jax.tree.map(
          lambda g: jnp.where(norm < self.max_grad_norm, g,
                              (g / norm * self.max_grad_norm).astype(g.dtype)), pieces)
    local_params = self._local(params)
    updates, state = self.tx.update(pieces, state, local_params)
    new_local = optax.apply_updates(local_params, updates)
    new_params = collectives.all_gather(self.plan.tree_to_shards(new_local), self.plan,
                                        self.axis_name, impl=self.impl)
    if return_grad_norm:
      return new_params, state, norm
    return new_params, state
