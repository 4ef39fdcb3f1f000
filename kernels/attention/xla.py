"""Blockwise attention in XLA, the path off TPU: O(T) memory for every row layout.

Flash attention written with XLA loops rather than a kernel: the forward walks, for
each block of `bq` queries, the blocks of `bk` keys with anything visible (an online
softmax over them) and saves only the output and the float32 log-sum-exp per query; the
backward (a custom VJP) walks, for each key block, the query blocks that see it and
recomputes each tile's probabilities. No array of the call is quadratic in the row:
the largest temporaries are one tile's float32 `[B, KV, G, bq, bk]` scores.

Which tiles are walked is one list for the whole batch (`attention_visits.visible_tiles`
of any row), so each tile is one batched matmul; the `Visibility` rule masks entries
within it. A causal row walks the tiles on and below the diagonal; prefix-shared rows
skip a rejected branch's tiles against the chosen one; packed rows and windows skip
everything outside their sequences' and windows' reach.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tunix_kernels.attention import visits as attention_visits
from tunix_kernels.attention import tiles as attention_tiles

_FILL = -1e30  # a masked score: finite, so a query that sees nothing stays free of NaN


class BlockwiseDims(NamedTuple):
  """Static shape of one call: tiles `bq x bk` over rows padded to `t`."""
  t: int
  bq: int
  bk: int
  scale: float
  softcap: float


def tiles(seq_len: int, block_q: int, block_k: int) -> tuple[int, int, int]:
  """`(bq, bk, padded length)`: a row no longer than a block is one tile of the row."""
  if seq_len <= max(block_q, block_k):
    return seq_len, seq_len, seq_len
  step = math.lcm(block_q, block_k)
  return block_q, block_k, -(-seq_len // step) * step


def _block(x, start, size, axis):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _tile(d: BlockwiseDims, rule, q_i, k_j, i, j):
  """Scores of query block i against key block j: `(s, allowed, t)`, s float32 `[B, KV,
  G, bq, bk]` soft-capped and masked, t the soft-cap's tanh (for its derivative)."""
  s = jnp.einsum("bvgqk,bvsk->bvgqs", q_i, k_j, preferred_element_type=jnp.float32)
  s = s * d.scale
  t = None
  if d.softcap:
    t = jnp.tanh(s / d.softcap)
    s = d.softcap * t
  allowed = rule(i, j)[:, None, None]
  return jnp.where(allowed, s, _FILL), allowed, t


def _rule(d: BlockwiseDims, vectors):
  """`rule(i, j)`: `[B, bq, bk]` bool, the `Visibility` rule on tile (i, j): the Pallas
  kernels' own mask (`attention_tiles.mask`), row by row."""
  *rows, window = vectors
  q_vectors, k_vectors = attention_visits.row_vectors(*rows)
  q_cols = jnp.swapaxes(q_vectors, 1, 2)  # [B, t, 3]
  tile = attention_tiles.TileDims(t=d.t, bq=d.bq, bk=d.bk, nq=d.t // d.bq, nk=d.t // d.bk,
                              groups=1, scale=d.scale, softcap=d.softcap, windowed=True,
                              vmem_limit_bytes=None, interpret=False)

  def rule(i, j):
    mask = lambda qv, kv: attention_tiles.mask(i, j, qv, kv, window, tile)
    return jax.vmap(mask)(_block(q_cols, i * d.bq, d.bq, 1),
                          _block(k_vectors, j * d.bk, d.bk, 2))
  return rule


def _loop(n: int, body, carry):
  """`fori_loop(0, n, body, carry)`, or the body itself for one block (a row that is one
  tile, as in most CPU tests, compiles without loops)."""
  return body(0, carry) if n == 1 else jax.lax.fori_loop(0, n, body, carry)


def _walk(lists, which, block, n: int, body, carry):
  """`body(listed, carry)` for each block `lists` lists for `block` (`which`: 0 for the
  key blocks of a query block, 2 for the query blocks of a key block; lists of `n`)."""
  if lists is None:  # one tile: walk it (all masked is fine: it adds nothing)
    return body(0, carry)
  index = _block(lists[which], block * n, n, 0)
  return jax.lax.fori_loop(0, lists[which + 1][block], lambda m, c: body(index[m], c),
                           carry)


