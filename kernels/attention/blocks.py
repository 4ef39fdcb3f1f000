"""Tiles of the attention kernels: `BlockSizes` and its VMEM footprint, the tiles
measured fastest per TPU generation (`tuned/{chip}.json`), the per-row lists of the
tiles a kernel visits (which is how fully masked tiles are skipped), and the kernels'
cost estimate."""

import dataclasses
import functools
import json
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tunix_kernels import common
from tunix_kernels import tpu
from tunix_kernels.dispatch import LANES

# Preferred (block_q, block_k), largest first. Larger tiles mean fewer grid steps and
# re-reads; smaller ones skip masked areas at a finer grain.
_CANDIDATES = ((512, 512), (256, 512), (256, 256), (128, 256), (128, 128))
# Tiles measured on a chip, one file per generation (`benchmarks/tune_tiles.py` writes
# them; shipped as package data): `{"entries": [{"head_dim", "dtype", "seq_len",
# "block_q", "block_k", ...}]}`.
TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
# The segment id of padding keys in the kernels' key vectors: no query has it.
NO_KEY = int(jnp.iinfo(jnp.int32).min)
# The "window" of unwindowed layers: longer than any row.
NO_WINDOW = 1 << 30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the attention kernels (forward, dq and dk/dv), checked on construction.

  Attributes:
    block_q: queries per tile, a multiple of 128.
    block_k: keys per tile, a multiple of 128.
    vmem_limit_bytes: the kernels' scoped VMEM limit, or None for the compiler's default.
    fused_backward: the backward as one kernel that keeps a row's dq in VMEM (True), as
      separate dq and dk/dv kernels (False), or None: fused where `fused_backward_bytes`
      fit the chip's VMEM (`attention.backward`).

  Rows shorter than a tile use one tile of the whole row (`tiles`).
  """

  block_q: int = 512
  block_k: int = 512
  vmem_limit_bytes: int | None = None
  fused_backward: bool | None = None

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      common.check_block(name, getattr(self, name), LANES)
    common.check_vmem_limit(self.vmem_limit_bytes)

  @classmethod
  def get_default(cls, head_dim, dtype=jnp.bfloat16, chip=None, *, seq_len=None
                  ) -> "BlockSizes":
    """The tiles measured fastest on `chip`'s generation for this head dim and dtype at
    the nearest measured row length (`tuned_tiles`), else the largest tiles whose VMEM
    footprint (`vmem_bytes`) fits the chip's default scoped VMEM (the smallest
    generation's, 16 MiB, when `chip` is None); never longer than `seq_len` rounded up
    to 128. Never raises for a valid head dim: when nothing fits it returns the
    smallest tiles and leaves the last word to the compiler."""
    chip = None if chip is None else tpu.get_chip(chip)
    tuned = None if chip is None else tuned_tiles(chip.name, head_dim, dtype, seq_len)
    return next(cls.fitting(head_dim, dtype, chip, seq_len, ((tuned,) if tuned else ())
                            + _CANDIDATES), cls(LANES, LANES))

  @classmethod
  def fitting(cls, head_dim, dtype, chip, seq_len=None, candidates=_CANDIDATES):
    """Each of `candidates` (`(block_q, block_k)`, in order), capped at `seq_len`
    rounded up to 128, whose VMEM footprint fits `chip`'s default scoped VMEM (a
    `tpu.Chip`; None: the smallest generation's)."""
    scoped = tpu.MIN_SCOPED_VMEM_BYTES if chip is None else chip.scoped_vmem_bytes
    cap = common.round_up(seq_len, LANES) if seq_len else None
    for bq, bk in candidates:
      bs = cls(min(bq, cap or bq), min(bk, cap or bk))
      if bs.vmem_bytes(head_dim, dtype) <= scoped * tpu.VMEM_HEADROOM:
        yield bs

  def tiles(self, seq_len: int) -> tuple[int, int]:
    """`(bq, bk)` for rows of `seq_len` tokens: a row shorter than 128 is one tile."""
    if seq_len < LANES:
      return seq_len, seq_len
    return self.block_q, self.block_k

  def vmem_bytes(self, head_dim, dtype) -> int:
    """VMEM the largest of the three kernels needs: double-buffered tiles of q, k, v
    (and dO, dq, dk, dv), the row vectors (padded to whole vregs), float32 accumulators
    and statistics, and about six float32 `[bq, bk]` temporaries."""
    s, K = jnp.dtype(dtype).itemsize, head_dim
    bq, bk = self.block_q, self.block_k
    q_rows = bq * K * s                       # a q, dO, out or dq tile
    k_rows = bk * K * s                       # a k, v, dk or dv tile
    vectors = bq * LANES * 4 + 8 * bk * 4     # q-side `[bq, 3]`, k-side `[3, bk]`
    column = bq * LANES * 4                   # lse or delta `[bq, 1]`
    temps = 6 * bq * bk * 4
    fwd = 2 * (2 * q_rows + 2 * k_rows + vectors + column) + 2 * column + bq * K * 4
    dq = 2 * (3 * q_rows + 2 * k_rows + vectors + 2 * column) + bq * K * 4 + 2 * column
    dkv = 2 * (2 * q_rows + 4 * k_rows + vectors + 2 * column) + 2 * bk * K * 4
    return max(fwd, dq, dkv) + temps

  def fused_backward_bytes(self, head_dim, dtype, seq_len) -> int:
    """VMEM of the fused backward kernel on rows of `seq_len`: the kernels' tiles
    (`vmem_bytes`) and a whole row's dq, its float32 accumulator and its output block
    (double-buffered)."""
    rows = common.round_up(seq_len, self.block_q)
    return (self.vmem_bytes(head_dim, dtype) + rows * head_dim * 4
            + 2 * seq_len * head_dim * jnp.dtype(dtype).itemsize)

  def backward_plan(self, head_dim, dtype, seq_len, chip) -> tuple[bool, int | None]:
    """`(fused, vmem_limit_bytes)` of the backward on rows of `seq_len` for `chip` (a
    `tpu.Chip` or None: unknown): fused where `fused_backward` says so or, when it is
    None, where its bytes fit the chip's VMEM (the default scoped VMEM of the smallest
    generation when the chip is unknown), its limit raised above the default as far as
    it needs; split otherwise."""
    need = self.fused_backward_bytes(head_dim, dtype, seq_len)
    room = (self.vmem_limit_bytes or (tpu.MIN_SCOPED_VMEM_BYTES if chip is None
                                      else chip.vmem_bytes)) * tpu.VMEM_HEADROOM
    fused = need <= room if self.fused_backward is None else self.fused_backward
    scoped = tpu.MIN_SCOPED_VMEM_BYTES if chip is None else chip.scoped_vmem_bytes
    if not fused or self.vmem_limit_bytes or need <= scoped * tpu.VMEM_HEADROOM:
      return fused, self.vmem_limit_bytes
    return fused, min(int(need / tpu.VMEM_HEADROOM) + (1 << 20),
                      chip.vmem_bytes if chip else need * 2)

  def check(self, head_dim, dtype, chip=None) -> None:
    """Raises ValueError unless these tiles fit `vmem_limit_bytes` (at most the chip's
    VMEM when `chip` is known), else the default scoped VMEM of `chip`, or of the
    smallest generation."""
    tpu.check_vmem(self.vmem_bytes(head_dim, dtype), self.vmem_limit_bytes, chip,
                   str(self), f"head_dim={head_dim} {jnp.dtype(dtype).name}",
                   "use smaller blocks or BlockSizes.get_default(head_dim, dtype, chip)")


