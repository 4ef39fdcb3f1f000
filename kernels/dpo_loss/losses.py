"""The preference-loss family on per-sequence sums: TRL 1.16's DPO loss types, SimPO, CPO
and ORPO, and weighted lists of them.

Every formula reads one `Sums` of a batch: the summed response log-probs of the policy
and of the frozen reference for the chosen and rejected responses, and the two response
lengths (`[B]` float32 each). As in TRL's DPOTrainer, the policy-minus-reference log-ratios
are mapped by the f-divergence (`scores`) before the losses that use scores; `ipo` and
`sigmoid_norm` divide the scores by the response lengths, SimPO and ORPO read
length-averaged policy log-probs. The reference-free objectives (`REFERENCE_FREE_TYPES`)
never read the reference.

Three terms couple the rows of a batch, as TRL computes them over each process's batch:
`aot` and `aot_unpaired` sort the batch's log-ratios, and the negative log-likelihood of
the chosen responses (`sft`, and the NLL terms of `cpo` and `orpo`) is a mean over all the
batch's chosen tokens. Called per device (inside the trainer's `shard_map`) they are per
device batch, as TRL's are per GPU. Everything here is differentiable in the sums.
"""

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

# TRL 1.16's DPO loss types, then the reference-free objectives of its CPO/ORPO trainers.
TRL_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                  "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop",
                  "sft", "sigmoid_norm")
REFERENCE_FREE_TYPES = ("simpo", "cpo", "orpo")
LOSS_TYPES = TRL_LOSS_TYPES + REFERENCE_FREE_TYPES
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


class Sums(NamedTuple):
  """Per-pair `[B]` float32: policy and reference summed log-probs, response lengths."""
  policy_chosen: jax.Array
  policy_rejected: jax.Array
  ref_chosen: jax.Array
  ref_rejected: jax.Array
  len_chosen: jax.Array
  len_rejected: jax.Array


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """The loss terms and their parameters, with TRL's `DPOConfig` / `CPOConfig` defaults.

  `beta` is DPO's temperature (IPO's tau; ORPO's lambda, as in TRL's ORPOTrainer);
  `label_smoothing` is cDPO's / robust DPO's flip rate, EXO's epsilon and AOT's smoothing;
  `simpo_gamma` is SimPO's target margin; `cpo_alpha` the weight of CPO's NLL term.
  """
  loss_types: tuple = ("sigmoid",)
  loss_weights: tuple = (1.0,)
  beta: float = 0.1
  label_smoothing: float = 0.0
  discopop_tau: float = 0.05
  f_divergence_type: str = "reverse_kl"
  f_alpha_divergence_coef: float = 0.5
  simpo_gamma: float = 0.5
  cpo_alpha: float = 1.0

  @property
  def batch_coupled(self) -> bool:
    """True when a term couples the batch's rows (`BATCH_TYPES`): its mean over a batch
    is not the mean of its micro-batches' means."""
    return any(t in BATCH_TYPES for t in self.loss_types)

  @property
  def reference_free(self) -> bool:
    """True when no term reads the reference."""
    return all(t in REFERENCE_FREE_TYPES for t in self.loss_types)


def kwargs(spec: LossSpec) -> dict:
  """`spec` as the keyword arguments of `tunix_kernels.dpo_loss` (inverse of `make_spec`)."""
  out = dataclasses.asdict(spec)
  out["loss_type"] = out.pop("loss_types")
  return out


def parse_loss_types(loss_type) -> tuple:
  """`"sigmoid"`, `"sigmoid,sft"` or a sequence of names -> a tuple of names."""
  names = loss_type.split(",") if isinstance(loss_type, str) else list(loss_type)
  return tuple(n.strip() for n in names)


