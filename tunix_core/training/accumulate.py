"""A step's gradient and metrics: means over its valid pairs, over micro-batches.

Inside the step's `shard_map`, each device holds `b` pairs of the global batch, cut into
`k` micro-batches. The objective of a micro-batch is a mean over its own valid pairs
(`objective.valid_pairs`: online DPO's tied prompts and a batch's filler are padding);
weighted by how many it has, summed over micro-batches and devices, and divided by the
step's valid pairs (relative to a full micro-batch, so that without padding nothing is
scaled but by the mean's own `1 / micro_batches`), it is the mean over those pairs whatever their spread, so padding
changes neither the loss nor the step size. The count rides the metrics' one all-reduce,
and the gradient is scaled by it before the layout's update (the scale is the same on
every device, so before or after the data-parallel mean is the same). Without padding
every scale is 1: the plain means over micro-batches and devices.
"""

import jax
import jax.numpy as jnp

from tunix_core.training import objective


def pair_means(objective_fn, params, batch: dict, micro_batches: int, batch_axes, sync,
               padded: bool = True):
  """`(grads, metrics, pairs)`: `objective_fn(params, micro_batch) -> (loss, metrics)`
  differentiated in `params` on each of `micro_batches` parts of this device's `batch`
  (pair arrays, split on their first axis), `sync` applied to each part's gradient (the
  layout's in-slice sync); the gradient (still this device's, for the layout's
  data-parallel mean) and the metrics (`loss` among them, means over every device) are
  means over the step's valid pairs, counted in `pairs` (float32 scalar; 0: none, and
  everything 0). Without `padded` (a plan whose batches hold real pairs only: offline)
  the gradient's scale is the constant `1 / micro_batches`, so that it waits for no
  all-reduce (the metrics' one then joins the gradient norm's)."""
  valid = lambda b: jnp.sum(objective.valid_pairs(b["loss_mask"]))
  full = batch["loss_mask"].shape[0] / micro_batches  # a micro-batch's pairs

  def weighted(p, mb):
    # Its valid pairs over all its pairs: exactly 1 without padding (no extra rounding).
    loss, metrics = objective_fn(p, mb)
    n = valid(mb) / full
    return loss * n, jax.tree.map(lambda m: m * n, metrics)

  def micro_step(mb):
    (loss, metrics), grads = jax.value_and_grad(weighted, has_aux=True)(params, mb)
    with jax.named_scope("grad_sync"):
      return sync(grads), dict(metrics, loss=loss)

  if micro_batches == 1:  # no accumulator: one fewer gradient-sized buffer
    grads, metrics = micro_step(batch)
  else:
    micro = jax.tree.map(lambda x: x.reshape((micro_batches, -1) + x.shape[1:]), batch)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(micro_step, jax.tree.map(lambda x: x[0], micro)))
    (grads, metrics), _ = jax.lax.scan(
        lambda carry, mb: (jax.tree.map(jnp.add, carry, micro_step(mb)), None), zeros, micro)
  # Sums over micro-batches; ZeRO-1 then averages over devices once per step (under
  # FSDP each micro-batch's gradient was reduce-scattered already).
  means = jax.lax.pmean(dict(metrics, pairs=valid(batch)), batch_axes)
  per_device = means.pop("pairs")  # the step's valid pairs over its devices
  # 1 / micro_batches without padding, as the plain mean over micro-batches divides.
  scale = jnp.where(per_device > 0, full / jnp.maximum(per_device, 1e-30), 0.0)
  grads = jax.tree.map((lambda g: g * scale.astype(g.dtype)) if padded
                       else (lambda g: g / micro_batches), grads)
  pairs = per_device * jax.lax.psum(1, batch_axes)
  return grads, jax.tree.map(lambda m: m * scale, means), pairs
