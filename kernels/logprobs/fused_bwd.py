"""The log-prob kernels' backward in one pass: both gradients from a single recompute of
each logit tile (8 N D V flops with the forward, against 10 for the split kernels).

Grid `(C, V / (bv C), N / bn)`: C is the TensorCores of a chip (2 on the v4 and v5p
megacores, which split the leading "parallel" axis between them, else 1); each core
walks its own contiguous run of vocabulary blocks, tokens innermost. Each step, with
the whole hidden size D in VMEM:

    logits = h[i] @ w[:, j]                 recomputed once, float32 [bn, bv]
    dl     = g (onehot - softmax) cap'      with the forward's log-sum-exp
    dw[:, j] += h[i]^T dl                   float32 [D, bv] in VMEM, resident over i
    dh[c, i] += dl w[:, j]^T                float32 [bn, D], read-modify-write in HBM

`dw[:, j]` is cast into a staging buffer and copied out after the last token block while
the next vocabulary block runs. `dh` has one float32 partial per core (cores never touch
each other's rows), moved by hand: the read of step t starts before its matmuls and is
awaited after them; its write is awaited one step later, after the next step's
matmuls (before them when there is a single token block, whose rows the next step
reads back). Two VMEM slots alternate so a read never lands in a buffer still being written
out. The caller sums the per-core partials (and drops padded rows) in one XLA fusion.

HBM traffic: the hidden states (and the `[N, 3]` row statistics, lane-padded to 512
bytes a row) once per vocabulary block,
the weight and its gradient once, and 8 bytes per `dh` element per vocabulary block:
about `(s + 8) N D V / bv` for s-byte inputs, so `bv` is the tile that buys roofline.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tunix_kernels.logprobs import tile as tile
from tunix_kernels.logprobs.blocks import cost_estimate
from tunix_kernels.logprobs.blocks import d_chunk
from tunix_kernels.logprobs.blocks import used_cores
from tunix_kernels.common import out_struct
from tunix_kernels.dispatch import LANES

F32 = jnp.float32


class FusedDims(NamedTuple):
  """Static sizes of one fused backward (hashable, for `functools.partial`)."""
  n: int
  v: int
  d: int
  bn: int
  bv: int
  cores: int  # C, the leading grid axis
  softcap: float | None

  @property
  def nb(self):
    return pl.cdiv(self.n, self.bn)

  @property
  def vb(self):
    return pl.cdiv(self.v, self.bv)

  @property
  def per(self):  # vocabulary blocks per core; the last core may have fewer
    return pl.cdiv(self.vb, self.cores)

  @property
  def v_out(self):  # d_weight's columns as the kernel writes them: copies stay lane-aligned
    return pl.cdiv(self.v, LANES) * LANES

  @property
  def chunks(self):  # static (start, size) pieces of D the gradient matmuls go by
    piece = d_chunk(self.d)
    return tuple((lo, piece) for lo in range(0, self.d, piece))


def dims_of(hidden, weight, bs, softcap, cores) -> FusedDims:
  """`FusedDims` of `hidden [N, D]`, `weight [D, V]` under tiles `bs` (its backward tiles) on
  `cores` TensorCores, fewer when there are too few vocabulary blocks for each core to
  get at least one (`used_cores`)."""
  (n, d), v = hidden.shape, weight.shape[1]
  bn, bv = bs.backward_tiles
  return FusedDims(n, v, d, bn, bv, used_cores(cores, pl.cdiv(v, bv)), softcap)


def _count(dims, c):
  """Vocabulary blocks core `c` owns."""
  return jnp.minimum(dims.per, dims.vb - c * dims.per)


def _token_block(dims, c, jj, i):
  """Token block of a step; steps past a core's last block stay on its last token block,
  so they fetch nothing."""
  return jnp.where(jj < _count(dims, c), i, dims.nb - 1)


def _vocab_block(dims, c, jj):
  return jnp.minimum(c * dims.per + jj, dims.vb - 1)


def _kernel(h_ref, w_ref, rows_ref, dw_hbm, dh_hbm, acc_sc, stage_sc, dh_sc, sems, *, dims):
  c, jj, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  count = _count(dims, c)
  j = c * dims.per + jj
  t = jj * dims.nb + i  # this core's step
  slot = t % 2
  rows = pl.ds(pl.multiple_of(i * dims.bn, dims.bn), dims.bn)
  read = pltpu.make_async_copy(dh_hbm.at[c, rows], dh_sc.at[slot], sems.at[0, slot])
  write = pltpu.make_async_copy(dh_sc.at[slot], dh_hbm.at[c, rows], sems.at[1, slot])
  # A wait needs only the semaphore and the size: this stands for step t - 1's write.
  last_write = pltpu.make_async_copy(dh_sc.at[1 - slot], dh_hbm.at[c, rows],
                                     sems.at[1, 1 - slot])
  edge_width = dims.v_out - (dims.vb - 1) * dims.bv

  def dw_copy(block, width):
    cols = pl.ds(pl.multiple_of(block * dims.bv, dims.bv), width)
    return pltpu.make_async_copy(stage_sc.at[:, pl.ds(0, width)], dw_hbm.at[:, cols],
                                 sems.at[2, 0])

  def this_dw_copy(fn):  # fn(copy of block j), narrower on the vocabulary's ragged edge
    if edge_width == dims.bv or dims.vb == 1:  # (no full-width block exists then)
      fn(dw_copy(j, edge_width))
      return
    pl.when(j == dims.vb - 1)(lambda: fn(dw_copy(j, edge_width)))
    pl.when(j != dims.vb - 1)(lambda: fn(dw_copy(j, dims.bv)))

  @pl.when(jj < count)
  def _step():
    if dims.nb == 1:  # the rows read now are the rows written last step
      pl.when(t > 0)(last_write.wait)
    pl.when(jj > 0)(read.start)
    row_ids = tile.index_from(i * dims.bn, (dims.bn, 1), 0) if dims.n % dims.bn else None
    logits = jnp.dot(h_ref[...], w_ref[...], preferred_element_type=F32)
    rows_stats = rows_ref[...]  # [bn, 3]: target id (exact in float32), lse, g
    dl = tile.dlogits(logits, rows_stats[:, 0:1].astype(jnp.int32), rows_stats[:, 1:2],
                      rows_stats[:, 2:3], j, dims.bv, dims.v, dims.softcap, row_ids,
                      dims.n).astype(h_ref.dtype)
    for lo, size in dims.chunks:
      h = h_ref[:, lo:lo + size]
      if row_ids is not None:  # dl is 0 there already, but 0 * garbage may be NaN
        h = jnp.where(row_ids < dims.n, h, 0)
      # [bn, size] x [bn, bv] contracted over bn -> [size, bv]
      part = jax.lax.dot_general(h, dl, (((0,), (0,)), ((), ())), preferred_element_type=F32)
      tile.accumulate(acc_sc.at[lo:lo + size], part, i == 0)
    if dims.nb > 1:
      pl.when(t > 0)(last_write.wait)
    pl.when(jj > 0)(read.wait)
    for lo, size in dims.chunks:
      w = w_ref[lo:lo + size, :]
      if dims.v % dims.bv:
        w = jnp.where(tile.index_from(j * dims.bv, w.shape, 1) < dims.v, w, 0)
      # [bn, bv] x [size, bv] contracted over bv -> [bn, size]
      part = jax.lax.dot_general(dl, w, (((1,), (1,)), ((), ())), preferred_element_type=F32)
      tile.accumulate(dh_sc.at[slot, :, lo:lo + size], part, jj == 0)
    write.start()

    @pl.when(i == dims.nb - 1)
    def _emit_dw():
      if dims.per > 1:
        pl.when(jj > 0)(lambda: dw_copy(j - 1, dims.bv).wait())  # never the ragged edge
      stage_sc[...] = acc_sc[...].astype(stage_sc.dtype)
      this_dw_copy(lambda copy: copy.start())

    @pl.when((jj == count - 1) & (i == dims.nb - 1))
    def _drain():
      write.wait()
      this_dw_copy(lambda copy: copy.wait())


def backward(hidden, weight, targets, lse, g, bs, softcap, interpret, cores=1):
  """`(d hidden, d weight)` in their dtypes of `sum(g * logp)`: `hidden [N, D]`, `weight
  [D, V]`, `targets [N]` (-1: no one-hot term), `lse` the log-sum-exp over the whole
  vocabulary (`[N, k]`, column 0 used), `g [N]`; tiles `bs.backward_tiles`, whole D."""
  dims = dims_of(hidden, weight, bs, softcap, cores)
  tok = lambda c, jj, i: (_token_block(dims, c, jj, i), 0)
  # One array for the three row statistics: HBM tiles pad a narrow minor dimension to 128
  # lanes, so each would cost 512 bytes per token per vocabulary block on its own. Target
  # ids (< 2**24, or -1) are exact in float32.
  rows = jnp.stack([targets.astype(F32), lse[:, 0].astype(F32), g.astype(F32)], axis=1)
  args = (hidden, weight, rows)
  dw, dh_parts = pl.pallas_call(
      functools.partial(_kernel, dims=dims),
      grid=(dims.cores, dims.per, dims.nb),
      in_specs=[pl.BlockSpec((dims.bn, dims.d), tok),
                pl.BlockSpec((dims.d, dims.bv),
                             lambda c, jj, i: (0, _vocab_block(dims, c, jj))),
                pl.BlockSpec((dims.bn, 3), tok)],
      out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
      out_shape=[out_struct((dims.d, dims.v_out), weight.dtype, *args),
                 out_struct((dims.cores, dims.nb * dims.bn, dims.d), F32, *args)],
      scratch_shapes=[pltpu.VMEM((dims.d, dims.bv), F32),
                      pltpu.VMEM((dims.d, dims.bv), weight.dtype),
                      pltpu.VMEM((2, dims.bn, dims.d), F32),
                      pltpu.SemaphoreType.DMA((3, 2))],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=bs.vmem_limit_bytes),
      interpret=interpret,
      name="fused_logprobs_bwd",
      cost_estimate=cost_estimate("bwd", hidden, weight, bs, softcap, cores=dims.cores),
  )(*args)
  # A vocabulary that is not a multiple of 128 (a tiny test model's) costs a copy here.
  dw = dw if dims.v_out == dims.v else dw[:, :dims.v]
  return jnp.sum(dh_parts[:, :dims.n], axis=0).astype(hidden.dtype), dw