def make_spec(loss_type, loss_weights: Sequence[float] | None = None, **params) -> LossSpec:
  """A checked `LossSpec`; raises ValueError naming the bad argument."""
  types = parse_loss_types(loss_type)
  for t in types:
    if t not in LOSS_TYPES:
      raise ValueError(f"unknown loss_type {t!r}; choose from {', '.join(LOSS_TYPES)}")
  if len(set(types)) != len(types):
    raise ValueError(f"loss_type lists {loss_type!r} with a repeat; give each term once")
  weights = (1.0,) * len(types) if loss_weights is None else tuple(map(float, loss_weights))
  if len(weights) != len(types):
    raise ValueError(f"{len(weights)} loss_weights for {len(types)} loss types "
                     f"({', '.join(types)}); give one weight per type")
  spec = LossSpec(types, weights, **params)
  eps = spec.label_smoothing
  if not spec.beta > 0:
    raise ValueError(f"beta must be positive, got {spec.beta}")
  if not 0 <= eps <= 1:
    raise ValueError(f"label_smoothing must be in [0, 1], got {eps}")
  if "robust" in types and not eps < 0.5:
    raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {eps}")
  if "exo_pair" in types and not 0 < eps < 1:
    raise ValueError(f"exo_pair needs 0 < label_smoothing < 1 (EXO's epsilon; its paper "
                     f"uses 1e-3), got {eps}")
  if spec.f_divergence_type not in F_DIVERGENCES:
    raise ValueError(f"unknown f_divergence_type {spec.f_divergence_type!r}; choose from "
                     f"{', '.join(F_DIVERGENCES)}")
  if not spec.discopop_tau > 0:
    raise ValueError(f"discopop_tau must be positive, got {spec.discopop_tau}")
  return spec


def scores(logratios, spec: LossSpec):
  """TRL's f-divergence map of the policy-minus-reference log-ratios (constants dropped)."""
  kind, alpha = spec.f_divergence_type, spec.f_alpha_divergence_coef
  if kind == "forward_kl":
    return -jnp.exp(-logratios)
  if kind == "js_divergence":
    return jax.nn.log_sigmoid(logratios)
  if kind == "alpha_divergence" and abs(alpha - 1.0) >= 1e-6:
    # TRL clamps the exponent at 80 so that float32 stays finite.
    return jnp.exp(jnp.minimum((alpha - 1.0) * logratios, 80.0)) / (alpha - 1.0)
  return logratios  # reverse_kl (DPO), and alpha-divergence's limit alpha -> 1


def _smoothed(z, eps):
  """-(1 - eps) log sigmoid(z) - eps log sigmoid(-z)."""
  return -(1 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)


def chosen_nll(s: Sums):
  """Mean negative log-likelihood over every chosen response token of the batch."""
  return -jnp.sum(s.policy_chosen) / jnp.maximum(jnp.sum(s.len_chosen), 1.0)


# Terms that couple the rows of a batch (sorted log-ratios, NLL over all chosen tokens);
# every other term is the batch mean of a per-row loss (`row_losses`).
BATCH_TYPES = ("aot", "aot_unpaired", "sft", "cpo", "orpo")


def row_losses(t: str, s: Sums, spec: LossSpec):
  """Each pair's loss under term `t` (not in `BATCH_TYPES`), elementwise in `s`'s arrays
  of any one shape: the formulas the Pallas kernel evaluates too (`dpo_loss_pallas`)."""
  beta, eps = spec.beta, spec.label_smoothing
  len_c, len_r = jnp.maximum(s.len_chosen, 1.0), jnp.maximum(s.len_rejected, 1.0)
  chosen_ratio = s.policy_chosen - s.ref_chosen
  rejected_ratio = s.policy_rejected - s.ref_rejected
  sc, sr = scores(chosen_ratio, spec), scores(rejected_ratio, spec)
  z = beta * (sc - sr)
  ls = jax.nn.log_sigmoid
  if t == "sigmoid":  # DPO; cDPO with label_smoothing (TRL 1.16 has eps = 0 here)
    return _smoothed(z, eps)
  if t == "hinge":
    return jax.nn.relu(1.0 - z)
  if t == "ipo":
    return (sc / len_c - sr / len_r - 1.0 / (2.0 * beta)) ** 2
  if t == "exo_pair":
    return (jax.nn.sigmoid(z) * (ls(z) - jnp.log1p(-eps))
            + jax.nn.sigmoid(-z) * (ls(-z) - jnp.log(eps)))
  if t == "nca_pair":
    return -ls(beta * sc) - 0.5 * ls(-beta * sc) - 0.5 * ls(-beta * sr)
  if t == "robust":
    return (-(1 - eps) * ls(z) + eps * ls(-z)) / (1 - 2 * eps)
  if t == "bco_pair":
    return -ls(beta * sc) - ls(-beta * sr)
  if t == "sppo_hard":
    return (sc - 0.5 / beta) ** 2 + (sr + 0.5 / beta) ** 2
  if t == "apo_zero":
    return 1.0 - jax.nn.sigmoid(beta * chosen_ratio) + jax.nn.sigmoid(beta * rejected_ratio)
  if t == "apo_down":
    return jax.nn.sigmoid(beta * chosen_ratio) + 1.0 - jax.nn.sigmoid(z)
  if t == "discopop":
    mix = jax.nn.sigmoid(z / spec.discopop_tau)
    return -ls(z) * (1.0 - mix) + jnp.exp(-z) * mix
  if t == "sigmoid_norm":
    return -ls(beta * (sc / len_c - sr / len_r))
  if t == "simpo":  # SimPO: length-averaged policy log-probs, target margin gamma
    return _smoothed(beta * (s.policy_chosen / len_c - s.policy_rejected / len_r)
                     - spec.simpo_gamma, eps)
  raise ValueError(f"unknown or batch-coupled loss_type {t!r}")


