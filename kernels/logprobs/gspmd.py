"""`fused_logprobs`' Pallas kernels partitioned under plain `jax.jit` (`tunix_kernels.gspmd`).

The rule: the tokens (`n`) stay split over the mesh axes they arrive over, and so does
the weight's vocabulary (`v`); the model dimension `d` is gathered (every kernel contracts
over all of it). Nothing of size `[N, D]` or `[D, V]` moves beyond that.

Forward, per device: the kernels on the local tokens and vocabulary slice, with targets
outside the slice set to -1 (no column matches, so the kernel returns `-lse_loc` and adds
no one-hot term), then one pmax and two psums of `[N]` over the vocabulary axes:
`logp = psum(owned * (logp_loc + lse_loc)) - logsumexp_k(lse_loc)`.
Backward, per device: the kernels given the global log-sum-exp compute this slice's exact
`g * (onehot - softmax)`, so hidden's gradient is a psum over the vocabulary axes and the
weight's a psum over the token axes; each comes back with its operand's sharding.
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tunix_kernels import gspmd
from tunix_kernels.logprobs import blocks as logprobs_blocks
from tunix_kernels.logprobs import pallas as logprobs_pallas
from tunix_kernels.logprobs import vocab as logprobs_vocab

F32 = jnp.float32
_INS = ("n d", "d v", "n")
_SPLIT = {"n": "batch", "v": "vocab"}


class Config(NamedTuple):
  """Static settings: explicit tiles (None: the default for the local shapes), the
  soft-cap, False or `pltpu.InterpretParams`, and the chip compiled for (or None)."""
  block_sizes: Any
  softcap: float | None
  interpret: Any
  chip: Any


def _tiles(cfg: Config, hidden_NxD, weight_DxV):
  if cfg.block_sizes is not None:
    return cfg.block_sizes
  (n, d), v = hidden_NxD.shape, weight_DxV.shape[1]
  return logprobs_blocks.BlockSizes.get_default(d, hidden_NxD.dtype, cfg.chip,
                                                num_tokens=n, vocab_size=v)


def _cores(cfg: Config) -> int:
  return 1 if cfg.chip is None else cfg.chip.cores


def _local_targets(axes: gspmd.Axes, targets_N, vocab_slice: int):
  """Targets as ids of this device's slice (-1 where another slice owns them), and the
  owned mask (None when the vocabulary is whole)."""
  if not axes.vocab:
    return targets_N, None
  lo = jax.lax.axis_index(axes.vocab) * vocab_slice
  owned_N = (targets_N >= lo) & (targets_N < lo + vocab_slice)
  return jnp.where(owned_N, targets_N - lo, -1), owned_N


def _forward_body(cfg: Config, axes: gspmd.Axes, hidden_NxD, weight_DxV, targets_N):
  local_N, owned_N = _local_targets(axes, targets_N, weight_DxV.shape[1])
  logp_N, lse_NxL = logprobs_pallas.forward(hidden_NxD, weight_DxV, local_N,
                                            _tiles(cfg, hidden_NxD, weight_DxV),
                                            cfg.softcap, cfg.interpret, _cores(cfg))
  if owned_N is None:
    return logp_N, lse_NxL
  lse_N = lse_NxL[:, 0]
  out_N, total_N = logprobs_vocab.combine(lse_N, logp_N + lse_N, owned_N, axes.vocab)
  return out_N, jnp.broadcast_to(total_N[:, None], lse_NxL.shape)


def _backward_body(cfg: Config, axes: gspmd.Axes, hidden_NxD, weight_DxV, targets_N,
                   lse_NxL, g_N):
  local_N, _ = _local_targets(axes, targets_N, weight_DxV.shape[1])
  dh_NxD, dw_DxV = logprobs_pallas.backward(hidden_NxD, weight_DxV, local_N, lse_NxL, g_N,
                                            _tiles(cfg, hidden_NxD, weight_DxV),
                                            cfg.softcap, cfg.interpret, _cores(cfg))
  psum = lambda x, names: jax.lax.psum(x.astype(F32), names).astype(x.dtype)
  if axes.vocab:
    dh_NxD = psum(dh_NxD, axes.vocab)
  if axes.batch:
    dw_DxV = psum(dw_DxV, axes.batch)
  return dh_NxD, dw_DxV


def _forward_op(cfg):
  return gspmd.partitioned(functools.partial(_forward_body, cfg), _INS, ("n", "n l"),
                           _SPLIT)


def _backward_op(cfg):
  return gspmd.partitioned(functools.partial(_backward_body, cfg),
                           _INS + ("n l", "n"), ("n d", "d v"), _SPLIT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def logprobs(hidden_NxD, weight_DxV, targets_N, cfg: Config):
  """Float32 `[N]` log-probs of in-range `targets_N`, as `logprobs_pallas.logprobs_pallas`,
  partitioned over the shardings of the operands; differentiable in hidden and weight."""
  return _forward_op(cfg)(hidden_NxD, weight_DxV, targets_N)[0]


def _fwd(hidden, weight, targets, cfg):
  logp, lse = _forward_op(cfg)(hidden, weight, targets)
  return logp, (hidden, weight, targets, lse)


def _bwd(cfg, res, g):
  hidden, weight, targets, lse = res
  dh, dw = _backward_op(cfg)(hidden, weight, targets, lse, g.astype(F32))
  return dh, dw, None


logprobs.defvjp(_fwd, _bwd)
