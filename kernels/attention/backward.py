"""The backward of the Pallas TPU attention kernels (`attention.pallas`): dq, dk and dv
from the forward's out and log-sum-exp, the same tiles visited (`Visits`).

Every backward kernel works on transposed tiles `[bk, bq]`, so that the statistics'
rows `[1, bq]` broadcast as they are.

Two plans, chosen once per call (`TileDims.fused_backward`, from `BlockSizes`' VMEM
model): one kernel (`attention_bwd`) that walks each key block's visible query blocks,
accumulating dk and dv per key block and dq for the whole row in VMEM, so that each
tile's scores, probabilities and dS are computed once; or, where a row's dq does not fit
VMEM, two kernels (`attention_dq`, `attention_dkv`) that each compute them again (two
more products per tile and their exp and casts: the fused plan is 18-19% faster on a
v5e at 8,192 tokens, docs/results/tpu_v5e.md). The fused kernel walks each key/value
head's group of query heads inside each key block, so dk and dv are summed over the group
in VMEM and written once per key/value head (no per-query-head partials for XLA to read
back and sum), while the group's rows of dq stay in VMEM.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tunix_kernels.attention import tiles as tiles
from tunix_kernels.attention.tiles import F32
from tunix_kernels.attention.tiles import TileDims
from tunix_kernels.common import out_struct


def _fused_kernel(q_index, q_count, q_kind, window, q_ref, k_ref, v_ref, qv_ref, kv_ref,
                  do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, dq_sc, dk_sc, dv_sc,
                  *, d: TileDims):
  b, kj, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  col = b * d.nk + kj
  qi = q_index[col * d.nq + i]

  @pl.when((kj == 0) & (i == 0))
  def _init_row():  # query head g of the group
    dq_sc[g] = jnp.zeros(dq_sc.shape[1:], F32)

  @pl.when((g == 0) & (i == 0))
  def _init_block():
    dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

  def visit(ok):
    q, do, k = q_ref[0, 0], do_ref[0, 0], k_ref[0, 0]
    if d.ragged_q:
      q, do = tiles.real_rows(q, d.bq, qi, d), tiles.real_rows(do, d.bq, qi, d)
    if d.ragged_k:  # dq contracts k over the block's rows
      k = tiles.real_rows(k, d.bk, kj, d)
    p, ds = tiles.grad_tile(q, k, v_ref[0, 0], do, lse_ref[0, 0], delta_ref[0, 0], ok, d)
    ds = ds.astype(q.dtype)
    dv_sc[...] += jnp.dot(p.astype(do.dtype), do, preferred_element_type=F32)
    dk_sc[...] += jnp.dot(ds, q, preferred_element_type=F32)
    # [bk, bq] x [bk, K] contracted over bk -> this query block's rows of dq
    rows = pl.ds(pl.multiple_of(qi * d.bq, d.bq), d.bq)
    dq_sc[g, rows, :] += jax.lax.dot_general(ds, k, (((0,), (0,)), ((), ())),
                                             preferred_element_type=F32)

  tiles.when_visited(i < q_count[col], q_kind[col * d.nq + i], visit, qi, kj, qv_ref[0],
                     kv_ref[0], window[0], d, keys_down=True)

  @pl.when((g == d.groups - 1) & (i == d.nq - 1))
  def _finish_block():
    dk_ref[0, 0] = (dk_sc[...] * d.dk_scale).astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)

  @pl.when((kj == d.nk - 1) & (i == d.nq - 1))
  def _finish_row():
    dq_ref[0, g] = (dq_sc[g, :d.t, :] * d.scale).astype(dq_ref.dtype)


def _group_walk(d: TileDims, B: int, KV: int, K: int):
  """`(grid, in_specs, kv_tile)` of the walk both dk/dv kernels make, `(B, KV, nk,
  groups, nq)`: each key block of a key/value head, the group's query heads, their
  visible query blocks (listed in `q_index`); operands as the kernels take them."""
  q_block = lambda b, kvh, kj, g, i, idx, *_: idx[(b * d.nk + kj) * d.nq + i]
  q_tile = lambda b, kvh, kj, g, i, *s: (b, kvh * d.groups + g, q_block(
      b, kvh, kj, g, i, *s), 0)
  q_stat = lambda b, kvh, kj, g, i, *s: (b, kvh * d.groups + g, 0, q_block(
      b, kvh, kj, g, i, *s))
  kv_tile = lambda b, kvh, kj, g, i, *_: (b, kvh, kj, 0)
  in_specs = [pl.BlockSpec((1, 1, d.bq, K), q_tile),
              pl.BlockSpec((1, 1, d.bk, K), kv_tile),
              pl.BlockSpec((1, 1, d.bk, K), kv_tile),
              pl.BlockSpec((1, 3, d.bq), lambda b, kvh, kj, g, i, *s: (
                  b, 0, q_block(b, kvh, kj, g, i, *s))),
              pl.BlockSpec((1, d.bk, 3), lambda b, kvh, kj, g, i, *_: (b, kj, 0)),
              pl.BlockSpec((1, 1, d.bq, K), q_tile),
              pl.BlockSpec((1, 1, 1, d.bq), q_stat),
              pl.BlockSpec((1, 1, 1, d.bq), q_stat)]
  return (B, KV, d.nk, d.groups, d.nq), in_specs, kv_tile


def _fused(d: TileDims, q, k, v, rows, do, lse, delta):
  """`(dq, dk, dv)` by the one kernel (module docstring) on `_group_walk`'s grid, the
  group's rows of dq resident across the key blocks."""
  B, _, T, K = q.shape
  KV = k.shape[1]
  vis = rows.visits
  args = (q, k, v, rows.q_rows, rows.k_cols, do, lse, delta)
  grid, in_specs, kv_tile = _group_walk(d, B, KV, K)
  dq, dk, dv = pl.pallas_call(
      functools.partial(_fused_kernel, d=d),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=grid, in_specs=in_specs,
          out_specs=[pl.BlockSpec((1, d.groups, T, K), lambda b, kvh, *_: (b, kvh, 0, 0)),
                     pl.BlockSpec((1, 1, d.bk, K), kv_tile),
                     pl.BlockSpec((1, 1, d.bk, K), kv_tile)],
          scratch_shapes=[pltpu.VMEM((d.groups, d.nq * d.bq, K), F32)]
                         + [pltpu.VMEM((d.bk, K), F32)] * 2),
      out_shape=[out_struct(q.shape, q.dtype, *args), out_struct(k.shape, k.dtype, *args),
                 out_struct(v.shape, v.dtype, *args)],
      # The group's dq stays in VMEM across key blocks, dk/dv across the group's heads:
      # every walk is sequential.
      compiler_params=tiles.compiler_params(d, ("parallel", "parallel", "arbitrary",
                                                "arbitrary", "arbitrary"),
                                            d.fused_vmem_limit_bytes),
      interpret=d.interpret,
      name="attention_bwd",
      cost_estimate=tiles.cost("bwd", q, d),
  )(vis.q_index, vis.q_count, vis.q_kind, rows.window, *args)
  return dq, dk, dv