def mean(x_B, weights_B=None):
  """The mean of `x_B` over the pairs `weights_B` (0/1 `[B]`; None: all), 0 over none."""
  if weights_B is None:
    return jnp.mean(x_B)
  return jnp.sum(x_B * weights_B) / jnp.maximum(jnp.sum(weights_B), 1.0)


def _term(t: str, s: Sums, spec: LossSpec, weights_B=None):
  """The batch mean of loss term `t` (over the pairs `weights_B` for a per-pair term)."""
  if t not in BATCH_TYPES:
    return mean(row_losses(t, s, spec), weights_B)
  beta, eps = spec.beta, spec.label_smoothing
  len_c, len_r = jnp.maximum(s.len_chosen, 1.0), jnp.maximum(s.len_rejected, 1.0)
  ls = jax.nn.log_sigmoid
  if t == "aot":
    delta = (jnp.sort(s.policy_chosen - s.policy_rejected)
             - jnp.sort(s.ref_chosen - s.ref_rejected))
    return jnp.mean(_smoothed(beta * delta, eps))
  if t == "aot_unpaired":
    return jnp.mean(_smoothed(beta * (jnp.sort(s.policy_chosen - s.ref_chosen)
                                      - jnp.sort(s.policy_rejected - s.ref_rejected)), eps))
  if t == "sft":
    return chosen_nll(s)
  if t == "cpo":
    return (jnp.mean(_smoothed(beta * (s.policy_chosen - s.policy_rejected), eps))
            + spec.cpo_alpha * chosen_nll(s))
  # orpo
  avg_c, avg_r = s.policy_chosen / len_c, s.policy_rejected / len_r
  # log(1 - exp(x)) through expm1 (exact near 0); an empty response (x = 0) would be
  # -inf, so x is kept just below 0.
  log1m_exp = lambda x: jnp.log(-jnp.expm1(jnp.minimum(x, -1e-7)))
  log_odds = (avg_c - avg_r) - (log1m_exp(avg_c) - log1m_exp(avg_r))
  return chosen_nll(s) - beta * jnp.mean(ls(log_odds))


def loss(s: Sums, spec: LossSpec, weights_B=None):
  """The weighted sum of the batch means of `spec`'s terms: a float32 scalar. The
  per-pair terms are means over the pairs `weights_B` (0/1 `[B]`; None: all); the
  batch-coupled ones read every row (padding pairs add no NLL token, but do sort)."""
  return sum(w * _term(t, s, spec, weights_B)
             for t, w in zip(spec.loss_types, spec.loss_weights))


def metrics(s: Sums, beta: float, weights_B=None) -> dict:
  """TRL's logged batch means of `s`, whatever the loss (see `metrics_of`)."""
  return metrics_of(beta * (s.policy_chosen - s.ref_chosen),
                    beta * (s.policy_rejected - s.ref_rejected),
                    s.policy_chosen, s.policy_rejected, weights_B)


def metrics_of(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected,
               weights_B=None) -> dict:
  """Means over the pairs `weights_B` (None: all) of `[B]` rewards (`beta` times the
  summed log-ratios) and summed policy log-probs, under TRL's names."""
  return {
      "rewards/chosen": mean(chosen_rewards, weights_B),
      "rewards/rejected": mean(rejected_rewards, weights_B),
      "rewards/accuracies": mean((chosen_rewards > rejected_rewards).astype(jnp.float32),
                                 weights_B),
      "rewards/margins": mean(chosen_rewards - rejected_rewards, weights_B),
      "logps/chosen": mean(policy_chosen, weights_B),
      "logps/rejected": mean(policy_rejected, weights_B),
  }
