"""The preference-loss op: TRL's DPO loss family on policy and reference log-probs.

`dpo_loss` takes per-sequence log-probs `[B]`, or per-token log-probs `[B, T]` with 0/1
masks that select the scored (response) tokens. It is differentiable in the policy
log-probs; the reference log-probs (of DPO's frozen reference model) are treated as
constants by the loss formulas but are not wrapped in `stop_gradient` (the caller
decides what is frozen). The implementation is picked through `tunix_kernels.dispatch`.

The package is the op; its modules are every loss's formula and derivative, written
once (`losses`), and the Pallas TPU kernel that evaluates them per batch tile (`pallas`).
"""

import functools

import jax
import jax.numpy as jnp

from tunix_kernels import common
from tunix_kernels import dispatch
from tunix_kernels.dpo_loss import pallas as dpo_loss_pallas
from tunix_kernels.dpo_loss import losses as dpo_losses
from tunix_kernels import naive
from tunix_kernels.dispatch import LANES

LOSS_TYPES = dpo_losses.LOSS_TYPES
REFERENCE_FREE_TYPES = dpo_losses.REFERENCE_FREE_TYPES
# The loss lists the Pallas kernel computes: its types, with DPO's reverse-KL scores.
PALLAS_LOSS_TYPES = dpo_loss_pallas.LOSS_TYPES


def _check_args(args, chosen_mask, rejected_mask, spec, reference_free, impl) -> str:
  """Raises ValueError on a bad argument; returns the implementation to run."""
  requested = impl
  impl = dispatch.resolve_impl("dpo_loss", impl)
  if impl in ("pallas", "interpret"):
    why = _kernel_cannot(spec)
    if why and requested == "auto":
      impl = "xla"  # a loss is O(B * T) elementwise work: XLA loses nothing here
    elif why:
      raise ValueError(f"dpo_loss impl={impl!r}: {why}; use impl='xla' or 'auto'")
  names = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps",
           "ref_rejected_logps")
  no_ref = reference_free or spec.reference_free
  for name, x in zip(names, args):
    if x is None and not (no_ref and name.startswith("ref")):
      raise ValueError(f"{name} is None; only the reference log-probs may be None, "
                       "and only with reference_free=True or reference-free loss types")
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


def _kernel_cannot(spec) -> str:
  """Why the Pallas kernel cannot compute `spec`, or "" when it can."""
  other = [t for t in spec.loss_types if t not in PALLAS_LOSS_TYPES]
  if other:
    return (f"the Pallas kernel computes loss types {', '.join(PALLAS_LOSS_TYPES)}, "
            f"not {', '.join(other)}")
  if spec.f_divergence_type != "reverse_kl":
    return f"the Pallas kernel has reverse_kl scores only, not {spec.f_divergence_type}"
  return ""


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
             ref_rejected_logps, *, chosen_mask=None, rejected_mask=None, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0, reference_free=False, impl="auto",
             loss_weights=None, discopop_tau=0.05, f_divergence_type="reverse_kl",
             f_alpha_divergence_coef=0.5, simpo_gamma=0.5, cpo_alpha=1.0, pair_mask=None):
  """Weighted preference loss over the batch, and TRL's batch-mean metrics.

  Args:
    policy_chosen_logps, policy_rejected_logps: `[B]` sequence log-probs, or `[B, T]`
      token log-probs; any float dtype, computed in float32.
    ref_chosen_logps, ref_rejected_logps: same shape, from the frozen reference; may be
      None when `reference_free=True` or every loss type is reference-free (then zero).
    chosen_mask, rejected_mask: `[B, T]` 0/1 masks for per-token inputs, else None
      (per-sequence inputs count as length-1 responses for the length-normalised terms).
    beta: the KL-penalty temperature (IPO's tau, ORPO's lambda).
    loss_type: one name of `LOSS_TYPES`, a comma-separated list or a sequence of them:
      TRL 1.16's DPO loss types ("sigmoid" is DPO, cDPO with `label_smoothing`) and the
      reference-free "simpo", "cpo", "orpo"; formulas in `tunix_kernels.dpo_loss.losses`.
    loss_weights: one weight per loss type (default 1.0 each); the loss is the weighted
      sum of each term's batch mean, as TRL combines them.
    label_smoothing, discopop_tau, f_divergence_type, f_alpha_divergence_coef,
      simpo_gamma (SimPO's margin), cpo_alpha (CPO's NLL weight): TRL's parameters and
      defaults.
    pair_mask: `[B]` 0/1, the pairs that count (None: all). The per-pair loss terms and
      every metric are means over them (0 when none counts), so a padding pair (online
      DPO's tie, a batch's filler) changes neither the loss nor its gradient; the
      batch-coupled terms (`dpo_losses.BATCH_TYPES`) read every row as before.
    impl: one of `tunix_kernels.IMPLS`: "xla" (fused jnp), "pallas" (one-pass Mosaic TPU
      kernel, for the lists of `PALLAS_LOSS_TYPES` with reverse_kl scores; other
      losses raise), "interpret" (that kernel in TPU interpret mode), "naive" (unfused
      reductions; the oracle), "auto" (pallas when compiled for TPUs and the kernel
      computes the loss, else xla; see `dispatch.target_platform`). With the kernels
      the metrics carry no gradient.

  Returns:
    `(loss, metrics)`: a float32 scalar, differentiable in the policy log-probs, and the
    batch means `rewards/chosen`, `rewards/rejected`, `rewards/accuracies` (chosen reward
    strictly greater), `rewards/margins`, `logps/chosen`, `logps/rejected`, as TRL logs
    them for every loss type: `logps/*` are summed over the response and rewards are
    `beta * (policy - reference)` of those sums.
  """
  spec = dpo_losses.make_spec(
      loss_type, loss_weights, beta=beta, label_smoothing=label_smoothing,
      discopop_tau=discopop_tau, f_divergence_type=f_divergence_type,
      f_alpha_divergence_coef=f_alpha_divergence_coef, simpo_gamma=simpo_gamma,
      cpo_alpha=cpo_alpha)
  args = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
  impl = _check_args(args, chosen_mask, rejected_mask, spec, reference_free, impl)
  if reference_free or spec.reference_free:
    zero = jnp.zeros(jnp.shape(policy_chosen_logps), jnp.float32)
    args = (args[0], args[1], zero, zero)
  weights = None if pair_mask is None else jnp.asarray(pair_mask, jnp.float32)
  if weights is not None and weights.shape != jnp.shape(args[0])[:1]:
    raise ValueError(f"pair_mask has shape {weights.shape}, expected "
                     f"{jnp.shape(args[0])[:1]} (one weight per pair)")
  if impl == "naive":
    sums = naive.dpo_sums_naive(*args, chosen_mask, rejected_mask)
  elif impl in ("pallas", "interpret"):
    return _pallas_loss(args, chosen_mask, rejected_mask, spec, weights,
                        interpret=impl == "interpret")
  else:
    sums = _sums(args, chosen_mask, rejected_mask)
  return dpo_losses.loss(sums, spec, weights), dpo_losses.metrics(sums, spec.beta, weights)


