"""A step's gradient and metrics: means over its valid pairs, over micro-batches.

Inside the step's `shard_map`, each device holds `b` pairs of the global batch, cut into
`k` micro-batches. The objective of a micro-batch is a mean over its own valid pairs
(`objective.valid_pairs`: online DPO's tied prompts and a batch's filler are padding);
weighted by its share of the step's valid pairs (counted over every device), the mean
over micro-batches here and over devices in the layout's update is the mean over the
step's valid pairs, whatever their spread, so padding changes neither the loss nor the
step size. Without padding every share is 1: the plain means over micro-batches.
"""

import jax
import jax.numpy as jnp

from tunix_core.training import objective


def pair_means(objective_fn, params, batch: dict, micro_batches: int, batch_axes, sync):
  """`(grads, metrics, pairs)`: `objective_fn(params, micro_batch) -> (loss, metrics)`
  differentiated in `params` on each of `micro_batches` parts of this device's `batch`
  (pair arrays, split on their first axis), each weighted as the module docstring says,
  `sync` applied to each part's gradient (the layout's in-slice sync), their means over
  the parts (`loss` among the metrics; not yet averaged over devices), and the step's
  valid pairs on every device (float32 scalar)."""
  valid = lambda b: jnp.sum(objective.valid_pairs(b["loss_mask"]))
  pairs = jax.lax.psum(valid(batch), batch_axes)
  shards = micro_batches * jax.lax.psum(1, batch_axes)

  def weighted(p, mb):
    loss, metrics = objective_fn(p, mb)
    share = valid(mb) * shards / jnp.maximum(pairs, 1.0)
    return loss * share, jax.tree.map(lambda m: m * share, metrics)

  def micro_step(mb):
    (loss, metrics), grads = jax.value_and_grad(weighted, has_aux=True)(params, mb)
    with jax.named_scope("grad_sync"):
      return sync(grads), dict(metrics, loss=loss)

  if micro_batches == 1:  # no accumulator: one fewer gradient-sized buffer
    grads, metrics = micro_step(batch)
    return grads, metrics, pairs
  micro = jax.tree.map(lambda x: x.reshape((micro_batches, -1) + x.shape[1:]), batch)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       jax.eval_shape(micro_step, jax.tree.map(lambda x: x[0], micro)))
  (grads, metrics), _ = jax.lax.scan(
      lambda carry, mb: (jax.tree.map(jnp.add, carry, micro_step(mb)), None), zeros, micro)
  # Means over micro-batches; ZeRO-1 then averages over devices once per step (under
  # FSDP each micro-batch's gradient was reduce-scattered already).
  grads, metrics = jax.tree.map(lambda x: x / micro_batches, (grads, metrics))
  return grads, metrics, pairs
