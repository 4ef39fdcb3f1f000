"""Causal grouped-query attention over the rows the trainer builds: `attention` and its
two paths, the Pallas TPU kernels (`tunix_kernels.attention.pallas`) and a blockwise XLA
path (`tunix_kernels.attention.xla`).

Both take `q [B, T, H, K]`, `k, v [B, T, KV, K]` (H a multiple of KV). Which keys a query
sees is a `Visibility`: the keys at or before it in the row that are real tokens, of its
own segment (packed rows: `tunix_core.data.packing`), of the shared trunk (branch 0) or
its own response branch (prefix sharing: a rejected response never sees the chosen
one), and within the sliding window on rope positions. Both paths evaluate that rule
per tile from the `[B, T]` row vectors, skip tiles with nothing visible and never hold
a `[T, T]` array. Under `impl="auto"` the kernels run whenever the computation is
compiled for TPU, for every row layout, window and soft-cap, and the XLA path
everywhere else (GPU, CPU).

The package is the op; its modules are the blockwise XLA path (`xla`), the Pallas TPU
kernels (`pallas`), the math of one tile (`tiles`), the tiles and VMEM model (`blocks`)
and the GSPMD rule (`gspmd`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tunix_kernels.attention import visits as attention_visits
from tunix_kernels.attention import gspmd as attention_gspmd
from tunix_kernels.attention import pallas as attention_pallas
from tunix_kernels.attention import tiles as attention_tiles
from tunix_kernels.attention import xla as attention_xla
from tunix_kernels import common
from tunix_kernels import dispatch
# Not `gspmd`: the package's own `gspmd` submodule owns that name in this namespace.
from tunix_kernels import gspmd as gspmd_lib
from tunix_kernels import naive
from tunix_kernels import tpu
from tunix_kernels.attention.blocks import BlockSizes
from tunix_kernels.attention.tiles import INPUTS
from tunix_kernels.attention.tiles import RESIDUALS

# Bytes of one call's visit list (int32 per tile and row) in the 1 MiB of scalar memory
# (SMEM) the kernels prefetch it into; a batch with longer lists runs in several calls.
_SMEM_LIST_BYTES = 256 << 10


class Visibility(NamedTuple):
  """Which keys each query of a row may attend (all arrays `[B, T]` int32).

  positions: rope positions; sliding windows are measured on them.
  valid: 1 for real tokens, 0 for padding (never attended).
  segments: None, or ids of packed sequences: a query sees keys of its own id only.
  branches: None, or 0 for tokens every query of the segment may see and b > 0 for a
    response branch: a key of branch b is seen only by queries of branch b.
  band: static; None, or a bound on how far back (in row positions) any query looks
    (packed rows: their longest sequence), for FLOP counts; both paths find the tiles
    within reach from the row vectors themselves.
  """

  positions: jax.Array
  valid: jax.Array
  segments: jax.Array | None = None
  branches: jax.Array | None = None
  band: int | None = None


def attention(q_BxTxHxK, k_BxTxVxK, v_BxTxVxK, vis: Visibility, *, scale: float,
              softcap: float = 0.0, window=0, impl: str = "auto",
              block_sizes: BlockSizes | None = None):
  """Attention of each query over the keys `vis` lets it see: `[B, T, H, K]` in the
  dtype of q; differentiable in q, k, v (float32 softmax statistics either way).

  Args:
    q_BxTxHxK, k_BxTxVxK, v_BxTxVxK: bf16 or f32 of one dtype; H a multiple of KV.
    vis: the `Visibility` rule's `[B, T]` int32 row vectors.
    scale: multiplies the scores (`query_pre_attn_scalar ** -0.5` or `K ** -0.5`).
    softcap: 0, or c > 0: scores become `c * tanh(scores / c)` before masking (Gemma 2).
    window: 0 (none), or a positive int (a traced int32 scalar is allowed: a scanned
      layer's own window, 0 for a full-attention layer): keys that many rope positions
      back or more are hidden.
    impl: one of `tunix_kernels.IMPLS`: "pallas" (Mosaic TPU kernels), "interpret" (the
      same kernels in TPU interpret mode, for CPU tests), "xla" (blockwise,
      `tunix_kernels.attention.xla`), "naive" (the oracle: whole `[T, T]` scores,
      `tunix_kernels.naive.attention_naive`), or "auto" (pallas when compiled for TPU,
      else xla).
    block_sizes: tiles of the kernels; None picks `BlockSizes.get_default` for the TPU
      generation being compiled for (`tunix_kernels.tpu.target_chip`), fitting every
      generation's default VMEM when that is unknown. Explicit tiles that cannot fit are
      a ValueError. "xla" takes its tiles from them too (None: 512 x 512).

  Under plain `jax.jit` (outside any `shard_map`) the kernels partition over the
  operands' shardings (`tunix_kernels.attention.gspmd`): rows and KV heads stay split, the
  sequence and head dimension are gathered; see docs/embedding.md.
  """
  impl = dispatch.resolve_impl("attention", impl)
  B, T, H, K = q_BxTxHxK.shape
  KV = k_BxTxVxK.shape[2]
  if k_BxTxVxK.shape != (B, T, KV, K) or v_BxTxVxK.shape != k_BxTxVxK.shape or H % KV:
    raise ValueError(f"attention takes q [B, T, H, K] and k, v [B, T, KV, K] with H a "
                     f"multiple of KV; got {q_BxTxHxK.shape}, {k_BxTxVxK.shape}, "
                     f"{v_BxTxVxK.shape}")
  if not softcap >= 0:
    raise ValueError(f"softcap must be >= 0, got {softcap!r}")
  if not q_BxTxHxK.dtype == k_BxTxVxK.dtype == v_BxTxVxK.dtype:
    raise ValueError(f"the attention kernels take q, k and v of one dtype, got "
                     f"{q_BxTxHxK.dtype}, {k_BxTxVxK.dtype}, {v_BxTxVxK.dtype}")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a tunix_kernels.attention.BlockSizes, got "
                    f"{block_sizes!r}")
  zeros = jnp.zeros((B, T), jnp.int32)
  segments = zeros if vis.segments is None else vis.segments.astype(jnp.int32)
  branches = zeros if vis.branches is None else vis.branches.astype(jnp.int32)
  positions, valid = vis.positions.astype(jnp.int32), vis.valid.astype(jnp.int32)
  windowed = not (isinstance(window, int) and window == 0)
  window_1 = jnp.reshape(jnp.where(jnp.asarray(window) > 0, window,
                                   attention_visits.NO_WINDOW).astype(jnp.int32), (1,))
  vectors = (segments, branches, positions, valid, window_1)
  if impl == "naive":
    return naive.attention_naive(q_BxTxHxK, k_BxTxVxK, v_BxTxVxK, *vectors[:4], window_1[0],
                                 scale=scale, softcap=softcap)
  if impl == "xla":
    bs = block_sizes or BlockSizes()
    return attention_xla.xla_attention(q_BxTxHxK, k_BxTxVxK, v_BxTxVxK,
                                       (*vectors[:4], window_1[0]), scale=scale,
                                       softcap=softcap, block_q=bs.block_q,
                                       block_k=bs.block_k)
  chip = tpu.target_chip()
  bs = block_sizes or BlockSizes.get_default(K, q_BxTxHxK.dtype, chip, seq_len=T,
                                             groups=H // KV)
  if block_sizes is not None:
    bs.check(K, q_BxTxHxK.dtype, chip)
  bq, bk = bs.tiles(T)
  nq, nk = -(-T // bq), -(-T // bk)
  if nq * nk * 4 > _SMEM_LIST_BYTES:
    raise ValueError(f"rows of {T} tokens in {bq} x {bk} tiles make visit lists of "
                     f"{nq * nk * 4} bytes per row, more than the kernels keep in scalar "
                     f"memory ({_SMEM_LIST_BYTES}); use larger tiles")
  rows_per_call = _SMEM_LIST_BYTES // (nq * nk * 4)
  if B > rows_per_call:  # the visit lists of every row must fit the 1 MiB of SMEM
    part = lambda x, i: None if x is None else x[i:i + rows_per_call]
    return jnp.concatenate([attention(
        q_BxTxHxK[i:i + rows_per_call], k_BxTxVxK[i:i + rows_per_call],
        v_BxTxVxK[i:i + rows_per_call], Visibility(*(part(x, i) for x in vis[:4]), vis.band),
        scale=scale, softcap=softcap, window=window, impl=impl, block_sizes=block_sizes)
        for i in range(0, B, rows_per_call)], axis=0)
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, H, K] <-> [B, H, T, K]
  q, k, v = (checkpoint_name(heads_first(x), INPUTS)
             for x in (q_BxTxHxK, k_BxTxVxK, v_BxTxVxK))

  fused, fused_limit = bs.backward_plan(K, q_BxTxHxK.dtype, T, chip, H // KV)

  def run(interpret):
    d = attention_tiles.TileDims(t=T, bq=bq, bk=bk, nq=nq, nk=nk,
                             groups=H // KV, scale=float(scale), softcap=float(softcap),
                             windowed=windowed, vmem_limit_bytes=bs.vmem_limit_bytes,
                             interpret=interpret, fused_backward=fused,
                             fused_vmem_limit_bytes=fused_limit)
    if gspmd_lib.in_manual_context():
      return attention_pallas.flash_attention(
          d, q, k, v, attention_pallas.rows(*vectors, bq, bk))
    # Partitioned over the operands' shardings; interpret mode here is Pallas' generic
    # interpreter (custom partitioning cannot carry the TPU interpreter's callbacks).
    return attention_gspmd.flash_attention(d._replace(interpret=bool(interpret)), q, k, v,
                                           vectors)

  out = run(False) if impl == "pallas" else common.call_interpret(run)
  return heads_first(out)

