"""Tiles of the log-prob kernels: `BlockSizes`, its VMEM footprint, the defaults chosen
from it per TPU generation, and the kernels' cost estimate."""

import dataclasses

import jax.numpy as jnp
from jax.experimental import pallas as pl

from tunix_kernels import tpu
from tunix_kernels.dispatch import LANES

SUBLANES = 8
# Preferred (block_n, block_v), largest first; each is tried with the whole hidden size
# before the hidden size is split. Fewer, larger tiles mean fewer re-reads of the
# operand the inner grid axis walks (the weight per token block, and the hidden states
# per vocabulary block once D is split).
_CANDIDATES = ((512, 1024), (512, 512), (256, 512), (256, 256), (128, 256), (128, 128),
               (64, 128), (16, 128))


def _round_up(x, m):
  return -(-x // m) * m


def _sublanes(dtype):
  return 16 if jnp.dtype(dtype).itemsize == 2 else SUBLANES


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the log-prob kernels (`tunix_kernels.LogprobsBlockSizes`), checked on construction.

  Attributes:
    block_n: tokens per tile, a multiple of 8 (16 for 2-byte inputs, `check`).
    block_v: vocabulary columns per tile, a multiple of 128.
    block_d: hidden units per tile, a multiple of 128 dividing D, or None for all of D.
    vmem_limit_bytes: the kernels' scoped VMEM limit, or None for the compiler's default
      (16 MiB on v4, v5e and v5p; 32 MiB on v6e).
  """

  block_n: int
  block_v: int
  block_d: int | None = None
  vmem_limit_bytes: int | None = None

  def __post_init__(self):
    for name, multiple in (("block_n", SUBLANES), ("block_v", LANES), ("block_d", LANES)):
      value = getattr(self, name)
      if name == "block_d" and value is None:
        continue
      if not isinstance(value, int) or value <= 0 or value % multiple:
        raise ValueError(f"BlockSizes.{name}={value!r} must be a positive multiple of "
                         f"{multiple}")
    if self.vmem_limit_bytes is not None and (
        not isinstance(self.vmem_limit_bytes, int) or self.vmem_limit_bytes <= 0):
      raise ValueError(f"BlockSizes.vmem_limit_bytes={self.vmem_limit_bytes!r} must be a "
                       "positive int or None")

  @classmethod
  def get_default(cls, d_model, dtype=jnp.bfloat16, chip=None, *, num_tokens=None,
                  vocab_size=None) -> "BlockSizes":
    """The largest tiles whose VMEM footprint (`vmem_bytes`) fits the chip.

    Args:
      d_model: hidden size D.
      dtype: dtype of the hidden states and weight.
      chip: a TPU generation (`tunix_kernels.tpu.CHIPS` name or `Chip`), or None when unknown:
        then the tiles fit the smallest default scoped VMEM of any generation (16 MiB)
        and `vmem_limit_bytes` stays None, so the kernels compile everywhere. A known
        chip may get larger tiles with the limit raised, never past its VMEM.
      num_tokens, vocab_size: N and V when known; tiles never exceed them (rounded up to
        the TPU tiling), so small problems get small grids.

    Never raises for a valid D and dtype: when no tiles fit (a huge D, or one without a
    divisor that is a multiple of 128) it returns the smallest, unchecked.
    """
    chip = None if chip is None else tpu.get_chip(chip)
    scoped = tpu.MIN_SCOPED_VMEM_BYTES if chip is None else chip.scoped_vmem_bytes
    budget = int((scoped if chip is None else max(scoped, chip.vmem_bytes // 2))
                 * tpu.VMEM_HEADROOM)
    n_cap = _round_up(num_tokens, _sublanes(dtype)) if num_tokens else None
    v_cap = _round_up(vocab_size, LANES) if vocab_size else None
    # Hidden blocks: multiples of 128 that divide D, largest first (none for D = 2880).
    splits = [None] + [bd for bd in range(d_model // LANES * LANES, 0, -LANES)
                       if d_model % bd == 0 and bd < d_model]
    for min_block_d in (512, LANES):  # rather smaller tiles than a sliver of D
      for bn, bv in _CANDIDATES:
        bn, bv = min(bn, n_cap or bn), min(bv, v_cap or bv)
        for bd in splits:
          if bd is not None and bd < min(min_block_d, d_model):
            break
          bs = cls(bn, bv, bd)
          need = bs.vmem_bytes(d_model, dtype)
          if need <= budget:
            limit = None if need <= scoped * tpu.VMEM_HEADROOM else _round_up(
                int(need / tpu.VMEM_HEADROOM), 1 << 20)
            return dataclasses.replace(bs, vmem_limit_bytes=limit)
    # Nothing fits (a huge D, or one without a divisor that is a multiple of 128): the
    # smallest tiles, so tracing never fails; the compiler has the last word.
    return cls(_sublanes(dtype), LANES, splits[-1])

  def vmem_bytes(self, d_model, dtype) -> int:
    """VMEM the largest of the three kernels needs: double-buffered input and output
    tiles, scratch, and the float32 tile temporaries of the softmax and matmuls."""
    s = jnp.dtype(dtype).itemsize
    bn, bv = self.block_n, self.block_v
    bd = d_model if self.block_d is None else self.block_d
    stats = bn * LANES * 4                  # one lane-replicated f32 (or int32) row tile
    tiles = 2 * (bn * bd + bd * bv) * s     # hidden and weight, double-buffered
    logits = bn * bv * 4                    # the logit accumulator
    temps = 4 * bn * bv * 4                 # exp, onehot, select, cast of a logit tile
    fwd = tiles + 2 * stats + 4 * stats + 3 * stats + logits + temps
    common = tiles + 2 * 3 * stats + logits + bn * bv * s + temps
    dh = common + 2 * bn * d_model * s + bn * d_model * 4 + bn * bd * 4 + bd * bv * s
    acc = d_model * bv * 4 if s != 4 else 0  # a float32 d_weight accumulates in place
    dw = common + 2 * d_model * bv * s + acc + bd * bv * 4 + bn * bd * s
    return max(fwd, dh, dw)

  def check(self, d_model, dtype, chip=None) -> None:
    """Raises ValueError naming the problem unless these tiles suit D, the dtype and the
    VMEM they may use: `vmem_limit_bytes` (at most the chip's VMEM when `chip` is
    known), else the default scoped VMEM of `chip`, or of the smallest chip."""
    if self.block_n % _sublanes(dtype):
      raise ValueError(f"BlockSizes.block_n={self.block_n} must be a positive multiple of "
                       f"{_sublanes(dtype)} for {jnp.dtype(dtype).name} inputs")
    if self.block_d is not None and d_model % self.block_d:
      raise ValueError(f"BlockSizes.block_d={self.block_d} must divide the hidden size "
                       f"D={d_model}")
    tpu.check_vmem(self.vmem_bytes(d_model, dtype), self.vmem_limit_bytes, chip,
                   str(self), f"D={d_model} {jnp.dtype(dtype).name}",
                   "use smaller blocks, a block_d, or "
                   "BlockSizes.get_default(d_model, dtype, chip)")


def cost_estimate(kernel, hidden, weight, bs, softcap=None) -> pl.CostEstimate:
  """What `kernel` ("fwd", "dhidden" or "dweight") costs on `hidden [N, D]` and
  `weight [D, V]` (arrays or `jax.ShapeDtypeStruct`s) with tiles `bs`.

  Flops: the forward is one `2 N D V` matmul; each backward kernel recomputes the logits
  and does one more matmul, `4 N D V`. Transcendentals: one exp per logit (plus, in the
  forward, one rescale per row and vocabulary block), and one tanh per logit with a
  `softcap`. Bytes: Pallas fetches an input
  block again whenever its block index changes between grid steps, so the operand the
  inner axes walk is re-read once per outer block (and twice, once per phase, where
  the backward walks it in both); targets are int32 `[N]`, the row statistics (`lse`,
  the cotangent) f32 `[N, 128]`; outputs are written once.
  """
  (n, d), v = hidden.shape, weight.shape[1]
  nb, vb = pl.cdiv(n, bs.block_n), pl.cdiv(v, bs.block_v)
  split = bs.block_d is not None and bs.block_d < d
  h, w = n * d * hidden.dtype.itemsize, d * v * weight.dtype.itemsize
  targets, stats = n * 4, n * LANES * 4
  per_logit = n * v * (1 if softcap is None else 2)
  # An operand walked by the inner axes is fetched once in all when those axes have a
  # single block (its block index then never changes).
  w_again = nb if split or vb > 1 else 1
  if kernel == "fwd":  # grid (N, V, D)
    h_reads = vb * h if split else h
    return pl.CostEstimate(flops=2 * n * d * v, transcendentals=per_logit + n * vb,
                           bytes_accessed=h_reads + w_again * w + targets + 2 * stats)
  if kernel == "dhidden":  # grid (N, V, steps): reads lse and g, writes d_hidden
    h_reads, w_reads = (vb * h, 2 * nb * w) if split else (h, w_again * w)
    return pl.CostEstimate(flops=4 * n * d * v, transcendentals=per_logit,
                           bytes_accessed=h_reads + w_reads + targets + 2 * stats + h)
  if kernel == "dweight":  # grid (V, N, steps): token-indexed inputs re-read per vocab block
    rows_again = vb if split or nb > 1 else 1
    h_reads, w_reads = (2 * vb * h, nb * w) if split else (rows_again * h, w)
    return pl.CostEstimate(
        flops=4 * n * d * v, transcendentals=per_logit,
        bytes_accessed=h_reads + w_reads + rows_again * (targets + 2 * stats) + w)
  raise ValueError(f"unknown log-prob kernel {kernel!r}")
