"""Pallas TPU flash attention over the trainer's rows: shared prompts, packed pairs,
windows and soft-caps, with fully masked tiles skipped.

Layout: heads first, `q, dO, out [B, H, T, K]`, `k, v [B, KV, T, K]`; query head h reads
key/value head `h // (H / KV)` through its index map, so K/V are never repeated in HBM.
The visibility rule is evaluated per tile from int32 row vectors, never from a `[T, T]`
mask: segment, branch and rope position of each query, and of each key (a padding
key's segment is `NO_KEY`), as columns `[B, T, 3]` for the side that runs down a tile
and rows `[B, 3, T]` for the side that runs across it (`Rows`). A query sees a
key at or before it in the row, of its segment, of branch 0 or of its own branch, and
less than `window` rope positions back.

Skipping: the kernels take `attention_visits.Visits` by scalar prefetch. The innermost
grid axis walks a query block's list of visible key blocks (forward, dq), or a key
block's list of query blocks (dk/dv); past the end of the list the index map repeats the
last block (Pallas does not fetch a block again when its index does not change) and the
body is skipped, so an invisible tile is neither loaded nor computed. A tile visible
everywhere runs without a mask, a diagonal tile of one sequence and branch with the
causal comparison alone (`Visits.kv_kind`, `q_kind`; `tiles.when_visited`). Where the
scale is a power of two q enters the kernels multiplied by it (`tiles.prescale`).

Ragged `T`: the last tiles run past the row; their rows hold whatever the DMA left
there and are masked (scores) or zeroed (operands a matmul contracts over) inside the
kernels. Softmax statistics are float32; the forward saves the log-sum-exp as rows
`[B, H, 1, T]` (a `[T, 1]` column would take 128 lanes per entry in HBM). This module is
the forward (`attention_fwd`) and the op; `attention.backward` holds the backward's
kernels.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tunix_kernels.attention import backward as attention_backward
from tunix_kernels.attention import visits as attention_visits
from tunix_kernels.attention import tiles as tiles
from tunix_kernels.attention.tiles import F32
from tunix_kernels.common import MASK_VALUE
from tunix_kernels.attention.tiles import TileDims
from tunix_kernels.common import cotangent_for
from tunix_kernels.common import out_struct
from tunix_kernels.dispatch import LANES


class Rows(NamedTuple):
  """The int32 inputs besides q, k, v: the row vectors (segment, branch, rope position;
  a padding key's segment is `NO_KEY`) as columns `[B, T, 3]` and as rows `[B, 3, T]`
  for each orientation of a tile, the effective window `[1]`, and the visits."""
  q_cols: jax.Array
  k_rows: jax.Array
  q_rows: jax.Array
  k_cols: jax.Array
  window: jax.Array
  visits: attention_visits.Visits


def _fwd_kernel(kv_index, kv_count, kv_kind, window, q_ref, k_ref, v_ref, qv_ref, kv_ref,
                o_ref, lse_ref, m_sc, l_sc, acc_sc, *, d: TileDims):
  b, qi, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  row = b * d.nq + qi
  kj = kv_index[row * d.nk + j]

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, F32)
    l_sc[...] = jnp.zeros(l_sc.shape, F32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, F32)

  def visit(ok):
    s, _ = tiles.scores(q_ref[0, 0], k_ref[0, 0], d)
    m_old = m_sc[...]                                                   # [bq, 128]
    m_new = jnp.maximum(m_old, jnp.max(tiles.keep(ok, s, MASK_VALUE), axis=1, keepdims=True))
    p = tiles.keep(ok, jnp.exp(s - m_new[:, :1]), 0.0)
    alpha = jnp.exp(m_old - m_new)
    l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
    m_sc[...] = m_new
    v = v_ref[0, 0]
    if d.ragged_k:
      v = tiles.real_rows(v, d.bk, kj, d)
    acc_sc[...] = acc_sc[...] * alpha[:, :1] + jnp.dot(
        p.astype(v.dtype), v, preferred_element_type=F32)

  tiles.when_visited(j < kv_count[row], kv_kind[row * d.nk + j], visit, qi, kj,
                     qv_ref[0], kv_ref[0], window[0], d)

  @pl.when(j == d.nk - 1)
  def _finish():
    l = l_sc[:, :1]
    seen = l > 0  # a query that sees no key (a padding query) returns 0
    o_ref[0, 0] = jnp.where(seen, acc_sc[...] / jnp.where(seen, l, 1.0), 0.0
                            ).astype(o_ref.dtype)
    lse = jnp.where(seen, m_sc[...] + jnp.log(jnp.where(seen, l_sc[...], 1.0)), 0.0)
    lse_ref[0, 0] = jnp.transpose(lse)[0:1, :]  # [bq, 128] lane-replicated -> a row


def rows(segments, branches, positions, valid, window_1, bq: int, bk: int) -> Rows:
  """The kernels' `Rows` from the `[B, T]` int32 segment, branch, rope-position and
  validity vectors and the effective window `[1]` (`attention_visits.NO_WINDOW`: none)."""
  q_vectors, k_vectors = attention_visits.row_vectors(segments, branches, positions, valid)
  cols = lambda x: jnp.swapaxes(x, 1, 2)
  return Rows(q_cols=cols(q_vectors), k_rows=k_vectors, q_rows=q_vectors,
              k_cols=cols(k_vectors), window=window_1,
              visits=attention_visits.visits(segments, branches, positions, valid,
                                             window_1[0], bq, bk))


def forward(d: TileDims, q, k, v, rows: Rows):
  """`(out [B, H, T, K] in q's dtype, lse [B, H, 1, T] float32)`."""
  B, H, T, K = q.shape
  q = tiles.prescale(q, d)
  vis = rows.visits
  kv_block = lambda b, h, qi, j, idx, *_: idx[(b * d.nq + qi) * d.nk + j]
  q_spec = pl.BlockSpec((1, 1, d.bq, K), lambda b, h, qi, j, *_: (b, h, qi, 0))
  kv_spec = pl.BlockSpec((1, 1, d.bk, K), lambda b, h, qi, j, *s: (
      b, h // d.groups, kv_block(b, h, qi, j, *s), 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4, grid=(B, H, d.nq, d.nk),
      in_specs=[q_spec, kv_spec, kv_spec,
                pl.BlockSpec((1, d.bq, 3), lambda b, h, qi, j, *_: (b, qi, 0)),
                pl.BlockSpec((1, 3, d.bk), lambda b, h, qi, j, *s: (
                    b, 0, kv_block(b, h, qi, j, *s)))],
      out_specs=[q_spec, pl.BlockSpec((1, 1, 1, d.bq), lambda b, h, qi, j, *_: (b, h, 0, qi))],
      scratch_shapes=[pltpu.VMEM((d.bq, LANES), F32)] * 2 + [pltpu.VMEM((d.bq, K), F32)])
  return pl.pallas_call(
      functools.partial(_fwd_kernel, d=d),
      grid_spec=grid_spec,
      out_shape=[out_struct(q.shape, q.dtype, q, k, v), out_struct((B, H, 1, T), F32, q, k, v)],
      compiler_params=tiles.compiler_params(d, ("parallel", "parallel", "parallel", "arbitrary")),
      interpret=d.interpret,
      name="attention_fwd",
      cost_estimate=tiles.cost("fwd", q, d),
  )(vis.kv_index, vis.kv_count, vis.kv_kind, rows.window, q, k, v, rows.q_cols, rows.k_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash_attention(d: TileDims, q_BxHxTxK, k_BxVxTxK, v_BxVxTxK, rows: Rows):
  """`[B, H, T, K]` attention out in the dtype of q; differentiable in q, k, v (the
  int32 `rows` get no cotangent)."""
  return forward(d, q_BxHxTxK, k_BxVxTxK, v_BxVxTxK, rows)[0]


def _fwd(d, q, k, v, rows):
  o, lse = tiles.residuals(*forward(d, q, k, v, rows))
  return o, (q, k, v, rows, o, lse)


def _bwd(d, res, do):
  q, k, v, rows, o, lse = res
  dq, dk, dv = attention_backward.backward(d, q, k, v, rows, o, lse, do)
  return (cotangent_for(dq, q), cotangent_for(dk, k), cotangent_for(dv, v), None)


flash_attention.defvjp(_fwd, _bwd)
