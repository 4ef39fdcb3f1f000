"""Pallas TPU kernels for fused linear log-probs: `log_softmax(h @ w)[t]` per row.

Shapes: hidden `[N, D]`, weight `[D, V]`, tiles of `block_n` tokens, `block_v` vocabulary
columns and `block_d` hidden units (`BlockSizes`). Nothing is padded or copied: the last
token and vocabulary blocks may run past `N` and `V` and are masked inside the kernels
(`logprobs_tile`); writes past the edge are dropped. `D` must be a multiple of `block_d`.

Forward, grid `(N/bn, V/bv, D/bd)`: float32 logits accumulate over hidden blocks in VMEM;
after the last one they fold into an online log-sum-exp (running max, running sum,
target logit) kept lane-replicated `[bn, 128]`, as flash attention keeps its row
statistics.

Backward, with whole-D tiles (`block_d=None`, the default wherever they fit): the fused
kernel `fused_logprobs_bwd` (`logprobs_fused_bwd`), one logit recompute for both
gradients. With a split D (tiles too large for VMEM otherwise, e.g. v4 at D = 8192), two
kernels, each recomputing a logit tile from h and w (phase 0, over the hidden blocks),
turning it into `g * (onehot - softmax)` with the saved log-sum-exp, then contracting
that with every hidden block of the other operand (phase 1), accumulating in float32
VMEM: `fused_logprobs_dhidden` over grid `(N/bn, V/bv, 2 D/bd)` into `[bn, D]`,
`fused_logprobs_dweight` over grid `(V/bv, N/bn, 2 D/bd)` into `[D, bv]` (a float32
`d_weight` is its own accumulator). No `[N, V]` array exists in HBM in either pass.

Every `pallas_call` is named and carries a `cost_estimate` of its flops and HBM traffic.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tunix_kernels.logprobs import fused_bwd as logprobs_fused_bwd
from tunix_kernels.logprobs import tile as tile
from tunix_kernels.common import cotangent_for
from tunix_kernels.common import out_struct
from tunix_kernels.dispatch import LANES
from tunix_kernels.logprobs.blocks import cost_estimate

F32 = jnp.float32


class _KernelDims(NamedTuple):
  """Static sizes a kernel body needs (hashable, for `functools.partial`)."""
  n: int
  v: int
  bn: int
  bv: int
  bd: int
  nd: int  # hidden blocks
  steps: int  # backward steps per (token, vocabulary) tile: 1 or 2 * nd
  softcap: float | None  # logits become softcap * tanh(logits / softcap)

  @property
  def use_from(self):  # first phase-1 step
    return self.steps - self.nd


def _dims(hidden, weight, bs, softcap):
  (n, d), v = hidden.shape, weight.shape[1]
  bd = d if bs.block_d is None else bs.block_d
  nd = d // bd
  return _KernelDims(n, v, bs.block_n, bs.block_v, bd, nd, 1 if nd == 1 else 2 * nd, softcap)


def _accumulate_logits(logits_sc, h_ref, w_ref, k):
  tile.accumulate(logits_sc, jnp.dot(h_ref[...], w_ref[...], preferred_element_type=F32),
                  k == 0)


def _masked_logits(logits_sc, j, dims):
  return tile.masked_logits(logits_sc[...], j, dims.bv, dims.v, dims.softcap)


def _fwd_kernel(h_ref, w_ref, t_ref, logp_ref, lse_ref, logits_sc, m_sc, l_sc, t_sc, *, dims):
  j, k = pl.program_id(1), pl.program_id(2)
  last_k = k == dims.nd - 1

  @pl.when((j == 0) & (k == 0))
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, tile.MASK_VALUE, F32)
    l_sc[...] = jnp.zeros(l_sc.shape, F32)
    t_sc[...] = jnp.zeros(t_sc.shape, F32)

  _accumulate_logits(logits_sc, h_ref, w_ref, k)

  @pl.when(last_k)
  def _fold():
    logits, cols, _ = _masked_logits(logits_sc, j, dims)
    m_old = m_sc[...]                                                   # [bn, 128]
    m_new = jnp.maximum(m_old, jnp.max(logits, axis=1, keepdims=True))  # [bn, 128]
    p_sum = jnp.sum(jnp.exp(logits - m_new[:, :1]), axis=1, keepdims=True)
    l_sc[...] = l_sc[...] * jnp.exp(m_old - m_new) + p_sum
    m_sc[...] = m_new
    t_sc[...] += jnp.sum(jnp.where(cols == t_ref[...], logits, 0.0), axis=1, keepdims=True)

  @pl.when((j == pl.num_programs(1) - 1) & last_k)
  def _finalize():
    lse = m_sc[...] + jnp.log(l_sc[...])
    lse_ref[...] = lse
    logp_ref[...] = t_sc[...] - lse


def _store_dlogits(dl_sc, logits_sc, t_ref, lse_ref, g_ref, i, j, dims, mask_rows):
  """`g * (onehot - softmax)` of the tile into `dl_sc`, in the input dtype for the MXU;
  rows past N zeroed when `mask_rows` (their statistics are garbage)."""
  rows = tile.index_from(i * dims.bn, (dims.bn, 1), 0) if mask_rows else None
  dl = tile.dlogits(logits_sc[...], t_ref[...], lse_ref[:, :1], g_ref[:, :1], j, dims.bv,
                    dims.v, dims.softcap, rows, dims.n)
  dl_sc[...] = dl.astype(dl_sc.dtype)


def _dh_kernel(h_ref, w_ref, t_ref, lse_ref, g_ref, dh_ref, logits_sc, dl_sc, acc_sc, *,
               dims):
  i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  pl.when(s < dims.nd)(lambda: _accumulate_logits(logits_sc, h_ref, w_ref, s))
  pl.when(s == dims.nd - 1)(
      lambda: _store_dlogits(dl_sc, logits_sc, t_ref, lse_ref, g_ref, i, j, dims, False))

  def contract(mask_cols):
    w = w_ref[...]
    if mask_cols:  # the dlogits there are 0 already, but 0 * garbage may be NaN
      w = jnp.where(tile.index_from(j * dims.bv, w.shape, 1) < dims.v, w, 0)
    # [bn, bv] x [bd, bv] contracted over bv -> [bn, bd]
    part = jax.lax.dot_general(dl_sc[...], w, (((1,), (1,)), ((), ())),
                               preferred_element_type=F32)
    tile.accumulate(acc_sc.at[s - dims.use_from], part, j == 0)

  pl.when(s >= dims.use_from)(lambda: tile.edge_split(
      j == pl.num_programs(1) - 1, dims.v % dims.bv, contract))

  @pl.when((j == pl.num_programs(1) - 1) & (s == dims.steps - 1))
  def _finalize():
    for kk in range(dims.nd):
      dh_ref[:, kk * dims.bd:(kk + 1) * dims.bd] = acc_sc[kk].astype(dh_ref.dtype)


def _dw_kernel(h_ref, w_ref, t_ref, lse_ref, g_ref, dw_ref, logits_sc, dl_sc, *acc_sc, dims):
  j, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  edge = i == pl.num_programs(1) - 1
  ragged = dims.n % dims.bn
  pl.when(s < dims.nd)(lambda: _accumulate_logits(logits_sc, h_ref, w_ref, s))
  pl.when(s == dims.nd - 1)(lambda: tile.edge_split(edge, ragged, lambda mask: _store_dlogits(
      dl_sc, logits_sc, t_ref, lse_ref, g_ref, i, j, dims, mask)))

  def contract(mask_rows):
    h = h_ref[...]
    if mask_rows:  # the dlogits there are 0 already, but 0 * garbage may be NaN
      rows = tile.index_from(i * dims.bn, h.shape, 0)
      h = jnp.where(rows < dims.n, h, 0)
    # [bn, bd] x [bn, bv] contracted over bn -> [bd, bv]
    part = jax.lax.dot_general(h, dl_sc[...], (((0,), (0,)), ((), ())),
                               preferred_element_type=F32)
    k = s - dims.use_from
    if acc_sc:
      tile.accumulate(acc_sc[0].at[k], part, i == 0)
    elif dims.nd == 1:  # a float32 d_weight accumulates in its resident output block
      tile.accumulate(dw_ref, part, i == 0)
    else:
      tile.accumulate(dw_ref.at[pl.ds(pl.multiple_of(k * dims.bd, dims.bd), dims.bd), :], part,
                  i == 0)

  pl.when(s >= dims.use_from)(lambda: tile.edge_split(edge, ragged, contract))

  if acc_sc:
    @pl.when(edge & (s == dims.steps - 1))
    def _finalize():
      for kk in range(dims.nd):
        dw_ref[kk * dims.bd:(kk + 1) * dims.bd, :] = acc_sc[0][kk].astype(dw_ref.dtype)


def _params(semantics, bs):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=bs.vmem_limit_bytes)


def forward(hidden, weight, targets, bs, softcap, interpret, cores=1):
  """`(logp [N], lse [N, LANES])` float32 (the log-sum-exp lane-replicated) of `[N, D]`
  hidden, `[D, V]` weight and `[N]` targets in `[0, V)`; a target of -1 matches no
  column: its log-prob is `-lse` (a vocabulary slice that does not own the target).
  `cores`: the chip's TensorCores, for the cost estimate."""
  dims = _dims(hidden, weight, bs, softcap)
  grid = (pl.cdiv(dims.n, dims.bn), pl.cdiv(dims.v, dims.bv), dims.nd)
  row = pl.BlockSpec((dims.bn, LANES), lambda i, j, k: (i, 0))
  logp, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, dims=dims),
      grid=grid,
      in_specs=[pl.BlockSpec((dims.bn, dims.bd), lambda i, j, k: (i, k)),
                pl.BlockSpec((dims.bd, dims.bv), lambda i, j, k: (k, j)),
                pl.BlockSpec((dims.bn, 1), lambda i, j, k: (i, 0))],
      out_specs=[row, row],
      out_shape=[out_struct((dims.n, LANES), F32, hidden, weight)] * 2,
      scratch_shapes=[pltpu.VMEM((dims.bn, dims.bv), F32)]
      + [pltpu.VMEM((dims.bn, LANES), F32)] * 3,
      compiler_params=_params(("parallel", "arbitrary", "arbitrary"), bs),
      interpret=interpret,
      name="fused_logprobs_fwd",
      cost_estimate=cost_estimate("fwd", hidden, weight, bs, softcap, cores),
  )(hidden, weight, targets[:, None])
  return logp[:, 0], lse


