"""Tiles of the attention kernels: `BlockSizes`, its VMEM footprint and the backward's
plan, the tiles measured fastest per TPU generation (`tuned/{chip}.json`), and the
kernels' cost estimate (which tiles a kernel visits: `attention.visits`)."""

import dataclasses
import itertools
import os

import jax.numpy as jnp
from jax.experimental import pallas as pl

from tunix_kernels import common
from tunix_kernels import tpu
from tunix_kernels import tuned
from tunix_kernels.dispatch import LANES

# Preferred (block_q, block_k), largest first. Larger tiles mean fewer grid steps and
# re-reads; smaller ones skip masked areas at a finer grain.
CANDIDATES = ((512, 512), (256, 512), (256, 256), (128, 256), (128, 128))
# Tiles measured on a chip, one file per generation (`benchmarks/tune_tiles.py` writes
# them; shipped as package data): `{"entries": [{"head_dim", "dtype", "seq_len",
# "block_q", "block_k", ...}]}`.
TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the attention kernels (forward and backward), checked on construction.

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
  def get_default(cls, head_dim, dtype=jnp.bfloat16, chip=None, *, seq_len=None,
                  groups=1) -> "BlockSizes":
    """The tiles measured fastest on `chip`'s generation for this head dim and dtype at
    the nearest measured row length (`tuned_tiles`; past the default scoped VMEM with
    `vmem_limit_bytes` raised, `fitting`), else the largest tiles whose VMEM
    footprint (`vmem_bytes`) fits the chip's default scoped VMEM (the smallest
    generation's, 16 MiB, when `chip` is None); never longer than `seq_len` rounded up
    to 128; `groups` query heads per key/value head (what the fused backward keeps of a
    row grows with it). Never raises for a valid head dim: when nothing fits it returns
    the smallest tiles and leaves the last word to the compiler."""
    chip = None if chip is None else tpu.get_chip(chip)
    from_table = None if chip is None else tuned_tiles(chip.name, head_dim, dtype, seq_len)
    measured = (cls.fitting(head_dim, dtype, chip, seq_len, (from_table,), raised=True,
                            groups=groups) if from_table else ())
    return next(itertools.chain(measured, cls.fitting(head_dim, dtype, chip, seq_len)),
                cls(LANES, LANES))

  @classmethod
  def fitting(cls, head_dim, dtype, chip, seq_len=None, candidates=CANDIDATES, *,
              raised=False, groups=1):
    """Each of `candidates` (`(block_q, block_k)`, in order), capped at `seq_len`
    rounded up to 128, whose VMEM footprint fits `chip`'s default scoped VMEM (a
    `tpu.Chip`; None: the smallest generation's). With `raised` and a known chip, tiles
    that fit only the chip's whole VMEM come too, their `vmem_limit_bytes` raised as far
    as they need, and as far as the fused backward needs on rows of `seq_len` with
    `groups` query heads per key/value head where it fits (`backward_plan` then keeps it
    fused; the whole VMEM when `seq_len` is None)."""
    scoped = tpu.MIN_SCOPED_VMEM_BYTES if chip is None else chip.scoped_vmem_bytes
    cap = common.round_up(seq_len, LANES) if seq_len else None
    for bq, bk in candidates:
      bs = cls(min(bq, cap or bq), min(bk, cap or bk))
      need = bs.vmem_bytes(head_dim, dtype)
      if need <= scoped * tpu.VMEM_HEADROOM:
        yield bs
      elif raised and chip is not None and need <= chip.vmem_bytes * tpu.VMEM_HEADROOM:
        # Rows of unknown length: the whole VMEM, so no row's fused backward is refused.
        fused = (bs.fused_backward_bytes(head_dim, dtype, seq_len, groups) if seq_len
                 else chip.vmem_bytes * tpu.VMEM_HEADROOM)
        if fused <= chip.vmem_bytes * tpu.VMEM_HEADROOM:
          need = max(need, fused)
        limit = common.round_up(int(need / tpu.VMEM_HEADROOM), 1 << 20)
        yield dataclasses.replace(bs, vmem_limit_bytes=min(limit, chip.vmem_bytes))

  def tiles(self, seq_len: int) -> tuple[int, int]:
    """`(bq, bk)` for rows of `seq_len` tokens: a row shorter than 128 is one tile."""
    if seq_len < LANES:
      return seq_len, seq_len
    return self.block_q, self.block_k

  def vmem_bytes(self, head_dim, dtype) -> int:
    """VMEM the largest of the forward, dq and dk/dv kernels needs (the fused backward
    adds a row's dq: `fused_backward_bytes`): double-buffered tiles of q, k, v
    (and dO, dq, dk, dv), the row vectors (padded to whole vregs), float32 accumulators
    and statistics, and about six float32 `[bq, bk]` temporaries. A tile's minor
    dimension occupies whole 128-lane vregs: a head dim of 64 takes as much VMEM as 128."""
    s, K = jnp.dtype(dtype).itemsize, lane_padded(head_dim)
    bq, bk = self.block_q, self.block_k
    q_rows = bq * K * s                       # a q, dO, out or dq tile
    k_rows = bk * K * s                       # a k, v, dk or dv tile
    vectors = bq * LANES * 4 + 8 * bk * 4     # q-side `[bq, 3]`, k-side `[3, bk]`
    column = bq * LANES * 4                   # lse or delta `[bq, 1]`
    temps = 6 * bq * bk * 4
    fwd = 2 * (2 * q_rows + 2 * k_rows + vectors + column) + 2 * column + bq * K * 4
    dq = 2 * (3 * q_rows + 2 * k_rows + vectors + 2 * column) + bq * K * 4
    dkv = 2 * (2 * q_rows + 4 * k_rows + vectors + 2 * column) + 2 * bk * K * 4
    return max(fwd, dq, dkv) + temps

  def fused_backward_bytes(self, head_dim, dtype, seq_len, groups=1) -> int:
    """VMEM of the fused backward kernel on rows of `seq_len` with `groups` query heads
    per key/value head: the kernels' tiles (`vmem_bytes`) and the whole row's dq of
    every head of a group, its float32 accumulator and its output block
    (double-buffered), the head dim padded to whole lanes (`lane_padded`)."""
    rows, s = common.round_up(seq_len, self.block_q), jnp.dtype(dtype).itemsize
    K = lane_padded(head_dim)
    return self.vmem_bytes(head_dim, dtype) + groups * (rows * K * 4 + 2 * rows * K * s)

  def backward_plan(self, head_dim, dtype, seq_len, chip, groups=1
                    ) -> tuple[bool, int | None]:
    """`(fused, vmem_limit_bytes)` of the backward on rows of `seq_len` with `groups`
    query heads per key/value head for `chip` (a
    `tpu.Chip` or None: unknown). Room: `vmem_limit_bytes` when set, else the chip's
    VMEM (the smallest generation's default scoped VMEM when the chip is unknown).
    Fused where `fused_backward` says so or, when it is None, where its bytes
    (`fused_backward_bytes`) fit the room, the limit raised past the default scoped VMEM
    only as far as they need; split otherwise. ValueError when `fused_backward=True`
    cannot fit the room."""
    need = self.fused_backward_bytes(head_dim, dtype, seq_len, groups)
    room = self.vmem_limit_bytes or (tpu.MIN_SCOPED_VMEM_BYTES if chip is None
                                     else chip.vmem_bytes)
    fits = need <= room * tpu.VMEM_HEADROOM
    if self.fused_backward and not fits:
      raise ValueError(f"{self} needs about {need / 2**20:.1f} MiB of VMEM for the fused "
                       f"backward of {seq_len}-token rows (head_dim={head_dim}), more than "
                       f"{tpu.VMEM_HEADROOM:.0%} of {room / 2**20:.0f} MiB: set "
                       "fused_backward=None or False")
    fused = fits if self.fused_backward is None else self.fused_backward
    scoped = tpu.MIN_SCOPED_VMEM_BYTES if chip is None else chip.scoped_vmem_bytes
    if not fused or self.vmem_limit_bytes or need <= scoped * tpu.VMEM_HEADROOM:
      return fused, self.vmem_limit_bytes
    return fused, min(int(need / tpu.VMEM_HEADROOM) + (1 << 20), chip.vmem_bytes)

  def check(self, head_dim, dtype, chip=None) -> None:
    """Raises ValueError unless these tiles fit `vmem_limit_bytes` (at most the chip's
    VMEM when `chip` is known), else the default scoped VMEM of `chip`, or of the
    smallest generation."""
    tpu.check_vmem(self.vmem_bytes(head_dim, dtype), self.vmem_limit_bytes, chip,
                   str(self), f"head_dim={head_dim} {jnp.dtype(dtype).name}",
                   "use smaller blocks or BlockSizes.get_default(head_dim, dtype, chip)")


