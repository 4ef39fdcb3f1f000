"""Pallas TPU kernel for the DPO loss family on per-token log-probs `[B, T]`.

One pass over the sequence axis (grid of `T / block_t` steps, "arbitrary") accumulates
the masked per-row sums of the four log-prob inputs and the two mask lengths in
lane-replicated `[B, 128]` VMEM scratch; the last step turns them into each row's loss,
rewards and the derivative of the loss with respect to its per-sequence log-prob, all
packed into the lanes of one `[B, 128]` output. The loss is `dpo_losses.row_losses`,
the formula the XLA path evaluates, and its derivative that formula's VJP, traced into
the kernel: one formula per loss. The backward kernel ("parallel" over
sequence blocks) broadcasts those per-row derivatives back onto the masked tokens.

Inputs must already be padded: `B % 8 == 0`, `T % block_t == 0`, padded positions
masked out; rows at or past `num_rows` are padding and get zero loss and gradient.
The kernels are named `dpo_loss_fwd` and `dpo_loss_bwd` and carry a `cost_estimate`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tunix_kernels import tpu
from tunix_kernels.dpo_loss import losses as dpo_losses
from tunix_kernels.common import cotangent_for
from tunix_kernels.common import out_struct
from tunix_kernels.dispatch import LANES

# The loss types these kernels compute (`tunix_kernels.dpo_loss` takes the others through XLA).
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
# Lanes of the per-row output table.
LOSS, CHOSEN_REWARD, REJECTED_REWARD, POLICY_CHOSEN, POLICY_REJECTED, D_CHOSEN, D_REJECTED = \
    range(7)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the loss kernels, checked on construction (`tunix_kernels.DPOLossBlockSizes`).

  Attributes:
    block_t: sequence positions per grid step, a positive multiple of 128 (lanes).
    block_b: rows per kernel call, a positive multiple of 8, or None for all of them
      (rows are independent: `tunix_kernels.dpo_loss` calls the kernels once per block).
  """

  block_t: int
  block_b: int | None = None

  def __post_init__(self):
    if not isinstance(self.block_t, int) or self.block_t <= 0 or self.block_t % LANES:
      raise ValueError(f"BlockSizes.block_t={self.block_t!r} must be a positive multiple of "
                       f"{LANES}")
    if self.block_b is not None and (not isinstance(self.block_b, int) or self.block_b <= 0
                                     or self.block_b % 8):
      raise ValueError(f"BlockSizes.block_b={self.block_b!r} must be a positive multiple of "
                       "8 or None")

  @classmethod
  def get_default(cls, num_rows=None, seq_len=None) -> "BlockSizes":
    """512 positions per step (fewer for rows shorter than that: `seq_len` rounded up to
    128), over every row when they fit the smallest generation's default scoped VMEM
    (`vmem_bytes`), else over blocks of as many rows as fit; 128 positions first, where
    512 would leave fewer than 8 rows a block."""
    cap = -(-seq_len // LANES) * LANES if seq_len else None
    budget = tpu.MIN_SCOPED_VMEM_BYTES * tpu.VMEM_HEADROOM
    for block_t in (512, 256, LANES):
      block_t = min(block_t, cap or block_t)
      per_row = cls(block_t).vmem_bytes(8) / 8
      rows = int(budget // per_row) // 8 * 8
      if rows >= 8 or block_t == LANES:
        rows = max(rows, 8)
        return cls(block_t, None if num_rows is None or num_rows <= rows else rows)
    raise AssertionError("unreachable")

  def vmem_bytes(self, num_rows) -> int:
    """VMEM of the larger kernel on `num_rows` rows (padded to 8; at most `block_b`): the
    forward's six double-buffered float32 `[B, block_t]` inputs and about six such
    temporaries, its double-buffered `[B, 128]` table and six `[B, 128]` sums."""
    rows = -(-min(num_rows, self.block_b or num_rows) // 8) * 8
    return 4 * rows * (18 * self.block_t + 8 * LANES)


def _row_loss(pc, pr, rc, rr, len_c, len_r, beta, loss_type, eps):
  """Each row's loss under `loss_type` (`dpo_losses.row_losses`, the XLA path's very
  formulas) and its derivatives in the policy's chosen and rejected sums."""
  spec = dpo_losses.LossSpec(loss_types=(loss_type,), beta=beta, label_smoothing=eps)
  rows = lambda pc, pr: dpo_losses.row_losses(
      loss_type, dpo_losses.Sums(pc, pr, rc, rr, len_c, len_r), spec)
  loss, pullback = jax.vjp(rows, pc, pr)
  return (loss, *pullback(jnp.ones_like(loss)))


def _fwd_kernel(pc_ref, pr_ref, rc_ref, rr_ref, cm_ref, rm_ref, out_ref, *sums, beta,
                loss_type, eps, num_rows):
  t = pl.program_id(0)

  @pl.when(t == 0)
  def _init():
    for s in sums:
      s[...] = jnp.zeros(s.shape, jnp.float32)

  cm, rm = cm_ref[...], rm_ref[...]
  for s, x in zip(sums, (pc_ref[...] * cm, pr_ref[...] * rm, rc_ref[...] * cm,
                         rr_ref[...] * rm, cm, rm)):
    s[...] += jnp.sum(x, axis=1, keepdims=True)

  @pl.when(t == pl.num_programs(0) - 1)
  def _finalize():
    pc, pr, rc, rr, len_c, len_r = (s[...] for s in sums)  # each [B, 128], lane-replicated
    chosen_reward, rejected_reward = beta * (pc - rc), beta * (pr - rr)
    loss, d_chosen, d_rejected = _row_loss(pc, pr, rc, rr, len_c, len_r, beta, loss_type,
                                           eps)
    rows = jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 0)
    valid = rows < num_rows
    lanes = jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 1)
    table = jnp.zeros(out_ref.shape, jnp.float32)
    for lane, value in ((LOSS, loss), (CHOSEN_REWARD, chosen_reward),
                        (REJECTED_REWARD, rejected_reward), (POLICY_CHOSEN, pc),
                        (POLICY_REJECTED, pr), (D_CHOSEN, d_chosen),
                        (D_REJECTED, d_rejected)):
      table = jnp.where(lanes == lane, value, table)
    out_ref[...] = jnp.where(valid, table, 0.0)


def _bwd_kernel(coef_ref, cm_ref, rm_ref, dpc_ref, dpr_ref):
  coef = coef_ref[...]
  dpc_ref[...] = coef[:, 0:1] * cm_ref[...]
  dpr_ref[...] = coef[:, 1:2] * rm_ref[...]


# Per entry of the forward's lane-replicated `[B, 128]` row sums, its last step does about
# this many elementwise ops (averages, rewards, loss and derivative, packing the table)
# and, for sigmoid and robust, two log-sigmoids and their derivatives: 6 transcendentals.
_FINALIZE_FLOPS = 48


def cost_estimate(kernel, B, T, loss_type=None) -> pl.CostEstimate:
  """What `kernel` ("fwd" or "bwd") costs on padded float32 `[B, T]` inputs (the
  forward's transcendentals depend on `loss_type`).

  The forward streams six `[B, T]` inputs once (four log-probs masked and summed, two
  masks summed: 10 flops per position) and writes the `[B, 128]` table; the backward
  reads the `[B, 128]` coefficients and both masks and writes two `[B, T]` gradients
  (one multiply per position each).
  """
  bt, table = B * T * 4, B * LANES * 4
  if kernel == "fwd":
    exps = 6 * B * LANES if loss_type in ("sigmoid", "robust") else 0
    return pl.CostEstimate(flops=10 * B * T + _FINALIZE_FLOPS * B * LANES,
                           transcendentals=exps, bytes_accessed=6 * bt + table)
  if kernel == "bwd":
    return pl.CostEstimate(flops=2 * B * T, transcendentals=0,
                           bytes_accessed=table + 2 * bt + 2 * bt)
  raise ValueError(f"unknown DPO loss kernel {kernel!r}")


def _forward(pc, pr, rc, rr, cm, rm, beta, loss_type, eps, num_rows, bs, interpret):
  B, T = pc.shape
  block = pl.BlockSpec((B, bs.block_t), lambda t: (0, t))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, beta=beta, loss_type=loss_type, eps=eps,
                        num_rows=num_rows),
      grid=(T // bs.block_t,),
      in_specs=[block] * 6,
      out_specs=pl.BlockSpec((B, LANES), lambda t: (0, 0)),
      out_shape=out_struct((B, LANES), jnp.float32, pc, pr, rc, rr, cm, rm),
      scratch_shapes=[pltpu.VMEM((B, LANES), jnp.float32)] * 6,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      interpret=interpret,
      name="dpo_loss_fwd",
      cost_estimate=cost_estimate("fwd", B, T, loss_type),
  )(pc, pr, rc, rr, cm, rm)


