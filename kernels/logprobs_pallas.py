"""Pallas TPU kernels for fused linear log-probs: `log_softmax(h @ w)[t]` per row.

Forward: grid `(N / block_n, V / block_v)`, token blocks "parallel", vocabulary blocks
"arbitrary". Each step multiplies a `[block_n, D]` hidden tile by a `[D, block_v]` weight
tile on the MXU and folds the float32 logits into an online log-sum-exp kept in VMEM
scratch (running max, running sum, target logit), lane-replicated `[block_n, 128]` as
flash attention keeps its row statistics.

Backward recomputes logit tiles from the saved log-sum-exp, forms
`g * (onehot - softmax)` per tile and accumulates in float32 scratch:
`d_hidden` over vocabulary tiles (grid `(N, V)` blocks) and `d_weight` over token tiles
(grid `(V, N)` blocks). No `[N, V]` array exists in HBM in either pass.

Inputs must already be padded: `N % block_n == 0`, `V_padded % block_v == 0`, padded
vocabulary columns are masked by the true `vocab_size`, padded rows carry a zero
cotangent. `kernels.fused_logprobs` does the padding.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.common import cotangent_for
from kernels.common import out_struct

LANES = 128
# A large finite negative instead of -inf keeps `m_old - m_new` free of inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the log-prob kernels.

  `block_n` rows of tokens and `block_v` vocabulary columns per tile; the hidden size D
  is never split. On TPU a token block must be a multiple of 8 (sublanes; 16 for bf16)
  and a vocabulary block a multiple of 128 (lanes).
  """

  block_n: int = 256
  block_v: int = 512

  def validate(self, dtype=jnp.float32) -> None:
    sublanes = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    if self.block_n <= 0 or self.block_n % sublanes:
      raise ValueError(f"BlockSizes.block_n={self.block_n} must be a positive multiple of "
                       f"{sublanes} for {jnp.dtype(dtype).name} inputs")
    if self.block_v <= 0 or self.block_v % LANES:
      raise ValueError(f"BlockSizes.block_v={self.block_v} must be a positive multiple of "
                       f"{LANES}")

  def vmem_bytes(self, d_model: int, itemsize: int) -> int:
    """A VMEM budget for the largest of the three kernels (double-buffered tiles)."""
    tiles = (self.block_n + self.block_v) * d_model * itemsize * 2
    scratch = max(self.block_n, self.block_v) * d_model * 4
    logits = self.block_n * self.block_v * 4 * 4
    return tiles + scratch + logits + (4 << 20)


def _logits_tile(h_ref, w_ref, j, block_v, vocab_size):
  """Float32 logits of the current tile, padded vocabulary columns masked; and column ids."""
  logits = jnp.dot(h_ref[...], w_ref[...], preferred_element_type=jnp.float32)
  cols = j * block_v + jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
  return jnp.where(cols < vocab_size, logits, MASK_VALUE), cols


def _fwd_kernel(h_ref, w_ref, t_ref, logp_ref, lse_ref, m_sc, l_sc, t_sc, *,
                block_v, vocab_size):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    t_sc[...] = jnp.zeros(t_sc.shape, jnp.float32)

  logits, cols = _logits_tile(h_ref, w_ref, j, block_v, vocab_size)
  m_old = m_sc[...]                                                   # [bn, 128]
  m_new = jnp.maximum(m_old, jnp.max(logits, axis=1, keepdims=True))  # [bn, 128]
  p_sum = jnp.sum(jnp.exp(logits - m_new[:, :1]), axis=1, keepdims=True)
  l_sc[...] = l_sc[...] * jnp.exp(m_old - m_new) + p_sum
  m_sc[...] = m_new
  t_sc[...] += jnp.sum(jnp.where(cols == t_ref[...], logits, 0.0), axis=1, keepdims=True)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finalize():
    lse = m_sc[...] + jnp.log(l_sc[...])
    lse_ref[...] = lse
    logp_ref[...] = t_sc[...] - lse


def _dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab_size):
  """`g * (onehot - softmax)` of the current tile, in the input dtype for the MXU."""
  logits, cols = _logits_tile(h_ref, w_ref, j, block_v, vocab_size)
  p = jnp.exp(logits - lse_ref[:, :1])  # masked columns: exp(-huge) = 0
  onehot = (cols == t_ref[...]).astype(jnp.float32)
  return (g_ref[:, :1] * (onehot - p)).astype(h_ref.dtype)