def lane_padded(head_dim: int) -> int:
  """The lanes a tile's minor dimension of `head_dim` occupies in VMEM: whole vregs of 128."""
  return common.round_up(head_dim, LANES)


def tuned_tiles(chip_name: str, head_dim: int, dtype, seq_len: int | None
                ) -> tuple[int, int] | None:
  """`(block_q, block_k)` measured fastest on `chip_name` for `head_dim` and `dtype` at
  the row length nearest `seq_len` (`tuned.nearest`: within 2x; the longest measured
  when `seq_len` is None), or None where the table has no such entry."""
  best = tuned.lookup(TUNED_DIR, chip_name, "seq_len", seq_len, head_dim=head_dim,
                      dtype=jnp.dtype(dtype).name)
  return None if best is None else (best["block_q"], best["block_k"])


def causal_tiles(seq_len, bq, bk) -> int:
  """Tiles on or below the diagonal of one head: the most a causal row visits (the
  cost estimate's count; tiles skipped for segments, branches and windows are only
  known when the kernel runs)."""
  nq = pl.cdiv(seq_len, bq)
  return sum(min(pl.cdiv(min(seq_len, (i + 1) * bq), bk), pl.cdiv(seq_len, bk))
             for i in range(nq))


def cost_estimate(kernel, batch, heads, seq_len, head_dim, dtype, bq, bk, softcap,
                  groups=1) -> pl.CostEstimate:
  """What `kernel` ("fwd", "dq", "dkv" or the fused backward "bwd") costs for `heads`
  query heads (`groups` per key/value head) of `batch` rows: per visited tile the
  forward does two `bq x bk x K` matmuls, dq three, dk/dv four and "bwd" five; one exp
  per score (and a tanh with a soft-cap). Bytes: the query-side tiles once per head, the
  key-side tiles once per visited tile (the walks over key blocks, a group's heads
  inside: the other way round, k, v, dk and dv once per key/value head)."""
  tiles = batch * heads * causal_tiles(seq_len, bq, bk)
  matmuls = {"fwd": 2, "dq": 3, "dkv": 4, "bwd": 5}[kernel]
  s = jnp.dtype(dtype).itemsize
  scores = tiles * bq * bk
  q_side = batch * heads * seq_len * head_dim * s * {"fwd": 2, "dq": 3}.get(kernel, 0)
  k_side = tiles * bk * head_dim * s * 2
  if kernel in ("dkv", "bwd"):  # k, v read once; q and dO walked per visited tile
    q_side = tiles * bq * head_dim * s * 2
    k_side = batch * heads // groups * seq_len * head_dim * s * 4
  if kernel == "bwd":  # and dq written once
    q_side += batch * heads * seq_len * head_dim * s
  return pl.CostEstimate(flops=2 * matmuls * scores * head_dim,
                         transcendentals=scores * (2 if softcap else 1),
                         bytes_accessed=q_side + k_side)
