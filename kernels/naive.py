"""Naive implementations (`impl="naive"`), the oracles: short, obviously correct, and
memory-hungry.

`logprobs_naive` materialises the `[N, V]` logits; `dpo_loss_naive` spells out each
loss formula once, the way the papers write it. Tests compare the fast paths against
these (and against float64 NumPy); production code never calls them.
"""

import jax
import jax.numpy as jnp

from kernels.dispatch import IGNORE_INDEX


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


def dpo_loss_naive(policy_chosen_logps, policy_rejected_logps,
                   ref_chosen_logps, ref_rejected_logps, *,
                   chosen_mask=None, rejected_mask=None, beta=0.1,
                   loss_type="sigmoid", label_smoothing=0.0, reference_free=False):
  """The DPO family of losses, one formula per branch; same contract as `kernels.dpo_loss`."""
  def per_sequence(x, mask, average):
    if x is None:
      return None
    if mask is None:
      return x.astype(jnp.float32)
    total = jnp.sum(x * mask, axis=-1)
    return total / jnp.sum(mask, axis=-1) if average else total

  avg = loss_type == "ipo"
  pc = per_sequence(policy_chosen_logps, chosen_mask, avg)
  pr = per_sequence(policy_rejected_logps, rejected_mask, avg)
  if reference_free:
    rc, rr = jnp.zeros_like(pc), jnp.zeros_like(pr)
  else:
    rc = per_sequence(ref_chosen_logps, chosen_mask, avg)
    rr = per_sequence(ref_rejected_logps, rejected_mask, avg)

  h = (pc - rc) - (pr - rr)
  eps = label_smoothing
  if loss_type == "sigmoid":
    losses = -(1 - eps) * jnp.log(jax.nn.sigmoid(beta * h)) - eps * jnp.log(jax.nn.sigmoid(-beta * h))
  elif loss_type == "robust":
    losses = (-(1 - eps) * jnp.log(jax.nn.sigmoid(beta * h))
              + eps * jnp.log(jax.nn.sigmoid(-beta * h))) / (1 - 2 * eps)
  elif loss_type == "hinge":
    losses = jnp.maximum(0.0, 1 - beta * h)
  elif loss_type == "ipo":
    losses = (h - 1 / (2 * beta)) ** 2
  else:
    raise ValueError(f"unknown loss_type {loss_type!r}")

  chosen_rewards = beta * (pc - rc)
  rejected_rewards = beta * (pr - rr)
  metrics = {
      "rewards/chosen": jnp.mean(chosen_rewards),
      "rewards/rejected": jnp.mean(rejected_rewards),
      "rewards/accuracies": jnp.mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
      "rewards/margins": jnp.mean(chosen_rewards - rejected_rewards),
      "logps/chosen": jnp.mean(pc),
      "logps/rejected": jnp.mean(pr),
  }
  return jnp.mean(losses), metrics
