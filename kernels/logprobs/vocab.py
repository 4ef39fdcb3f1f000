"""Vocabulary-parallel log-probs (`fused_logprobs(..., vocab_axis=name)`) inside `shard_map`.

Each of the K devices of mesh axis `name` holds the contiguous slice `[D, V/K]` of the LM
head whose global ids are `[k V/K, (k+1) V/K)`; `hidden` and the global `targets` are the
same on all of them. Per device, the single-device fused path (any impl) scores a local
target on the local slice, giving `logp_loc = z_loc - lse_loc`; `z_loc`, that target's
logit, is recomputed from an `[N, D]` gather of weight columns, so `lse_loc = z_loc -
logp_loc` comes out without a second pass over the slice. One pmax and two psums of `[N]`
vectors then combine the slices: `logp = psum(owned * z_loc) - logsumexp_k(lse_loc)`.
Nothing of size `[N, V/K]` is built beyond what the chosen impl builds.

Gradients follow the caller's `shard_map` mode (see `vocab_parallel_logprobs`).
"""

import functools

import jax
import jax.numpy as jnp

from tunix_kernels import common


def vocab_parallel_logprobs(hidden_NxD, weight_DxVk, targets_N, ignored_N, axis, local_fn,
                            softcap):
  """float32 `[N]` log-probs of global `targets_N` under the weight sharded over `axis`.

  Args:
    hidden_NxD: `[N, D]` (bf16/f32), replicated over `axis`; differentiable.
    weight_DxVk: `[D, V/K]`, this device's vocabulary slice; differentiable.
    targets_N: `[N]` int32 global ids in `[0, V)`; entries where `ignored_N` are ignored.
    ignored_N: `[N]` bool; those rows return garbage the caller masks out (with a `where`,
      which also zeroes their cotangent).
    axis: the mesh axis name the vocabulary is split over.
    local_fn: `(hidden [N, D], weight [D, Vk], local targets [N] in range) -> float32 [N]`
      log-probs on the slice, the single-device fused path of the chosen impl.
    softcap: None or the float c of `c * tanh(logits / c)`.

  Returns the same values on every device of `axis`. Gradients: `hidden` gets the full
  gradient (equal on every device), `weight` the gradient of this slice, with the output
  cotangent taken as replicated (each device holds all of it, as when `jax.grad` runs
  inside the body). Under `check_vma=True` that is also what differentiating the
  `shard_map` from outside gives. Under `check_vma=False` JAX divides a replicated
  output's cotangent by K when it transposes the `shard_map` from outside, so there the
  weight's gradient comes out divided by K (hidden's stays right): take gradients inside
  the body, as the trainer does.
  """
  vk = weight_DxVk.shape[1]
  k = jax.lax.axis_index(axis)
  # axis_index is typed as varying over `axis` exactly when the shard_map checks types.
  # Each slice only gives its part of hidden's gradient; one psum of [N, D] in the
  # backward adds them up, for both uses of hidden below.
  if axis in jax.typeof(k).manual_axis_type.varying:
    # Checked types: mark hidden varying once; the transpose of that cast is the psum
    # (and the kernels, seeing a varying hidden, add none of their own).
    hidden_NxD = common.vary_like(hidden_NxD, k)
  else:
    # Unchecked: nothing is typed, so no broadcast would transpose to a psum.
    hidden_NxD = _sum_cotangent(hidden_NxD, axis)
  lo = k * vk
  owned_N = ~ignored_N & (targets_N >= lo) & (targets_N < lo + vk)
  # Any in-range local id works for rows this device does not own: there z_loc only
  # recovers lse_loc, and the target-column terms of the kernel's backward and of the
  # gather's cancel exactly (z_loc gets no cotangent of its own, see `_combine_bwd`).
  local_N = jnp.where(owned_N, targets_N - lo, 0).astype(jnp.int32)
  logp_N = local_fn(hidden_NxD, weight_DxVk, local_N)
  # The target logit from its weight column: elementwise in float32 (exact products, no
  # reduced-precision MXU passes), [N, D] like hidden; its gradient is a column scatter.
  cols_NxD = jnp.take(weight_DxVk, local_N, axis=1).T
  z_N = jnp.sum(hidden_NxD.astype(jnp.float32) * cols_NxD.astype(jnp.float32), axis=-1)
  if softcap is not None:
    z_N = softcap * jnp.tanh(z_N / softcap)
  lse_N = z_N - logp_N
  owned_f = owned_N.astype(jnp.float32)
  # Under checked types the combine's cotangents must have exactly its inputs' types.
  lse_N, z_N, owned_f = (common.vary_like(x, lse_N, z_N, owned_f)
                         for x in (lse_N, z_N, owned_f))
  return _combine(lse_N, z_N, owned_f, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _sum_cotangent(x, axis):
  """Identity whose backward sums the cotangent over `axis` (in float32)."""
  return x


def _sum_cotangent_fwd(x, axis):
  return x, None


def _sum_cotangent_bwd(axis, _, ct):
  return (jax.lax.psum(ct.astype(jnp.float32), axis).astype(ct.dtype),)


_sum_cotangent.defvjp(_sum_cotangent_fwd, _sum_cotangent_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine(lse_N, z_N, owned_N, axis):
  """`psum(owned * z) - log(psum(exp(lse)))`, float32 `[N]`, replicated over `axis`."""
  return _combine_fwd(lse_N, z_N, owned_N, axis)[0]


def combine(lse_N, z_N, owned_N, axis):
  """The vocabulary-parallel combine (not differentiated; `_combine` and the GSPMD
  kernels' forward use it): each slice's log-sum-exp `lse_N` and, where the slice owns
  the target (`owned_N`), its target logit `z_N` -> `(log-prob, whole log-sum-exp)`,
  float32 `[N]` replicated over `axis` (a name or tuple of names): one pmax and two
  psums of `[N]`."""
  # pmax only shifts the exponentials for stability.
  m_N = jax.lax.pmax(lse_N, axis)
  total_N = m_N + jnp.log(jax.lax.psum(jnp.exp(lse_N - m_N), axis))
  return jax.lax.psum(jnp.where(owned_N, z_N, 0.0), axis) - total_N, total_N


def _combine_fwd(lse_N, z_N, owned_N, axis):
  out_N, total_N = combine(lse_N, z_N, owned_N, axis)
  # This slice's share of the softmax mass, exp(lse_loc - lse), is d total / d lse_loc.
  return out_N, (jnp.exp(lse_N - total_N), owned_N)


def _combine_bwd(axis, res, g_N):
  # No collective: with g replicated, each device's cotangents are the local partials.
  # psum's own transpose would be a psum under check_vma=False and multiply them by K.
  share_N, owned_N = res
  return -g_N * share_N, g_N * owned_N, None


_combine.defvjp(_combine_fwd, _combine_bwd)
