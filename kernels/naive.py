"""Naive implementations (`impl="naive"`), the oracles: short, obviously correct, and
memory-hungry.

`logprobs_naive` materialises the `[N, V]` logits; `attention_naive` the `[B, H, T, T]`
scores and the visibility mask; `dpo_sums_naive` reduces the loss inputs by plain masked
sums for the formulas of `tunix_kernels.dpo_loss.losses` (whose float64
NumPy oracle, written from TRL's code, lives in the tests). Tests compare the fast paths
against these; production code never calls them.
"""

import jax
import jax.numpy as jnp

from tunix_kernels.dpo_loss import losses as dpo_losses
from tunix_kernels.dispatch import IGNORE_INDEX


def logprobs_naive(hidden, weight, targets, *, ignore_index=IGNORE_INDEX, logit_softcap=None):
  """`log_softmax(hidden @ weight)[targets]` in float32, 0 where `targets == ignore_index`;
  the logits soft-capped to `c * tanh(logits / c)` first when `logit_softcap=c`.

  hidden `[..., D]`, weight `[D, V]`, targets `[...]` int; returns float32 `[...]`,
  differentiable by plain autodiff through the materialised logits.
  """
  logits = jnp.einsum("...d,dv->...v", hidden, weight,
                      preferred_element_type=jnp.float32)
  if logit_softcap is not None:
    logits = logit_softcap * jnp.tanh(logits / logit_softcap)
  logp = jax.nn.log_softmax(logits, axis=-1)
  ignored = targets == ignore_index
  safe = jnp.where(ignored, 0, targets)
  picked = jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
  return jnp.where(ignored, 0.0, picked)


def dpo_sums_naive(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
                   ref_rejected_logps, chosen_mask, rejected_mask) -> dpo_losses.Sums:
  """The per-pair sums the loss family reads, by plain masked sums (no guards, no
  fusion); per-sequence `[B]` inputs (masks None) are length-1 responses."""
  args = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
  if chosen_mask is None:
    ones = jnp.ones(jnp.shape(policy_chosen_logps), jnp.float32)
    return dpo_losses.Sums(*(jnp.asarray(x, jnp.float32) for x in args), ones, ones)
  masks = (chosen_mask, rejected_mask) * 2
  sums = [jnp.sum(jnp.asarray(x, jnp.float32) * m, axis=-1) for x, m in zip(args, masks)]
  return dpo_losses.Sums(*sums, jnp.sum(chosen_mask, -1).astype(jnp.float32),
                         jnp.sum(rejected_mask, -1).astype(jnp.float32))


def attention_naive(q_BxTxHxK, k_BxTxVxK, v_BxTxVxK, segments_BxT, branches_BxT,
                    positions_BxT, valid_BxT, window, *, scale: float, softcap: float = 0.0):
  """Grouped-query attention over the whole `[B, H, T, T]` scores, in float32: query i
  sees key j when j <= i, j is a real token (`valid`), of i's segment, of the trunk
  (branch 0) or i's own branch, and fewer than `window` rope positions back (an int32
  scalar; `tunix_kernels.attention.visits.NO_WINDOW` for none): the `Visibility` rule
  written out. A query that sees no key returns 0. `[B, T, H, K]` in q's dtype,
  differentiable in q, k, v by plain autodiff."""
  f32 = lambda x: x.astype(jnp.float32)
  groups = q_BxTxHxK.shape[2] // k_BxTxVxK.shape[2]
  k = jnp.repeat(f32(k_BxTxVxK), groups, axis=2)
  v = jnp.repeat(f32(v_BxTxVxK), groups, axis=2)
  scores_BxHxTxT = jnp.einsum("bqhk,bshk->bhqs", f32(q_BxTxHxK), k) * scale
  if softcap:
    scores_BxHxTxT = softcap * jnp.tanh(scores_BxHxTxT / softcap)
  T = q_BxTxHxK.shape[1]
  i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
  seen_BxTxT = ((j <= i) & (valid_BxT[:, None, :] > 0)
                & (segments_BxT[:, :, None] == segments_BxT[:, None, :])
                & ((branches_BxT[:, None, :] == 0)
                   | (branches_BxT[:, None, :] == branches_BxT[:, :, None]))
                & (positions_BxT[:, :, None] - positions_BxT[:, None, :] < window))
  seen = seen_BxTxT[:, None]
  masked = jnp.where(seen, scores_BxHxTxT, -jnp.inf)
  top = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
  e = jnp.where(seen, jnp.exp(masked - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
  total = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(total > 0, total, 1.0)
  return jnp.einsum("bhqs,bshk->bqhk", p, v).astype(q_BxTxHxK.dtype)