def _sums(args, chosen_mask, rejected_mask) -> dpo_losses.Sums:
  """Masked float32 sums `[B]` of the four log-prob inputs and the two lengths."""
  def total(logps, mask):
    logps = logps.astype(jnp.float32)
    return logps if mask is None else jnp.sum(logps * mask.astype(jnp.float32), axis=-1)

  def length(mask):
    ones = jnp.ones(jnp.shape(args[0])[:1], jnp.float32)
    return ones if mask is None else jnp.sum(mask.astype(jnp.float32), axis=-1)

  masks = (chosen_mask, rejected_mask, chosen_mask, rejected_mask)
  return dpo_losses.Sums(*(total(x, m) for x, m in zip(args, masks)),
                         length(chosen_mask), length(rejected_mask))


def _pallas_loss(args, chosen_mask, rejected_mask, spec, weights, interpret):
  """`dpo_loss` through `dpo_loss_pallas` (one kernel call per loss type): pads to TPU
  tiles, then the weighted batch means (over the pairs `weights`, None: all)."""
  if args[0].ndim == 1:  # per-sequence values are one-token sequences with a full mask
    args = tuple(x[:, None] for x in args)
    chosen_mask = rejected_mask = jnp.ones(args[0].shape, jnp.float32)
  B, T = args[0].shape
  bs = dpo_loss_pallas.BlockSizes.get_default(B, T)
  rows = bs.block_b or B
  if B > rows:  # rows are independent: one call per block of rows fits VMEM
    w = jnp.ones((B,), jnp.float32) if weights is None else weights
    parts = [_pallas_loss(tuple(x[i:i + rows] for x in args), chosen_mask[i:i + rows],
                          rejected_mask[i:i + rows], spec, w[i:i + rows], interpret)
             for i in range(0, B, rows)]
    sizes = [jnp.sum(w[i:i + rows]) for i in range(0, B, rows)]
    mean = lambda values: sum(v * n for v, n in zip(values, sizes)) / jnp.maximum(
        jnp.sum(w), 1.0)
    return mean([p[0] for p in parts]), {k: mean([p[1][k] for p in parts]) for k in parts[0][1]}
  pad = ((0, -B % 8), (0, -T % bs.block_t))
  padded = [jnp.pad(x.astype(jnp.float32), pad) for x in (*args, chosen_mask, rejected_mask)]

  def per_rows(loss_type, params):
    return dpo_loss_pallas.dpo_rows(*padded, float(spec.beta), loss_type,
                                    float(spec.label_smoothing), B, bs, params)

  total, table = 0.0, None
  for loss_type, weight in zip(spec.loss_types, spec.loss_weights):
    if interpret:
      per_row, table = common.call_interpret(functools.partial(per_rows, loss_type))
    else:
      per_row, table = per_rows(loss_type, False)
    total = total + weight * dpo_losses.mean(per_row[:B], weights)
  t = jax.lax.stop_gradient(table[:B])
  return total, dpo_losses.metrics_of(
      t[:, dpo_loss_pallas.CHOSEN_REWARD], t[:, dpo_loss_pallas.REJECTED_REWARD],
      t[:, dpo_loss_pallas.POLICY_CHOSEN], t[:, dpo_loss_pallas.POLICY_REJECTED], weights)