def backward(hidden, weight, targets, lse, g, bs, softcap, interpret, cores=1):
  """`(d hidden, d weight)` in their dtypes of `sum(g * logp)`, given `forward`'s `lse`
  (or the log-sum-exp over the whole vocabulary, for a slice); a -1 target adds no
  one-hot term. The fused kernel for whole-D tiles, else the split pair; `cores`: the
  chip's TensorCores (the fused kernel keeps one `d_hidden` partial per core)."""
  if bs.fused:
    return logprobs_fused_bwd.backward(hidden, weight, targets, lse, g, bs, softcap,
                                       interpret, cores)
  dims = _dims(hidden, weight, bs, softcap)
  nb, vb = pl.cdiv(dims.n, dims.bn), pl.cdiv(dims.v, dims.bv)
  g_rows = jnp.broadcast_to(g[:, None], (dims.n, LANES)).astype(F32)
  args = (hidden, weight, targets[:, None], lse, g_rows)
  last_k = lambda s: jnp.minimum(s, dims.nd - 1)  # stays put in phase 1: no re-fetch
  each_k = lambda s: jax.lax.rem(s, dims.nd)

  def specs(token_block, vocab_block, h_k, w_k):
    tok = lambda *a: (token_block(*a), 0)
    return [pl.BlockSpec((dims.bn, dims.bd), lambda *a: (token_block(*a), h_k(a[2]))),
            pl.BlockSpec((dims.bd, dims.bv), lambda *a: (w_k(a[2]), vocab_block(*a))),
            pl.BlockSpec((dims.bn, 1), tok),
            pl.BlockSpec((dims.bn, LANES), tok),
            pl.BlockSpec((dims.bn, LANES), tok)]

  def scratch(acc_shape, acc=True):
    return [pltpu.VMEM((dims.bn, dims.bv), F32), pltpu.VMEM((dims.bn, dims.bv), hidden.dtype)
            ] + ([pltpu.VMEM((dims.nd, *acc_shape), F32)] if acc else [])

  semantics = ("parallel", "arbitrary", "arbitrary")
  dh = pl.pallas_call(
      functools.partial(_dh_kernel, dims=dims),
      grid=(nb, vb, dims.steps),
      in_specs=specs(lambda i, j, s: i, lambda i, j, s: j, last_k, each_k),
      out_specs=pl.BlockSpec((dims.bn, hidden.shape[1]), lambda i, j, s: (i, 0)),
      out_shape=out_struct(hidden.shape, hidden.dtype, *args),
      scratch_shapes=scratch((dims.bn, dims.bd)),
      compiler_params=_params(semantics, bs),
      interpret=interpret,
      name="fused_logprobs_dhidden",
      cost_estimate=cost_estimate("dhidden", hidden, weight, bs, softcap, cores),
  )(*args)
  dw = pl.pallas_call(
      functools.partial(_dw_kernel, dims=dims),
      grid=(vb, nb, dims.steps),
      in_specs=specs(lambda j, i, s: i, lambda j, i, s: j, each_k, last_k),
      out_specs=pl.BlockSpec((weight.shape[0], dims.bv), lambda j, i, s: (0, j)),
      out_shape=out_struct(weight.shape, weight.dtype, *args),
      scratch_shapes=scratch((dims.bd, dims.bv), weight.dtype != F32),
      compiler_params=_params(semantics, bs),
      interpret=interpret,
      name="fused_logprobs_dweight",
      cost_estimate=cost_estimate("dweight", hidden, weight, bs, softcap, cores),
  )(*args)
  return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def logprobs_pallas(hidden_NxD, weight_DxV, targets_N, block_sizes, softcap, interpret,
                    cores=1):
  """Float32 `[N]` log-probs of in-range `targets_N` under `hidden_NxD @ weight_DxV`,
  soft-capped to `softcap * tanh(logits / softcap)` unless `softcap` is None.

  Any N and V; D a multiple of `block_sizes.block_d` (checked by the caller with
  `BlockSizes.check`). `interpret` is False (Mosaic) or a `pltpu.InterpretParams`;
  `cores` the TensorCores of the chip (`tpu.Chip.cores`). Differentiable in hidden and
  weight (gradients in their dtypes).
  """
  return forward(hidden_NxD, weight_DxV, targets_N, block_sizes, softcap, interpret,
                 cores)[0]


def _fwd(hidden, weight, targets, block_sizes, softcap, interpret, cores):
  logp, lse = forward(hidden, weight, targets, block_sizes, softcap, interpret, cores)
  return logp, (hidden, weight, targets, lse)


def _bwd(block_sizes, softcap, interpret, cores, res, g):
  hidden, weight, targets, lse = res
  dh, dw = backward(hidden, weight, targets, lse, g, block_sizes, softcap, interpret,
                    cores)
  return cotangent_for(dh, hidden), cotangent_for(dw, weight), None


logprobs_pallas.defvjp(_fwd, _bwd)
