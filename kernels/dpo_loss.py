"""The DPO family of preference losses on policy and reference log-probs.

`dpo_loss` takes per-sequence log-probs `[B]`, or per-token log-probs `[B, T]` with 0/1
masks that select the scored (response) tokens. It is differentiable in the policy
log-probs; the reference log-probs (of DPO's frozen reference model) are treated as
constants by the loss formulas but are not wrapped in `stop_gradient` (the caller
decides what is frozen). The implementation is picked through `kernels.dispatch`.
"""

import jax
import jax.numpy as jnp

from kernels import common
from kernels import dispatch
from kernels import dpo_loss_pallas
from kernels import naive
from kernels.dispatch import LANES

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def _check_args(args, chosen_mask, rejected_mask, beta, loss_type, label_smoothing,
                reference_free, impl) -> str:
  """Raises ValueError on a bad argument; returns `impl` resolved by `kernels.dispatch`."""
  if loss_type not in LOSS_TYPES:
    raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
  impl = dispatch.resolve_impl("dpo_loss", impl)
  if not beta > 0:
    raise ValueError(f"beta must be positive, got {beta}")
  if loss_type == "robust" and not 0 <= label_smoothing < 0.5:
    raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
  if not 0 <= label_smoothing <= 1:
    raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
  names = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps",
           "ref_rejected_logps")
  for name, x in zip(names, args):
    if x is None and not (reference_free and name.startswith("ref")):
      raise ValueError(f"{name} is None; only the reference log-probs may be None, "
                       "and only with reference_free=True")
  shape = jnp.shape(args[0])
  for name, x in zip(names, args):
    if x is not None and jnp.shape(x) != shape:
      raise ValueError(f"{name} has shape {jnp.shape(x)}, expected {shape} "
                       f"(the shape of policy_chosen_logps)")
  per_token = len(shape) == 2
  if len(shape) not in (1, 2):
    raise ValueError(f"log-probs must be [B] or [B, T], got shape {shape}")
  for name, m in (("chosen_mask", chosen_mask), ("rejected_mask", rejected_mask)):
    if per_token and m is None:
      raise ValueError(f"per-token log-probs {shape} need {name}")
    if not per_token and m is not None:
      raise ValueError(f"{name} given with per-sequence log-probs {shape}; masks are for [B, T]")
    if m is not None and jnp.shape(m) != shape:
      raise ValueError(f"{name} has shape {jnp.shape(m)}, expected {shape}")
  return impl


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
             ref_rejected_logps, *, chosen_mask=None, rejected_mask=None, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0, reference_free=False, impl="auto"):
  """Mean preference loss over the batch, and batch-mean metrics.

  Args:
    policy_chosen_logps, policy_rejected_logps: `[B]` sequence log-probs, or `[B, T]`
      token log-probs; any float dtype, computed in float32.
    ref_chosen_logps, ref_rejected_logps: same shape, from the frozen reference; may be
      None when `reference_free=True` (they are then zero).
    chosen_mask, rejected_mask: `[B, T]` 0/1 masks for per-token inputs, else None.
    beta: the KL-penalty temperature.
    loss_type: "sigmoid" (DPO; conservative DPO with `label_smoothing`), "ipo" (on
      length-averaged log-probs), "hinge" (SLiC), "robust" (rDPO, unbiased under
      `label_smoothing` = label-flip rate).
    impl: one of `kernels.IMPLS`: "xla" (fused jnp), "pallas" (one-pass Mosaic TPU
      kernel), "interpret" (that kernel in TPU interpret mode), "naive" (one formula per
      loss; the oracle), "auto" (pallas when the devices it is compiled for are TPUs,
      else xla; see `dispatch.target_platform`). With the kernels the metrics carry no
      gradient.

  Returns:
    `(loss, metrics)`: a float32 scalar and the batch means `rewards/chosen`,
    `rewards/rejected`, `rewards/accuracies` (chosen reward strictly greater),
    `rewards/margins`, `logps/chosen`, `logps/rejected`. Rewards are
    `beta * (policy - reference)` on the same (for ipo, length-averaged) log-probs the
    loss sees.
  """
  args = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
  impl = _check_args(args, chosen_mask, rejected_mask, beta, loss_type, label_smoothing,
                     reference_free, impl)
  if impl == "naive":
    return naive.dpo_loss_naive(
        *args, chosen_mask=chosen_mask, rejected_mask=rejected_mask, beta=beta,
        loss_type=loss_type, label_smoothing=label_smoothing, reference_free=reference_free)
  if impl == "pallas":
    return _pallas_loss(args, chosen_mask, rejected_mask, beta, loss_type, label_smoothing,
                        reference_free, interpret=False)
  if impl == "interpret":
    return common.call_interpret(lambda params: _pallas_loss(
        args, chosen_mask, rejected_mask, beta, loss_type, label_smoothing, reference_free,
        interpret=params))

  average = loss_type == "ipo"

  def reduce(logps, mask):
    logps = logps.astype(jnp.float32)
    if mask is None:
      return logps
    mask = mask.astype(jnp.float32)
    total = jnp.sum(logps * mask, axis=-1)
    # A row with an empty mask would divide by zero; the data pipeline drops such
    # pairs, and the max keeps a stray one finite instead of NaN.
    return total / jnp.maximum(jnp.sum(mask, axis=-1), 1.0) if average else total

  policy_c = reduce(policy_chosen_logps, chosen_mask)
  policy_r = reduce(policy_rejected_logps, rejected_mask)
  if reference_free:
    ref_c = ref_r = jnp.zeros_like(policy_c)
  else:
    ref_c = reduce(ref_chosen_logps, chosen_mask)
    ref_r = reduce(ref_rejected_logps, rejected_mask)

  chosen_rewards = beta * (policy_c - ref_c)
  rejected_rewards = beta * (policy_r - ref_r)
  logits = chosen_rewards - rejected_rewards  # beta * h
  eps = label_smoothing
  if loss_type == "sigmoid":
    losses = -(1 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)
  elif loss_type == "robust":
    losses = ((1 - eps) * -jax.nn.log_sigmoid(logits)
              + eps * jax.nn.log_sigmoid(-logits)) / (1 - 2 * eps)
  elif loss_type == "hinge":
    losses = jax.nn.relu(1.0 - logits)
  else:  # ipo: (h - 1/(2 beta))^2 with h the unscaled log-ratio difference.
    losses = (logits / beta - 1.0 / (2.0 * beta)) ** 2

  return losses.mean(), _metrics(chosen_rewards, rejected_rewards, policy_c, policy_r)