@functools.cache
def tuned_table(chip_name: str) -> tuple[dict, ...]:
  """The entries of `TUNED_DIR/{chip_name}.json`, () where no table is shipped."""
  path = os.path.join(TUNED_DIR, f"{chip_name}.json")
  if not os.path.exists(path):
    return ()
  with open(path, encoding="utf-8") as f:
    return tuple(json.load(f)["entries"])


def tuned_tiles(chip_name: str, head_dim: int, dtype, seq_len: int | None
                ) -> tuple[int, int] | None:
  """`(block_q, block_k)` measured fastest on `chip_name` for `head_dim` and `dtype` at
  the row length nearest `seq_len` by ratio, within 2x of it (the longest measured when
  `seq_len` is None), or None where the table has no such entry: a row length far from
  every measured one is not extrapolated to."""
  name = jnp.dtype(dtype).name
  entries = [e for e in tuned_table(chip_name)
             if e["head_dim"] == head_dim and e["dtype"] == name]
  if seq_len:
    entries = [e for e in entries if abs(math.log2(e["seq_len"] / seq_len)) <= 1]
  if not entries:
    return None
  distance = ((lambda e: -e["seq_len"]) if not seq_len
              else (lambda e: abs(math.log(e["seq_len"] / seq_len))))
  best = min(entries, key=distance)
  return best["block_q"], best["block_k"]


class Visits(NamedTuple):
  """Which tiles the kernels visit, as flat int32 arrays for scalar prefetch (SMEM).

  kv_index `[B * nq * nk]`: for query block qi of row b, the key blocks with a visible
    entry in ascending order, then the last of them repeated (a repeated block index is
    not fetched again); kv_count `[B * nq]` how many there are; kv_full `[B * nq * nk]`
    1 where the listed tile is visible everywhere (the kernels skip its mask), else 0.
    q_index `[B * nk * nq]`, q_count `[B * nk]` and q_full: the same from the key
    blocks' side (the dk/dv kernel).
  """

  kv_index: jax.Array
  kv_count: jax.Array
  kv_full: jax.Array
  q_index: jax.Array
  q_count: jax.Array
  q_full: jax.Array


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


