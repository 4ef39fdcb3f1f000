"""`fused_logprobs`: per-token log-probs of targets under a linear LM head.

The public op flattens leading axes, checks its inputs, routes ignored positions
(`targets == ignore_index`) to a valid id with zero cotangent, and dispatches to an
implementation. The `[N, V]` logits are only ever built by `impl="reference"`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from kernels import logprobs_xla
from kernels import reference

IMPLS = ("auto", "xla", "reference", "pallas", "interpret")
DEFAULT_XLA_CHUNK = 4096


def _check_targets_concrete(targets, vocab_size, ignore_index):
  if isinstance(targets, jax.core.Tracer):
    return
  t = np.asarray(targets)
  bad = (t != ignore_index) & ((t < 0) | (t >= vocab_size))
  if bad.any():
    raise ValueError(f"targets out of range [0, {vocab_size}): found {t[bad][:5].tolist()} "
                     f"(ignore_index is {ignore_index})")


def fused_logprobs(hidden, weight, targets, *, impl="auto", block_sizes=None,
                   ignore_index=-100):
  """`log_softmax(hidden @ weight)[targets]` without materialising the logits.

  Args:
    hidden: `[..., D]` bf16 or f32; differentiable.
    weight: `[D, V]`; differentiable.
    targets: `[...]` int32 ids in `[0, V)`, or `ignore_index`.
    impl: "xla" (chunked `lax.scan`), "reference" (naive oracle), "auto" (xla for now).
    block_sizes: for "xla", an int vocabulary chunk (default 4096).
    ignore_index: target value whose position returns 0 and gets zero gradient.

  Returns:
    float32 array with the shape of `targets`. The log-sum-exp is accumulated in
    float32 whatever the input dtype.
  """
  if impl not in IMPLS:
    raise ValueError(f"unknown fused_logprobs impl {impl!r}; choose one of {IMPLS}")
  if hidden.shape[:-1] != targets.shape:
    raise ValueError(f"hidden {hidden.shape} and targets {targets.shape} disagree: hidden "
                     "must be targets.shape + (D,)")
  if weight.ndim != 2 or weight.shape[0] != hidden.shape[-1]:
    raise ValueError(f"weight must be [D, V] with D = {hidden.shape[-1]}, got {weight.shape}")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"targets must be integer, got {targets.dtype}")
  _check_targets_concrete(targets, weight.shape[1], ignore_index)

  if impl == "reference":
    return reference.logprobs_reference(hidden, weight, targets, ignore_index=ignore_index)
  if impl in ("pallas", "interpret"):
    raise NotImplementedError(f"fused_logprobs impl={impl!r} is not built yet; use 'xla'")

  chunk = DEFAULT_XLA_CHUNK if block_sizes is None else int(block_sizes)
  chunk = max(1, min(chunk, weight.shape[1]))
  hidden_NxD = hidden.reshape(-1, hidden.shape[-1])
  targets_N = targets.reshape(-1).astype(jnp.int32)
  ignored_N = targets_N == ignore_index
  # Ignored rows compute a harmless log-prob of id 0; zeroing them through `where`
  # also zeroes their cotangent, so they contribute nothing to either gradient.
  logp_N = logprobs_xla.logprobs_xla(hidden_NxD, weight, jnp.where(ignored_N, 0, targets_N),
                                     chunk)
  return jnp.where(ignored_N, 0.0, logp_N).reshape(targets.shape)
