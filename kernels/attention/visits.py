"""Which tiles the attention kernels visit: per-block summaries of the `[B, T]` row
vectors give, for each tile, whether any entry is visible (`visible_tiles`: a tile
without one is skipped) and which mask a visited tile needs (`tile_kinds`: none where
every entry is visible, the causal diagonal alone where only that hides entries), and
the per-row lists of them the kernels take by scalar prefetch (`Visits`)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

# The segment id of padding keys in the kernels' key vectors: no query has it.
NO_KEY = int(jnp.iinfo(jnp.int32).min)
# The "window" of unwindowed layers: longer than any row.
NO_WINDOW = 1 << 30
# What a listed tile needs (`tile_kinds`): the whole rule evaluated per entry, nothing
# (every entry visible), or the causal comparison of row indices alone. The whole rule
# costs the vector units several operations per score; a diagonal tile of one sequence
# and branch needs only the one comparison.
MASKED, FULL, CAUSAL = 0, 1, 2


class Visits(NamedTuple):
  """Which tiles the kernels visit, as flat int32 arrays for scalar prefetch (SMEM).

  kv_index `[B * nq * nk]`: for query block qi of row b, the key blocks with a visible
    entry in ascending order, then the last of them repeated (a repeated block index is
    not fetched again); kv_count `[B * nq]` how many there are; kv_kind `[B * nq * nk]`
    the listed tile's `tile_kinds` (MASKED, FULL or CAUSAL). q_index `[B * nk * nq]`,
    q_count `[B * nk]` and q_kind: the same from the key blocks' side (the backward).
  """

  kv_index: jax.Array
  kv_count: jax.Array
  kv_kind: jax.Array
  q_index: jax.Array
  q_count: jax.Array
  q_kind: jax.Array


def _summaries(x_BxT, valid_BxT, block):
  """Min and max of `x` over the entries of each block where `valid` holds: `[B, n]`."""
  B, T = x_BxT.shape
  n = -(-T // block)
  pad = lambda a, fill: jnp.pad(a, ((0, 0), (0, n * block - T)), constant_values=fill)
  x, ok = pad(x_BxT, 0).reshape(B, n, block), pad(valid_BxT, False).reshape(B, n, block)
  big = jnp.iinfo(jnp.int32).max
  return (jnp.min(jnp.where(ok, x, big), axis=-1), jnp.max(jnp.where(ok, x, -big), axis=-1))


def tile_lists(visible_BxRxC):
  """For each `[b, r]`, the `c` with `visible[b, r, c]` ascending, padded with the last
  (0 when none), flattened `[B * R * C]`; and their counts, flattened `[B * R]`."""
  B, R, C = visible_BxRxC.shape
  cols = jnp.arange(C, dtype=jnp.int32)
  ordered = jnp.sort(jnp.where(visible_BxRxC, cols, C), axis=-1)
  count = jnp.sum(visible_BxRxC, axis=-1, dtype=jnp.int32)
  last = jnp.take_along_axis(ordered, jnp.maximum(count - 1, 0)[..., None], axis=-1)
  index = jnp.where(ordered < C, ordered, jnp.where(count[..., None] > 0, last, 0))
  return index.reshape(-1).astype(jnp.int32), count.reshape(-1)


def visible_tiles(segments, branches, positions, valid, window, bq, bk) -> jax.Array:
  """`[B, nq, nk]` bool: the tiles with at least one visible entry, from per-block
  summaries of the `[B, T]` int32 row vectors (a conservative test: a tile it keeps may
  still be all masked, one it drops never has a visible entry). `window` is the
  effective window (an int32 scalar, `NO_WINDOW` for none)."""
  B, T = valid.shape
  index = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  real, every = valid > 0, jnp.ones((B, T), bool)
  q_seg, k_seg = _summaries(segments, every, bq), _summaries(segments, real, bk)
  q_br, k_br = _summaries(branches, every, bq), _summaries(branches, real, bk)
  q_pos, k_pos = _summaries(positions, every, bq), _summaries(positions, real, bk)
  q_last = _summaries(index, every, bq)[1]
  k_first = _summaries(index, real, bk)[0]   # int32 max for a block with no real key
  k_any_trunk = _summaries(jnp.where(branches == 0, 0, 1), real, bk)[0] == 0
  q, k = (lambda a: a[:, :, None]), (lambda a: a[:, None, :])
  overlap = lambda qs, ks: (q(qs[0]) <= k(ks[1])) & (k(ks[0]) <= q(qs[1]))
  visible = (k(k_first) <= q(q_last)) & overlap(q_seg, k_seg)
  visible &= k(k_any_trunk) | overlap(q_br, k_br)
  return visible & (q(q_pos[0]) - k(k_pos[1]) < window)


def tile_kinds(segments, branches, positions, valid, window, bq, bk) -> jax.Array:
  """`[B, nq, nk]` int32: FULL for a tile whose every entry is visible, CAUSAL for one
  where only the causal rule hides entries, else MASKED (same arguments as
  `visible_tiles`; conservative: a tile marked FULL or CAUSAL is so, one marked MASKED
  may not need the whole rule). Both lie wholly inside the row, in one segment, their
  keys all real and of the trunk or of their queries' one branch, and within the
  window; a FULL tile lies below the diagonal as well."""
  B, T = valid.shape
  every = jnp.ones((B, T), bool)
  n_q, n_k = -(-T // bq), -(-T // bk)
  q_seg, k_seg = _summaries(segments, every, bq), _summaries(segments, every, bk)
  q_br, k_br = _summaries(branches, every, bq), _summaries(branches, every, bk)
  q_pos, k_pos = _summaries(positions, every, bq), _summaries(positions, every, bk)
  k_real = _summaries(valid, every, bk)[0] > 0
  q_first, q_end = jnp.arange(n_q) * bq, (jnp.arange(n_q) + 1) * bq
  k_last = (jnp.arange(n_k) + 1) * bk - 1
  q, k = (lambda a: a[:, :, None]), (lambda a: a[:, None, :])
  one = lambda mm: mm[0] == mm[1]
  inside = ((q_end <= T)[:, None] & (k_last < T)[None, :])[None]
  below = (k_last[None, :] <= q_first[:, None])[None]
  causal = inside & k(k_real) & q(one(q_seg)) & k(one(k_seg)) & (q(q_seg[0]) == k(k_seg[0]))
  trunk = (k(k_br[0]) == 0) & (k(k_br[1]) == 0)
  causal &= trunk | (q(one(q_br)) & k(one(k_br)) & (q(q_br[0]) == k(k_br[0])))
  causal &= q(q_pos[1]) - k(k_pos[0]) < window
  return jnp.where(causal, jnp.where(below, FULL, CAUSAL), MASKED).astype(jnp.int32)


def listed_kinds(index, kinds_BxRxC):
  """`kinds` (int32 `[B, R, C]`) of the tiles a `tile_lists` index lists, in its order,
  flattened `[B * R * C]` (past a list's end: its last tile's)."""
  B, R, C = kinds_BxRxC.shape
  return jnp.take_along_axis(kinds_BxRxC, index.reshape(B, R, C), axis=-1).reshape(-1)


def visits(segments, branches, positions, valid, window, bq, bk) -> Visits:
  """The `Visits` lists of `visible_tiles` and `tile_kinds` (same arguments), per row."""
  visible = visible_tiles(segments, branches, positions, valid, window, bq, bk)
  kinds = tile_kinds(segments, branches, positions, valid, window, bq, bk)
  kv_index, kv_count = tile_lists(visible)
  q_index, q_count = tile_lists(jnp.swapaxes(visible, 1, 2))
  return Visits(kv_index, kv_count, listed_kinds(kv_index, kinds),
                q_index, q_count, listed_kinds(q_index, jnp.swapaxes(kinds, 1, 2)))


def row_vectors(segments, branches, positions, valid):
  """`(q_vectors, k_vectors)`, each `[B, 3, T]` int32: segment, branch and rope position
  of every query and key (a padding key's segment is `NO_KEY`, which no query has), the
  inputs of `attention_tiles.mask`."""
  k_segments = jnp.where(valid > 0, segments, NO_KEY)
  return (jnp.stack([segments, branches, positions], axis=1),
          jnp.stack([k_segments, branches, positions], axis=1))
