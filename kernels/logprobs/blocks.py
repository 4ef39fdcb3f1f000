"""Tiles of the log-prob kernels: `BlockSizes`, its VMEM footprint, the defaults chosen
from it per TPU generation, and the kernels' cost estimate."""

import dataclasses
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tunix_kernels import common
from tunix_kernels import tpu
from tunix_kernels import tuned
from tunix_kernels.dispatch import LANES

SUBLANES = 8
# Preferred forward (block_n, block_v), largest first. The forward keeps tokens outer,
# so the weight is re-read once per token block: block_n buys its roofline (v6e needs
# about 560 flops per HBM byte, 2 x block_n here).
_CANDIDATES = ((1024, 512), (512, 1024), (512, 512), (256, 512), (256, 256), (128, 256),
               (128, 128), (64, 128), (16, 128))
# Preferred fused-backward (block_n, block_v): it keeps the vocabulary outer, so the
# hidden states and the float32 d_hidden partials move once per vocabulary block and
# block_v buys its roofline; 256 tokens keep the d_weight matmul's contraction as deep
# as a v6e MXU.
_BACKWARD_CANDIDATES = ((256, 2048), (256, 1024), (128, 1024), (256, 512), (128, 512),
                        (128, 256), (128, 128), (64, 128), (16, 128))


# Tiles measured on a chip, one file per generation (`benchmarks/tune_tiles.py logprobs`
# writes them; package data): `{"entries": [{"d_model", "dtype", "num_tokens",
# "vocab_size", "block_n", "block_v", "block_n_bwd", "block_v_bwd", ...}]}`.
TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
# The head the tiles are chosen for when the caller does not know N or V.
_TYPICAL_N, _TYPICAL_V = 8192, 128256