def _dq_kernel(kv_index, kv_count, kv_kind, window, q_ref, k_ref, v_ref, qv_ref, kv_ref,
               do_ref, lse_ref, delta_ref, dq_ref, acc_sc, *, d: TileDims):
  b, qi, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  row = b * d.nq + qi
  kj = kv_index[row * d.nk + j]

  @pl.when(j == 0)
  def _init():
    acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

  def visit(ok):
    k, v = k_ref[0, 0], v_ref[0, 0]
    if d.ragged_k:
      k, v = tiles.real_rows(k, d.bk, kj, d), tiles.real_rows(v, d.bk, kj, d)
    _, ds = tiles.grad_tile(q_ref[0, 0], k, v, do_ref[0, 0], lse_ref[0, 0],
                            delta_ref[0, 0], ok, d)
    # [bk, bq] x [bk, K] contracted over bk -> [bq, K]
    acc_sc[...] += jax.lax.dot_general(ds.astype(k.dtype), k, (((0,), (0,)), ((), ())),
                                       preferred_element_type=F32)

  tiles.when_visited(j < kv_count[row], kv_kind[row * d.nk + j], visit, qi, kj, qv_ref[0],
                     kv_ref[0], window[0], d, keys_down=True)

  @pl.when(j == d.nk - 1)
  def _finish():
    dq_ref[0, 0] = (acc_sc[...] * d.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_index, q_count, q_kind, window, q_ref, k_ref, v_ref, qv_ref, kv_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, d: TileDims):
  b, kj, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
  col = b * d.nk + kj
  qi = q_index[col * d.nq + i]

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

  def visit(ok):
    q, do = q_ref[0, 0], do_ref[0, 0]
    if d.ragged_q:
      q, do = tiles.real_rows(q, d.bq, qi, d), tiles.real_rows(do, d.bq, qi, d)
    p, ds = tiles.grad_tile(q, k_ref[0, 0], v_ref[0, 0], do, lse_ref[0, 0],
                            delta_ref[0, 0], ok, d)
    dv_sc[...] += jnp.dot(p.astype(do.dtype), do, preferred_element_type=F32)
    dk_sc[...] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=F32)

  tiles.when_visited(i < q_count[col], q_kind[col * d.nq + i], visit, qi, kj, qv_ref[0],
                     kv_ref[0], window[0], d, keys_down=True)

  @pl.when((g == d.groups - 1) & (i == d.nq - 1))
  def _finish():
    dk_ref[0, 0] = (dk_sc[...] * d.dk_scale).astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)


