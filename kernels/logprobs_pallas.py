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

The three `pallas_call`s are named `fused_logprobs_fwd`, `fused_logprobs_dhidden` and
`fused_logprobs_dweight` (the names show in profiles and lowered modules) and carry a
`cost_estimate` for XLA's scheduler.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.common import cotangent_for
from kernels.common import out_struct
from kernels.dispatch import LANES

SUBLANES = 8
# A large finite negative instead of -inf keeps `m_old - m_new` free of inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the log-prob kernels (`kernels.LogprobsBlockSizes`), checked on
  construction.

  `block_n` rows of tokens and `block_v` vocabulary columns per tile; the hidden size D
  is never split. On TPU a token block must be a multiple of 8 (sublanes; 16 for 2-byte
  inputs, checked per call by `check_dtype`) and a vocabulary block a multiple of 128
  (lanes).
  """

  block_n: int
  block_v: int

  def __post_init__(self):
    for name, multiple in (("block_n", SUBLANES), ("block_v", LANES)):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0 or value % multiple:
        raise ValueError(f"BlockSizes.{name}={value!r} must be a positive multiple of "
                         f"{multiple}")

  @classmethod
  def get_default(cls) -> "BlockSizes":
    """256 tokens x 512 vocabulary columns."""
    return cls(block_n=256, block_v=512)

  def check_dtype(self, dtype) -> None:
    """Raises ValueError unless `block_n` is a multiple of the sublane tile of `dtype`."""
    sublanes = 16 if jnp.dtype(dtype).itemsize == 2 else SUBLANES
    if self.block_n % sublanes:
      raise ValueError(f"BlockSizes.block_n={self.block_n} must be a positive multiple of "
                       f"{sublanes} for {jnp.dtype(dtype).name} inputs")

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


def cost_estimate(kernel, hidden, weight, bs) -> pl.CostEstimate:
  """What `kernel` ("fwd", "dhidden" or "dweight") costs on padded `hidden [N, D]` and
  `weight [D, V]` (arrays or `jax.ShapeDtypeStruct`s).

  Flops: the forward is one `2 N D V` matmul; each backward kernel recomputes the logits
  and does one more matmul, `4 N D V`. Transcendentals: one exp per logit (plus, in the
  forward, one rescale per row and vocabulary block). Bytes: an input block is fetched
  again whenever its block index changes between grid steps, so the operand indexed by
  the inner grid axis is re-read once per outer step; the targets are int32 `[N]`, the
  row statistics (`lse`, the cotangent) f32 `[N, 128]`; outputs are written once.
  """
  (N, D), V = hidden.shape, weight.shape[1]
  nb, vb = N // bs.block_n, V // bs.block_v
  h, w = N * D * hidden.dtype.itemsize, D * V * weight.dtype.itemsize
  targets, stats = N * 4, N * LANES * 4
  if kernel == "fwd":  # grid (N, V): weight re-read per token block; writes logp, lse
    return pl.CostEstimate(flops=2 * N * D * V, transcendentals=N * V + N * vb,
                           bytes_accessed=h + nb * w + targets + 2 * stats)
  if kernel == "dhidden":  # grid (N, V): reads lse and g, writes d_hidden
    return pl.CostEstimate(flops=4 * N * D * V, transcendentals=N * V,
                           bytes_accessed=h + nb * w + targets + 2 * stats + h)
  if kernel == "dweight":  # grid (V, N): token-indexed inputs re-read per vocab block
    return pl.CostEstimate(flops=4 * N * D * V, transcendentals=N * V,
                           bytes_accessed=vb * (h + targets + 2 * stats) + w + w)
  raise ValueError(f"unknown log-prob kernel {kernel!r}")


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
      name="fused_logprobs_fwd",
      cost_estimate=cost_estimate("fwd", hidden, weight, bs),
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
      name="fused_logprobs_dhidden",
      cost_estimate=cost_estimate("dhidden", hidden, weight, bs),
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
      name="fused_logprobs_dweight",
      cost_estimate=cost_estimate("dweight", hidden, weight, bs),
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