def _sublanes(dtype):
  return 16 if jnp.dtype(dtype).itemsize == 2 else SUBLANES


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the log-prob kernels (`tunix_kernels.LogprobsBlockSizes`), checked on construction.

  Attributes:
    block_n: tokens per forward tile, a multiple of 8 (16 for 2-byte inputs, `check`).
    block_v: vocabulary columns per forward tile, a multiple of 128.
    block_d: hidden units per tile, a multiple of 128 dividing D, or None for all of D.
      None selects the fused backward (one logit recompute, `logprobs_fused_bwd`); a
      split D runs the forward and the two split backward kernels on these three tiles.
    vmem_limit_bytes: the kernels' scoped VMEM limit, or None for the compiler's default
      (16 MiB on v4, v5e and v5p; 32 MiB on v6e).
    block_n_bwd, block_v_bwd: the fused backward's tiles (whole D); None: the forward's.
  """

  block_n: int
  block_v: int
  block_d: int | None = None
  vmem_limit_bytes: int | None = None
  block_n_bwd: int | None = None
  block_v_bwd: int | None = None

  def __post_init__(self):
    for name, multiple in (("block_n", SUBLANES), ("block_v", LANES), ("block_d", LANES),
                           ("block_n_bwd", SUBLANES), ("block_v_bwd", LANES)):
      value = getattr(self, name)
      if value is not None or name in ("block_n", "block_v"):
        common.check_block(name, value, multiple)
    common.check_vmem_limit(self.vmem_limit_bytes)

  @property
  def fused(self) -> bool:
    """Whether the backward is the fused kernel (whole D) rather than the split pair."""
    return self.block_d is None

  @property
  def backward_tiles(self) -> tuple[int, int]:
    """(block_n, block_v) of the fused backward."""
    return self.block_n_bwd or self.block_n, self.block_v_bwd or self.block_v

  @classmethod
  def get_default(cls, d_model, dtype=jnp.bfloat16, chip=None, *, num_tokens=None,
                  vocab_size=None, measured=True) -> "BlockSizes":
    """The fused tiles measured fastest on `chip`'s generation for D and the dtype at the
    nearest measured vocabulary (`tuned_tiles`) where they fit, else the largest tiles
    whose VMEM footprint (`vmem_bytes`) fits the chip: whole-D forward and
    fused-backward tiles when both fit, else split-D tiles for all kernels.

    Args:
      d_model: hidden size D.
      dtype: dtype of the hidden states and weight.
      chip: a TPU generation (`tunix_kernels.tpu.CHIPS` name or `Chip`), or None when unknown:
        then the tiles fit the smallest default scoped VMEM of any generation (16 MiB)
        and `vmem_limit_bytes` stays None, so the kernels compile everywhere. A known
        chip may get larger tiles with the limit raised, up to `VMEM_HEADROOM` of its VMEM.
      num_tokens, vocab_size: N and V when known; tiles never exceed them (rounded up to
        the TPU tiling), so small problems get small grids.
      measured: read the generation's table; False: the rule alone (what the tuner
        starts from).

    Never raises for a valid D and dtype: when no tiles fit (a huge D, or one without a
    divisor that is a multiple of 128) it returns the smallest, unchecked.
    """
    chip = None if chip is None else tpu.get_chip(chip)
    scoped = tpu.MIN_SCOPED_VMEM_BYTES if chip is None else chip.scoped_vmem_bytes
    budget = int((scoped if chip is None else max(scoped, chip.vmem_bytes))
                 * tpu.VMEM_HEADROOM)
    n_cap = common.round_up(num_tokens, _sublanes(dtype)) if num_tokens else None
    v_cap = common.round_up(vocab_size, LANES) if vocab_size else None
    capped = lambda bn, bv: (min(bn, n_cap or bn), min(bv, v_cap or bv))

    from_table = measured and chip and tuned_tiles(chip.name, d_model, dtype, vocab_size)
    if from_table:  # measured fastest on this generation, where they fit
      bs = cls(*capped(*from_table[:2]), None, None, *capped(*from_table[2:]))
      if bs.vmem_bytes(d_model, dtype) <= budget:
        return bs.raised(d_model, dtype, chip)
    s = jnp.dtype(dtype).itemsize
    fwd = next((capped(*c) for c in _CANDIDATES
                if _fwd_vmem(*capped(*c), d_model, s) <= budget), None)
    bwd = next((capped(*c) for c in _BACKWARD_CANDIDATES
                if _fused_vmem(*capped(*c), d_model, s) <= budget), None)
    fused = cls(*fwd, None, None, *bwd) if fwd and bwd else None
    # Hidden blocks: multiples of 128 that divide D, largest first (none for D = 2880).
    splits = [bd for bd in range(d_model // LANES * LANES, 0, -LANES)
              if d_model % bd == 0 and bd < d_model]
    split = next((cls(*capped(*c), bd)
                  for min_block_d in (512, LANES)  # rather smaller tiles than a sliver of D
                  for c in _CANDIDATES for bd in splits if bd >= min(min_block_d, d_model)
                  if _split_vmem(*capped(*c), bd, d_model, s) <= budget), None)
    plans = [bs for bs in (fused, split) if bs is not None]
    if not plans:
      # Nothing fits (a huge D, or one without a divisor that is a multiple of 128):
      # the smallest tiles, so tracing never fails; the compiler has the last word.
      return cls(_sublanes(dtype), LANES, splits[-1] if splits else None)
    if chip is None:  # the fused backward's fewer flops, wherever it fits
      return plans[0].raised(d_model, dtype, chip)
    # On a small VMEM (v4) the fused backward's narrow vocabulary tiles can cost more
    # HBM time than the split kernels' extra recompute: the faster on the roofline wins.
    shape = (num_tokens or _TYPICAL_N, d_model, vocab_size or _TYPICAL_V)
    return min(plans, key=lambda bs: roofline_seconds(bs, *shape, dtype, chip)).raised(
        d_model, dtype, chip)

  def raised(self, d_model, dtype, chip=None) -> "BlockSizes":
    """These tiles with `vmem_limit_bytes` as far past `chip`'s default scoped VMEM (a
    `tpu.Chip`, or None for the smallest generation's) as they need, None within it."""
    scoped = tpu.MIN_SCOPED_VMEM_BYTES if chip is None else chip.scoped_vmem_bytes
    need = self.vmem_bytes(d_model, dtype)
    limit = None if need <= scoped * tpu.VMEM_HEADROOM else common.round_up(
        int(need / tpu.VMEM_HEADROOM), 1 << 20)
    if limit and chip is not None:
      limit = min(limit, chip.vmem_bytes)
    return dataclasses.replace(self, vmem_limit_bytes=limit)

  def vmem_bytes(self, d_model, dtype) -> int:
    """VMEM the largest of the kernels these tiles run needs (`_fwd_vmem`,
    `_fused_vmem`, `_split_vmem`)."""
    s = jnp.dtype(dtype).itemsize
    if self.fused:
      return max(_fwd_vmem(self.block_n, self.block_v, d_model, s),
                 _fused_vmem(*self.backward_tiles, d_model, s))
    return _split_vmem(self.block_n, self.block_v, self.block_d, d_model, s)

  def check(self, d_model, dtype, chip=None) -> None:
    """Raises ValueError naming the problem unless these tiles suit D, the dtype and the
    VMEM they may use: `vmem_limit_bytes` (at most the chip's VMEM when `chip` is
    known), else the default scoped VMEM of `chip`, or of the smallest chip."""
    for name in ("block_n", "block_n_bwd"):
      value = getattr(self, name)
      if value is not None and value % _sublanes(dtype):
        raise ValueError(f"BlockSizes.{name}={value} must be a positive multiple of "
                         f"{_sublanes(dtype)} for {jnp.dtype(dtype).name} inputs")
    if self.block_d is not None and d_model % self.block_d:
      raise ValueError(f"BlockSizes.block_d={self.block_d} must divide the hidden size "
                       f"D={d_model}")
    tpu.check_vmem(self.vmem_bytes(d_model, dtype), self.vmem_limit_bytes, chip,
                   str(self), f"D={d_model} {jnp.dtype(dtype).name}",
                   "use smaller blocks, a block_d, or "
                   "BlockSizes.get_default(d_model, dtype, chip)")