def _split(d: TileDims, q, k, v, rows, do, lse, delta):
  """`(dq, dk, dv)` by two kernels: dq walking key blocks, dk/dv walking query blocks."""
  B, H, T, K = q.shape
  KV = k.shape[1]
  vis = rows.visits
  args = (q, k, v, rows.q_rows, rows.k_cols, do, lse, delta)

  kv_block = lambda b, h, qi, j, idx, *_: idx[(b * d.nq + qi) * d.nk + j]
  q_tile = lambda b, h, qi, j, *_: (b, h, qi, 0)
  q_stat = lambda b, h, qi, j, *_: (b, h, 0, qi)
  kv_tile = lambda b, h, qi, j, *s: (b, h // d.groups, kv_block(b, h, qi, j, *s), 0)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, d=d),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(B, H, d.nq, d.nk),
          in_specs=[pl.BlockSpec((1, 1, d.bq, K), q_tile),
                    pl.BlockSpec((1, 1, d.bk, K), kv_tile),
                    pl.BlockSpec((1, 1, d.bk, K), kv_tile),
                    pl.BlockSpec((1, 3, d.bq), lambda b, h, qi, j, *_: (b, 0, qi)),
                    pl.BlockSpec((1, d.bk, 3), lambda b, h, qi, j, *s: (
                        b, kv_block(b, h, qi, j, *s), 0)),
                    pl.BlockSpec((1, 1, d.bq, K), q_tile),
                    pl.BlockSpec((1, 1, 1, d.bq), q_stat),
                    pl.BlockSpec((1, 1, 1, d.bq), q_stat)],
          out_specs=pl.BlockSpec((1, 1, d.bq, K), q_tile),
          scratch_shapes=[pltpu.VMEM((d.bq, K), F32)]),
      out_shape=out_struct(q.shape, q.dtype, *args),
      compiler_params=tiles.compiler_params(d, ("parallel", "parallel", "parallel", "arbitrary")),
      interpret=d.interpret,
      name="attention_dq",
      cost_estimate=tiles.cost("dq", q, d),
  )(vis.kv_index, vis.kv_count, vis.kv_kind, rows.window, *args)

  grid, in_specs, k_tile = _group_walk(d, B, KV, K)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, d=d),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=grid, in_specs=in_specs,
          out_specs=[pl.BlockSpec((1, 1, d.bk, K), k_tile)] * 2,
          scratch_shapes=[pltpu.VMEM((d.bk, K), F32)] * 2),
      out_shape=[out_struct(k.shape, k.dtype, *args), out_struct(v.shape, v.dtype, *args)],
      compiler_params=tiles.compiler_params(d, ("parallel", "parallel", "parallel", "arbitrary",
                                  "arbitrary")),
      interpret=d.interpret,
      name="attention_dkv",
      cost_estimate=tiles.cost("dkv", q, d),
  )(vis.q_index, vis.q_count, vis.q_kind, rows.window, *args)
  return dq, dk, dv


def backward(d: TileDims, q, k, v, rows, o, lse, do):
  """`(dq, dk, dv)` in their operands' dtypes from the forward's out and lse (`[B, H, 1,
  T]` float32), by the plan `d.fused_backward` names; `rows` the kernels' `Rows`."""
  delta = jnp.sum(o.astype(F32) * do.astype(F32), axis=-1)[:, :, None, :]  # [B, H, 1, T]
  q = tiles.prescale(q, d)  # dq is still the original q's: its kernels scale it
  return (_fused if d.fused_backward else _split)(d, q, k, v, rows, do, lse, delta)
