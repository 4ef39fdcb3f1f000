"""Causal grouped-query attention over padded or packed rows: an XLA path and, on TPU,
the Pallas flash-attention kernels that ship with JAX (forward and backward never build
the `[T, T]` scores).

Both take `q [B, T, H, K]`, `k, v [B, T, KV, K]` (H a multiple of KV). Which keys a query
sees is a `Visibility`: the keys at or before it in the row that are real tokens, of its
own segment (packed rows: `tunix_core.data.packing`), not of another response branch (prefix
sharing: a rejected response never sees the chosen one), and within the sliding window
on rope positions. The flash path expresses padding as segment ids (real tokens 1,
padding 0, or the packed rows' own segment ids): real queries then see exactly the real
keys at or before them in their segment, as on the XLA path; padding queries see other
padding instead of real keys, and their outputs are never used. Sliding windows, score
soft-caps (Mistral, Gemma 2) and response branches are not in the flash kernel: those,
rows whose length is not a multiple of 128, and every non-TPU platform take the XLA path
under `impl="auto"`.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

from kernels import dispatch

ATTENTION_IMPLS = ("auto", "xla", "pallas")
_BLOCK = 128  # the flash kernels' default tiles; also the XLA path's query blocks


class Visibility(NamedTuple):
  """Which keys each query of a row may attend (all arrays `[B, T]` int32).

  positions: rope positions; sliding windows are measured on them.
  valid: 1 for real tokens, 0 for padding (never attended).
  segments: None, or ids of packed sequences: a query sees keys of its own id only.
  branches: None, or 0 for tokens every query of the segment may see and b > 0 for a
    response branch: a key of branch b is seen only by queries of branch b.
  band: static; None, or a bound on how far back (in row positions) any query looks,
    so the XLA path scores each block of queries against the keys that window reaches
    instead of the whole row (packed rows are long; their sequences are short).
  """

  positions: jax.Array
  valid: jax.Array
  segments: jax.Array | None = None
  branches: jax.Array | None = None
  band: int | None = None


def flash_supported(seq_len: int, window: bool, softcap: float, branches: bool = False
                    ) -> bool:
  """Whether the flash kernels compute this attention exactly."""
  return seq_len % _BLOCK == 0 and not window and not softcap and not branches


def resolve(impl: str, seq_len: int, window: bool, softcap: float, branches: bool = False
            ) -> str:
  """`impl` checked, with "auto" -> "pallas" on TPU when `flash_supported`, else "xla"."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; choose one of {ATTENTION_IMPLS}")
  supported = flash_supported(seq_len, window, softcap, branches)
  if impl == "auto":
    return "pallas" if dispatch.target_platform() == "tpu" and supported else "xla"
  if impl == "pallas" and not supported:
    raise ValueError(f"the flash kernels need rows of a multiple of {_BLOCK} tokens "
                     f"(got {seq_len}) and no sliding window, score soft-cap or response "
                     f"branches (--prefix_sharing)")
  return impl


def _windows(x_BxT, left: int, block: int, fill=0):
  """`[B, T, ...]` -> `[B, nb, left + block, ...]`: for each block of `block` row
  positions, the `left` positions before it and the block itself (`fill` outside the
  row; nb = ceil(T / block))."""
  B, T = x_BxT.shape[:2]
  nb = -(-T // block)
  pad = [(0, 0), (left, nb * block - T)] + [(0, 0)] * (x_BxT.ndim - 2)
  x = jnp.pad(x_BxT, pad, constant_values=fill)
  x = x.reshape((B, nb + left // block, block) + x_BxT.shape[2:])
  return jnp.concatenate([x[:, s:s + nb] for s in range(left // block + 1)], axis=2)


def xla_attention(q_BxTxHxK, k_BxTxVxK, v_BxTxVxK, vis: Visibility, scale: float,
                  softcap: float = 0.0, window=0):
  """The XLA path: `[B, T, H * K]` in the dtype of `q`; differentiable in q, k, v.

  Scores are float32 and soft-capped (`softcap`, 0: none) before masking; `window`
  (a scalar, may be traced; 0: none) hides keys that many positions back or more.
  Without `vis.band` (or a band that spans the row) every query is scored against the
  whole row; with it, against the keys of its block and the band before.
  """
  B, T, H, K = q_BxTxHxK.shape
  KV = k_BxTxVxK.shape[2]
  if vis.band is None or vis.band >= T or T <= _BLOCK:
    block, left = T, 0
  else:
    block = _BLOCK
    left = -(-(vis.band - 1) // block) * block
  q = _windows(q_BxTxHxK, 0, block).reshape(B, -1, block, KV, H // KV, K)
  k, v = _windows(k_BxTxVxK, left, block), _windows(v_BxTxVxK, left, block)
  index_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  on_q = lambda x: _windows(x, 0, block)[..., :, None]      # [B, nb, Q, 1]
  on_k = lambda x: _windows(x, left, block)[..., None, :]   # [B, nb, 1, S]
  allowed = (on_k(index_BxT) <= on_q(index_BxT)) & (on_k(vis.valid) > 0)
  if vis.segments is not None:
    allowed &= on_k(vis.segments) == on_q(vis.segments)
  if vis.branches is not None:
    key_branch = on_k(vis.branches)
    allowed &= (key_branch == 0) | (key_branch == on_q(vis.branches))
  if not isinstance(window, int) or window:
    distance = on_q(vis.positions) - on_k(vis.positions)
    allowed &= (window == 0) | (distance < window)
  scores = jnp.einsum("bnqvgk,bnsvk->bnvgqs", q, k, preferred_element_type=jnp.float32)
  scores = scores * scale
  if softcap:
    scores = softcap * jnp.tanh(scores / softcap)
  # A finite fill keeps fully masked rows (padding queries) free of NaN.
  scores = jnp.where(allowed[:, :, None, None], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1).astype(q_BxTxHxK.dtype)
  out = jnp.einsum("bnvgqs,bnsvk->bnqvgk", probs, v)
  return out.reshape(B, -1, H * K)[:, :T]


def flash_causal_attention(q_BxTxHxK, k_BxTxVxK, v_BxTxVxK, mask_BxT, scale: float):
  """The flash path: `[B, T, H, K]` out in the dtype of `q`; differentiable in q, k, v.
  `mask_BxT` is 0 for padding and a segment id (1 for unpacked rows) for real tokens.

  Key/value heads are repeated to the query heads (the repeat's transpose sums their
  gradients back).
  """
  groups = q_BxTxHxK.shape[2] // k_BxTxVxK.shape[2]
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, T, H, K] <-> [B, H, T, K]
  k_BxTxHxK = jnp.repeat(k_BxTxVxK, groups, axis=2)
  v_BxTxHxK = jnp.repeat(v_BxTxVxK, groups, axis=2)
  segments = jax_flash.SegmentIds(q=mask_BxT.astype(jnp.int32), kv=mask_BxT.astype(jnp.int32))
  out_BxHxTxK = jax_flash.flash_attention(heads_first(q_BxTxHxK), heads_first(k_BxTxHxK),
                       heads_first(v_BxTxHxK), segment_ids=segments, causal=True,
                       sm_scale=scale)
  return heads_first(out_BxHxTxK).astype(q_BxTxHxK.dtype)