def tuned_tiles(chip_name: str, d_model: int, dtype, vocab_size: int | None
                ) -> tuple[int, int, int, int] | None:
  """`(block_n, block_v, block_n_bwd, block_v_bwd)` measured fastest on `chip_name` for
  `d_model` and `dtype` at the vocabulary nearest `vocab_size` (`tuned.nearest`: within
  2x; the largest measured when it is None), or None where the table has no such entry."""
  best = tuned.lookup(TUNED_DIR, chip_name, "vocab_size", vocab_size, d_model=d_model,
                      dtype=jnp.dtype(dtype).name)
  return None if best is None else tuple(
      best[k] for k in ("block_n", "block_v", "block_n_bwd", "block_v_bwd"))


def roofline_seconds(bs, n, d, v, dtype, chip) -> float:
  """Forward + backward time of tiles `bs` on `hidden [n, d] @ weight [d, v]` on `chip`
  (a `tpu.Chip` or name) by the roofline: each kernel takes the longer of its flops at
  the bf16 peak and its bytes at the HBM bandwidth (`cost_estimate`)."""
  chip = tpu.get_chip(chip)
  h, w = jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype)
  kernels = ("fwd", "bwd") if bs.fused else ("fwd", "dhidden", "dweight")
  costs = [cost_estimate(k, h, w, bs, cores=chip.cores) for k in kernels]
  return sum(max(c.flops / chip.peak_flops, c.bytes_accessed / chip.hbm_bandwidth)
             for c in costs)


def used_cores(cores, vocab_blocks):
  """The TensorCores the fused backward uses: each takes `cdiv(blocks, cores)` vocabulary
  blocks in turn, and a core left without one is not used."""
  return pl.cdiv(vocab_blocks, pl.cdiv(vocab_blocks, max(1, min(cores, vocab_blocks))))


def d_chunk(d):
  """The piece of D the fused backward's gradient matmuls go by (bounds their temporaries)."""
  return next((p for p in (512, 256, 128) if d % p == 0), d)


def _lanes(d):
  """The lanes a minor dimension of `d` occupies in VMEM: whole vregs of 128 (D = 576
  takes 640)."""
  return common.round_up(d, LANES)


def _stats(bn):
  return bn * LANES * 4  # one lane-replicated (or lane-padded) f32 or int32 row tile


def _fwd_vmem(bn, bv, d, s, bd=None):
  """Forward: double-buffered hidden and weight tiles, row statistics in and out and in
  scratch, the logit accumulator and the float32 temporaries of the softmax. D is
  counted in whole 128-lane vregs (`_lanes`), as a `[bn, D]` tile occupies VMEM."""
  bd = _lanes(d) if bd is None else bd
  tiles = 2 * (bn * bd + bd * bv) * s
  return tiles + 9 * _stats(bn) + bn * bv * 4 + 4 * bn * bv * 4


def _fused_vmem(bn, bv, d, s):
  """Fused backward: double-buffered hidden `[bn, D]` and weight `[D, bv]` tiles, the
  float32 d_weight accumulator and its staging copy, two float32 d_hidden slots, the
  row statistics, the logit tile's float32 temporaries and one chunk of each gradient
  matmul (D in whole lanes)."""
  chunk, d = d_chunk(d), _lanes(d)
  tiles = 2 * (bn * d + d * bv) * s
  return (tiles + d * bv * (4 + s) + 2 * bn * d * 4 + 2 * _stats(bn) + 6 * bn * bv * 4
          + bn * bv * s + chunk * (bv + bn) * (4 + s))


