"""Naive implementations (`impl="naive"`), the oracles: short, obviously correct, and
memory-hungry.

`logprobs_naive` materialises the `[N, V]` logits; `dpo_sums_naive` reduces the loss
inputs by plain masked sums for the formulas of `tunix_kernels.dpo_loss.losses` (whose float64
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
