"""Ring collectives over a mesh axis of `lax.ppermute`s (`--sync_impl=ring`): n - 1
neighbour steps, each moving one `1/n` chunk, so a device's bytes are a ring
reduce-scatter's or all-gather's whatever the compiler does with the fused collectives
(`collectives.reduce_scatter` / `all_gather` with `impl="ring"`). Call inside
`jax.shard_map`."""

import jax
import jax.numpy as jnp


def _perm(n):
  return [(j, (j + 1) % n) for j in range(n)]


def reduce_scatter(bucket_f32, axis_name, n, wire_dtype):
  """Device i ends with chunk i summed over the ring: at step s it forwards its running
  sum of chunk (i - s - 1) mod n and adds its own part of the chunk it receives."""
  chunks = bucket_f32.reshape(n, -1)
  i = jax.lax.axis_index(axis_name)
  partial = chunks[(i - 1) % n]
  for s in range(n - 1):
    received = jax.lax.ppermute(partial.astype(wire_dtype), axis_name, _perm(n))
    partial = received.astype(jnp.float32) + chunks[(i - s - 2) % n]
  return partial


def all_gather(shard, axis_name, n):
  """Each device passes along what it last received; after n - 1 steps all have all."""
  i = jax.lax.axis_index(axis_name)
  out = jnp.zeros((n,) + shard.shape, shard.dtype)
  out = jax.lax.dynamic_update_index_in_dim(out, shard, i, 0)
  current = shard
  for s in range(n - 1):
    current = jax.lax.ppermute(current, axis_name, _perm(n))
    out = jax.lax.dynamic_update_index_in_dim(out, current, (i - s - 1) % n, 0)
  return out.reshape(-1)