def _metrics(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected) -> dict:
  """Batch means of per-sequence `[B]` rewards and policy log-probs."""
  return {
      "rewards/chosen": chosen_rewards.mean(),
      "rewards/rejected": rejected_rewards.mean(),
      "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean(),
      "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
      "logps/chosen": policy_chosen.mean(),
      "logps/rejected": policy_rejected.mean(),
  }


def _pallas_loss(args, chosen_mask, rejected_mask, beta, loss_type, label_smoothing,
                 reference_free, interpret):
  """`dpo_loss` through `dpo_loss_pallas`: pads to TPU tiles, then batch means."""
  pc = args[0]
  if reference_free:
    args = (args[0], args[1], jnp.zeros_like(pc), jnp.zeros_like(pc))
  if pc.ndim == 1:  # per-sequence values are one-token sequences with a full mask
    args = tuple(x[:, None] for x in args)
    chosen_mask = rejected_mask = jnp.ones(args[0].shape, jnp.float32)
  B, T = args[0].shape
  # Short sequences take one block of T rounded up to the lanes, not a padded default.
  block_t = min(dpo_loss_pallas.BlockSizes.get_default().block_t, -(-T // LANES) * LANES)
  bs = dpo_loss_pallas.BlockSizes(block_t=block_t)
  pad = ((0, -B % 8), (0, -T % block_t))
  padded = [jnp.pad(x.astype(jnp.float32), pad) for x in (*args, chosen_mask, rejected_mask)]
  rows, table = dpo_loss_pallas.dpo_rows(*padded, float(beta), loss_type,
                                         float(label_smoothing), B, bs, interpret)
  t = jax.lax.stop_gradient(table[:B])
  return rows[:B].sum() / B, _metrics(
      t[:, dpo_loss_pallas.CHOSEN_REWARD], t[:, dpo_loss_pallas.REJECTED_REWARD],
      t[:, dpo_loss_pallas.POLICY_CHOSEN], t[:, dpo_loss_pallas.POLICY_REJECTED])