def _backward(coef, cm, rm, bs, interpret):
  B, T = cm.shape
  block = pl.BlockSpec((B, bs.block_t), lambda t: (0, t))
  return pl.pallas_call(
      _bwd_kernel,
      grid=(T // bs.block_t,),
      in_specs=[pl.BlockSpec((B, LANES), lambda t: (0, 0)), block, block],
      out_specs=[block, block],
      out_shape=[out_struct((B, T), jnp.float32, coef, cm, rm)] * 2,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
      name="dpo_loss_bwd",
      cost_estimate=cost_estimate("bwd", B, T),
  )(coef, cm, rm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def dpo_rows(pc, pr, rc, rr, cm, rm, beta, loss_type, eps, num_rows, block_sizes,
             interpret):
  """Per-row loss `[B]` (differentiable in all four log-prob inputs) and the per-row
  table `[B, 128]` whose lanes are indexed by the constants above (not differentiable).

  All inputs float32 `[B, T]`; masks 0/1.
  """
  table = _forward(pc, pr, rc, rr, cm, rm, beta, loss_type, eps, num_rows, block_sizes,
                   interpret)
  return table[:, LOSS], table


def _rows_fwd(pc, pr, rc, rr, cm, rm, beta, loss_type, eps, num_rows, block_sizes,
              interpret):
  table = _forward(pc, pr, rc, rr, cm, rm, beta, loss_type, eps, num_rows, block_sizes,
                   interpret)
  return (table[:, LOSS], table), (table, cm, rm, (pc, pr, rc, rr))


def _rows_bwd(beta, loss_type, eps, num_rows, block_sizes, interpret, res, cts):
  table, cm, rm, primals = res
  g_rows = cts[0]  # the table's cotangent is dropped: metrics are not differentiable
  coef = jnp.zeros_like(table)
  coef = coef.at[:, 0].set(g_rows * table[:, D_CHOSEN]).at[:, 1].set(
      g_rows * table[:, D_REJECTED])
  dpc, dpr = _backward(coef, cm, rm, block_sizes, interpret)
  grads = (dpc, dpr, -dpc, -dpr)
  return (*(cotangent_for(g, p) for g, p in zip(grads, primals)), None, None)


dpo_rows.defvjp(_rows_fwd, _rows_bwd)