def full_tiles(segments, branches, positions, valid, window, bq, bk) -> jax.Array:
  """`[B, nq, nk]` bool: the tiles whose every entry is visible (same arguments as
  `visible_tiles`; a conservative test: a tile it keeps is visible everywhere, one it
  drops may still be). Such a tile lies wholly inside the row, below the diagonal, in
  one segment, its keys all real and of the trunk or of its queries' one branch, and
  within the window."""
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
  below = (q_end <= T)[:, None] & (k_last < T)[None, :] & (k_last[None, :] <= q_first[:, None])
  full = below[None] & k(k_real) & q(one(q_seg)) & k(one(k_seg)) & (q(q_seg[0]) == k(k_seg[0]))
  trunk = (k(k_br[0]) == 0) & (k(k_br[1]) == 0)
  full &= trunk | (q(one(q_br)) & k(one(k_br)) & (q(q_br[0]) == k(k_br[0])))
  return full & (q(q_pos[1]) - k(k_pos[0]) < window)


def listed_flags(index, flags_BxRxC):
  """`flags` (bool `[B, R, C]`) of the tiles a `tile_lists` index lists, in its order,
  flattened int32 `[B * R * C]` (past a list's end: its last tile's)."""
  B, R, C = flags_BxRxC.shape
  return jnp.take_along_axis(flags_BxRxC, index.reshape(B, R, C), axis=-1
                             ).reshape(-1).astype(jnp.int32)


def visits(segments, branches, positions, valid, window, bq, bk) -> Visits:
  """The `Visits` lists of `visible_tiles` and `full_tiles` (same arguments), per row."""
  visible = visible_tiles(segments, branches, positions, valid, window, bq, bk)
  full = full_tiles(segments, branches, positions, valid, window, bq, bk)
  kv_index, kv_count = tile_lists(visible)
  q_index, q_count = tile_lists(jnp.swapaxes(visible, 1, 2))
  return Visits(kv_index, kv_count, listed_flags(kv_index, full),
                q_index, q_count, listed_flags(q_index, jnp.swapaxes(full, 1, 2)))


def row_vectors(segments, branches, positions, valid):
  """`(q_vectors, k_vectors)`, each `[B, 3, T]` int32: segment, branch and rope position
  of every query and key (a padding key's segment is `NO_KEY`, which no query has), the
  inputs of `attention_tiles.mask`."""
  k_segments = jnp.where(valid > 0, segments, NO_KEY)
  return (jnp.stack([segments, branches, positions], axis=1),
          jnp.stack([k_segments, branches, positions], axis=1))


def causal_tiles(seq_len, bq, bk) -> int:
  """Tiles on or below the diagonal of one head: the most a causal row visits (the
  cost estimate's count; tiles skipped for segments, branches and windows are only
  known when the kernel runs)."""
  nq = pl.cdiv(seq_len, bq)
  return sum(min(pl.cdiv(min(seq_len, (i + 1) * bq), bk), pl.cdiv(seq_len, bk))
             for i in range(nq))


def cost_estimate(kernel, batch, heads, seq_len, head_dim, dtype, bq, bk, softcap
                  ) -> pl.CostEstimate:
  """What `kernel` ("fwd", "dq", "dkv" or the fused backward "bwd") costs for `heads`
  query heads of `batch` rows: per visited tile the forward does two `bq x bk x K`
  matmuls, dq three, dk/dv four and "bwd" five; one exp per score (and a tanh with a
  soft-cap). Bytes: the query-side tiles once per head, the key-side tiles once per
  visited tile (the walks over key blocks: the other way round)."""
  tiles = batch * heads * causal_tiles(seq_len, bq, bk)
  matmuls = {"fwd": 2, "dq": 3, "dkv": 4, "bwd": 5}[kernel]
  s = jnp.dtype(dtype).itemsize
  scores = tiles * bq * bk
  q_side = batch * heads * seq_len * head_dim * s * {"fwd": 2, "dq": 3}.get(kernel, 0)
  k_side = tiles * bk * head_dim * s * 2
  if kernel in ("dkv", "bwd"):  # k, v read once; q and dO walked per visited tile
    q_side, k_side = tiles * bq * head_dim * s * 2, batch * heads * seq_len * head_dim * s * 4
  if kernel == "bwd":  # dq written once; dk, dv per query head in float32
    q_side += batch * heads * seq_len * head_dim * (s + 8)
  return pl.CostEstimate(flops=2 * matmuls * scores * head_dim,
                         transcendentals=scores * (2 if softcap else 1),
                         bytes_accessed=q_side + k_side)