def _dh_kernel(h_ref, w_ref, t_ref, lse_ref, g_ref, dh_ref, acc_sc, *, block_v, vocab_size):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _init():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  dlogits = _dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab_size)
  # [bn, bv] x [D, bv] contracted over bv -> [bn, D]
  acc_sc[...] += jax.lax.dot_general(dlogits, w_ref[...], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  @pl.when(j == pl.num_programs(1) - 1)
  def _finalize():
    dh_ref[...] = acc_sc[...].astype(dh_ref.dtype)


def _dw_kernel(h_ref, w_ref, t_ref, lse_ref, g_ref, dw_ref, acc_sc, *, block_v, vocab_size):
  j, i = pl.program_id(0), pl.program_id(1)

  @pl.when(i == 0)
  def _init():
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  dlogits = _dlogits(h_ref, w_ref, t_ref, lse_ref, g_ref, j, block_v, vocab_size)
  # [bn, D] x [bn, bv] contracted over bn -> [D, bv]
  acc_sc[...] += jax.lax.dot_general(h_ref[...], dlogits, (((0,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  @pl.when(i == pl.num_programs(1) - 1)
  def _finalize():
    dw_ref[...] = acc_sc[...].astype(dw_ref.dtype)


def _params(semantics, bs, hidden):
  return pltpu.CompilerParams(
      dimension_semantics=semantics,
      vmem_limit_bytes=bs.vmem_bytes(hidden.shape[1], hidden.dtype.itemsize))


def _forward(hidden, weight, targets, bs, vocab_size, interpret):
  Np, D = hidden.shape
  Vp = weight.shape[1]
  grid = (Np // bs.block_n, Vp // bs.block_v)
  row = pl.BlockSpec((bs.block_n, LANES), lambda i, j: (i, 0))
  logp, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, block_v=bs.block_v, vocab_size=vocab_size),
      grid=grid,
      in_specs=[pl.BlockSpec((bs.block_n, D), lambda i, j: (i, 0)),
                pl.BlockSpec((D, bs.block_v), lambda i, j: (0, j)),
                pl.BlockSpec((bs.block_n, 1), lambda i, j: (i, 0))],
      out_specs=[row, row],
      out_shape=[out_struct((Np, LANES), jnp.float32, hidden, weight)] * 2,
      scratch_shapes=[pltpu.VMEM((bs.block_n, LANES), jnp.float32)] * 3,
      compiler_params=_params(("parallel", "arbitrary"), bs, hidden),
      interpret=interpret,
  )(hidden, weight, targets[:, None])
  return logp[:, 0], lse


def _backward(hidden, weight, targets, lse, g, bs, vocab_size, interpret):
  Np, D = hidden.shape
  Vp = weight.shape[1]
  nb, vb = Np // bs.block_n, Vp // bs.block_v
  g_rows = jnp.broadcast_to(g[:, None], (Np, LANES)).astype(jnp.float32)
  args = (hidden, weight, targets[:, None], lse, g_rows)

  def specs(token_block, vocab_block):
    return [pl.BlockSpec((bs.block_n, D), lambda a, b: (token_block(a, b), 0)),
            pl.BlockSpec((D, bs.block_v), lambda a, b: (0, vocab_block(a, b))),
            pl.BlockSpec((bs.block_n, 1), lambda a, b: (token_block(a, b), 0)),
            pl.BlockSpec((bs.block_n, LANES), lambda a, b: (token_block(a, b), 0)),
            pl.BlockSpec((bs.block_n, LANES), lambda a, b: (token_block(a, b), 0))]

  kernel_args = dict(block_v=bs.block_v, vocab_size=vocab_size)
  dh = pl.pallas_call(
      functools.partial(_dh_kernel, **kernel_args),
      grid=(nb, vb),
      in_specs=specs(lambda i, j: i, lambda i, j: j),
      out_specs=pl.BlockSpec((bs.block_n, D), lambda i, j: (i, 0)),
      out_shape=out_struct(hidden.shape, hidden.dtype, *args),
      scratch_shapes=[pltpu.VMEM((bs.block_n, D), jnp.float32)],
      compiler_params=_params(("parallel", "arbitrary"), bs, hidden),
      interpret=interpret,
  )(*args)
  dw = pl.pallas_call(
      functools.partial(_dw_kernel, **kernel_args),
      grid=(vb, nb),
      in_specs=specs(lambda j, i: i, lambda j, i: j),
      out_specs=pl.BlockSpec((D, bs.block_v), lambda j, i: (0, j)),
      out_shape=out_struct(weight.shape, weight.dtype, *args),
      scratch_shapes=[pltpu.VMEM((D, bs.block_v), jnp.float32)],
      compiler_params=_params(("parallel", "arbitrary"), bs, hidden),
      interpret=interpret,
  )(*args)
  return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def logprobs_pallas(hidden_NxD, weight_DxV, targets_N, block_sizes, vocab_size, interpret):
  """Float32 `[N]` log-probs of in-range `targets_N` over the first `vocab_size` columns.

  `hidden_NxD` rows must be a multiple of `block_sizes.block_n` and the weight's columns
  of `block_sizes.block_v`; `interpret` is False (Mosaic) or a `pltpu.InterpretParams`.
  """
  return _forward(hidden_NxD, weight_DxV, targets_N, block_sizes, vocab_size, interpret)[0]


def _fwd(hidden, weight, targets, block_sizes, vocab_size, interpret):
  logp, lse = _forward(hidden, weight, targets, block_sizes, vocab_size, interpret)
  return logp, (hidden, weight, targets, lse)


def _bwd(block_sizes, vocab_size, interpret, res, g):
  hidden, weight, targets, lse = res
  dh, dw = _backward(hidden, weight, targets, lse, g, block_sizes, vocab_size, interpret)
  return cotangent_for(dh, hidden), cotangent_for(dw, weight), None


logprobs_pallas.defvjp(_fwd, _bwd)