def _forward(d: BlockwiseDims, q, k, v, vectors, lists):
  nk = d.t // d.bk
  B, KV, G, _, K = q.shape
  rule = _rule(d, vectors)

  def query_block(i, carry):
    out, lse = carry
    q_i = _block(q, i * d.bq, d.bq, 3)

    def key_block(j, acc):
      m, l, o = acc
      s, allowed, _ = _tile(d, rule, q_i, _block(k, j * d.bk, d.bk, 2), i, j)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
      rescale = jnp.exp(m - m_new)
      o = o * rescale[..., None] + jnp.einsum("bvgqs,bvsk->bvgqk", p.astype(v.dtype),
                                              _block(v, j * d.bk, d.bk, 2),
                                              preferred_element_type=jnp.float32)
      return m_new, l * rescale + jnp.sum(p, axis=-1), o

    stats = jnp.full((B, KV, G, d.bq), _FILL, jnp.float32)
    m, l, o = _walk(lists, 0, i, nk, key_block,
                    (stats, jnp.zeros_like(stats), jnp.zeros((B, KV, G, d.bq, K), jnp.float32)))
    seen = l > 0  # a query that sees no key (padding) returns 0, as in the kernels
    o = o / jnp.where(seen, l, 1.0)[..., None]
    out = jax.lax.dynamic_update_slice_in_dim(out, o.astype(q.dtype), i * d.bq, 3)
    lse = jax.lax.dynamic_update_slice_in_dim(lse, jnp.where(seen, m + jnp.log(l), 0.0),
                                              i * d.bq, 3)
    return out, lse

  return _loop(d.t // d.bq, query_block,
               (jnp.zeros_like(q), jnp.zeros(q.shape[:4], jnp.float32)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def blockwise(d: BlockwiseDims, q, k, v, vectors, lists):
  """Attention of heads-first `q [B, KV, G, t, K]` over `k, v [B, KV, t, K]`: the
  output in q's dtype; differentiable in q, k, v. `vectors`: the `[B, t]` segments,
  branches, positions and valid of the rule and the effective window (an int32 scalar);
  `lists`: the tile lists `attention_visits.tile_lists` gives for the batch's visible
  tiles `[1, nq, nk]` (kv_index, kv_count) and their transpose (q_index, q_count), or
  None for a row of one tile."""
  return _forward(d, q, k, v, vectors, lists)[0]


def _blockwise_fwd(d, q, k, v, vectors, lists):
  out, lse = attention_tiles.residuals(*_forward(d, q, k, v, vectors, lists))
  return out, (q, k, v, vectors, lists, out, lse)


def _blockwise_bwd(d, residuals, do):
  q, k, v, vectors, lists, out, lse = residuals
  nq = d.t // d.bq
  rule = _rule(d, vectors)
  # delta = rowsum(dO * O): the softmax's backward term per query.
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

  def key_block(j, carry):
    dq, dk, dv = carry
    k_j, v_j = _block(k, j * d.bk, d.bk, 2), _block(v, j * d.bk, d.bk, 2)

    def query_block(i, acc):
      dq, dk_j, dv_j = acc
      q_i, do_i = _block(q, i * d.bq, d.bq, 3), _block(do, i * d.bq, d.bq, 3)
      s, allowed, t = _tile(d, rule, q_i, k_j, i, j)
      p = jnp.where(allowed, jnp.exp(s - _block(lse, i * d.bq, d.bq, 3)[..., None]), 0.0)
      dv_j += jnp.einsum("bvgqs,bvgqk->bvsk", p.astype(do.dtype), do_i,
                         preferred_element_type=jnp.float32)
      dp = jnp.einsum("bvgqk,bvsk->bvgqs", do_i, v_j, preferred_element_type=jnp.float32)
      ds = p * (dp - _block(delta, i * d.bq, d.bq, 3)[..., None])
      if d.softcap:
        ds = ds * (1.0 - t * t)
      ds = (ds * d.scale).astype(q.dtype)
      dq_i = _block(dq, i * d.bq, d.bq, 3) + jnp.einsum(
          "bvgqs,bvsk->bvgqk", ds, k_j, preferred_element_type=jnp.float32)
      dk_j += jnp.einsum("bvgqs,bvgqk->bvsk", ds, q_i, preferred_element_type=jnp.float32)
      return jax.lax.dynamic_update_slice_in_dim(dq, dq_i, i * d.bq, 3), dk_j, dv_j

    zeros = jnp.zeros(k_j.shape, jnp.float32)
    dq, dk_j, dv_j = _walk(lists, 2, j, nq, query_block, (dq, zeros, zeros))
    put = lambda x, x_j: jax.lax.dynamic_update_slice_in_dim(x, x_j.astype(x.dtype),
                                                             j * d.bk, 2)
    return dq, put(dk, dk_j), put(dv, dv_j)

  dq, dk, dv = _loop(
      d.t // d.bk, key_block,
      (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k), jnp.zeros_like(v)))
  return dq.astype(q.dtype), dk, dv, None, None


blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def xla_attention(q_BxTxHxK, k_BxTxVxK, v_BxTxVxK, vectors, *, scale: float,
                  softcap: float, block_q: int, block_k: int):
  """`[B, T, H, K]` in q's dtype; differentiable in q, k, v. `vectors`: the `[B, T]`
  int32 segments, branches, positions and valid of the `Visibility` rule (zeros for no
  segments or branches) and the effective window (an int32 scalar, `NO_WINDOW` for
  none). Rows are padded to whole tiles of `block_q x block_k` (`tiles`)."""
  B, T, H, K = q_BxTxHxK.shape
  KV = k_BxTxVxK.shape[2]
  bq, bk, t = tiles(T, block_q, block_k)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, t - T)] + [(0, 0)] * (x.ndim - 2))
  *rows, window = vectors
  rows = [pad(x) for x in rows]   # padded keys are not valid: never attended
  lists = None
  if t > bq or t > bk:
    visible = attention_visits.visible_tiles(*rows, window, bq, bk).any(axis=0)[None]
    lists = (*attention_visits.tile_lists(visible),
             *attention_visits.tile_lists(jnp.swapaxes(visible, 1, 2)))
  q = jnp.moveaxis(pad(q_BxTxHxK).reshape(B, t, KV, H // KV, K), 1, 3)
  k, v = (jnp.moveaxis(pad(x), 1, 2) for x in (k_BxTxVxK, v_BxTxVxK))
  d = BlockwiseDims(t=t, bq=bq, bk=bk, scale=float(scale), softcap=float(softcap))
  out = blockwise(d, q, k, v, (*rows, window), lists)
  return jnp.moveaxis(out, 3, 1).reshape(B, t, H, K)[:, :T]