def _split_vmem(bn, bv, bd, d, s):
  """The split kernels (forward, d_hidden, d_weight) over hidden blocks of `bd` (D in
  whole lanes)."""
  d = _lanes(d)
  tiles = 2 * (bn * bd + bd * bv) * s
  logits, temps = bn * bv * 4, 4 * bn * bv * 4
  common = tiles + 6 * _stats(bn) + logits + bn * bv * s + temps
  dh = common + 2 * bn * d * s + bn * d * 4 + bn * bd * 4 + bd * bv * s
  acc = d * bv * 4 if s != 4 else 0  # a float32 d_weight accumulates in place
  dw = common + 2 * d * bv * s + acc + bd * bv * 4 + bn * bd * s
  return max(_fwd_vmem(bn, bv, d, s, bd), dh, dw)


def cost_estimate(kernel, hidden, weight, bs, softcap=None, cores=1) -> pl.CostEstimate:
  """What `kernel` ("fwd", "bwd" (fused), "dhidden" or "dweight") costs on `hidden
  [N, D]` and `weight [D, V]` (arrays or `jax.ShapeDtypeStruct`s) with tiles `bs`, on a
  chip of `cores` TensorCores (each walks its share of the leading grid axis).

  Flops: a matmul is `2 N D V`; the forward does one, the fused backward three (the
  logits once, then both gradients), each split backward kernel two (it recomputes the
  logits). Transcendentals: one exp per logit (plus, in the forward, one rescale per row
  and vocabulary block), and one tanh per logit with a `softcap`. Bytes: Pallas fetches
  an input block again whenever its block index changes between a core's grid steps
  (blocks clipped to the array, a minor dimension under 128 padded to 128 lanes as HBM
  tiles lay it out), so an operand indexed by the outer axis alone is read once, and one
  the inner axes walk is read once per outer block, unless those axes have a single
  block; the targets `[N, 1]` and every row statistic take 512 bytes a row (the fused
  backward's three share one `[N, 3]` array); outputs are written once (the fused
  backward's d_weight with its columns padded to a multiple of 128), except the fused
  backward's float32 d_hidden partials, written every step and read back on each core's
  later vocabulary blocks (rows padded to whole blocks).
  """
  (n, d), v = hidden.shape, weight.shape[1]
  s = hidden.dtype.itemsize
  per_logit = n * v * (1 if softcap is None else 2)
  h, w = n * d * s, d * v * weight.dtype.itemsize
  if kernel == "bwd":  # grid (C, V blocks per core, N): token-indexed inputs per step
    bn, bv = bs.backward_tiles
    nb, vb = pl.cdiv(n, bn), pl.cdiv(v, bv)
    cores = used_cores(cores, vb)
    rows_again = vb if nb > 1 else cores
    partials = (2 * vb - cores) * nb * bn * d * 4
    dw = d * common.round_up(v, LANES) * weight.dtype.itemsize  # copied out lane-aligned
    return pl.CostEstimate(flops=6 * n * d * v, transcendentals=per_logit,
                           bytes_accessed=rows_again * (h + _stats(n)) + w + dw + partials)
  nb, vb = pl.cdiv(n, bs.block_n), pl.cdiv(v, bs.block_v)
  split = bs.block_d is not None and bs.block_d < d
  targets = stats = _stats(n)  # [N, 1] and [N, 128] alike in HBM
  # Tokens outer (fwd, dhidden): the weight is walked per token block, and once per core
  # when the inner axes hold one block.
  w_again = min(nb, cores) if not split and vb == 1 else nb
  if kernel == "fwd":  # grid (N, V, D)
    h_reads = vb * h if split else h
    return pl.CostEstimate(flops=2 * n * d * v, transcendentals=per_logit + n * vb,
                           bytes_accessed=h_reads + w_again * w + targets + 2 * stats)
  if kernel == "dhidden":  # grid (N, V, steps): reads lse and g, writes d_hidden
    h_reads, w_reads = (vb * h, 2 * nb * w) if split else (h, w_again * w)
    return pl.CostEstimate(flops=4 * n * d * v, transcendentals=per_logit,
                           bytes_accessed=h_reads + w_reads + targets + 2 * stats + h)
  if kernel == "dweight":  # grid (V, N, steps): token-indexed inputs re-read per vocab block
    rows_again = vb if split or nb > 1 else min(vb, cores)
    h_reads, w_reads = (2 * vb * h, nb * w) if split else (rows_again * h, w)
    return pl.CostEstimate(
        flops=4 * n * d * v, transcendentals=per_logit,
        bytes_accessed=h_reads + w_reads + rows_again * (targets + 2 * stats) + w)
  raise ValueError(f"unknown log-prob kernel {kernel!r}")
