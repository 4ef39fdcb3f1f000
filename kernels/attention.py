"""Causal grouped-query attention over padded rows: an XLA path and, on TPU, the Pallas
flash-attention kernels that ship with JAX (forward and backward never build the
`[T, T]` scores).

`causal_attention` takes `q [B, T, H, K]`, `k, v [B, T, KV, K]` (H a multiple of KV) and
a 0/1 `mask [B, T]`; a query attends to the keys at or before it whose mask is 1. The
flash path expresses the mask as segment ids (real tokens 1, padding 0): real queries
then see exactly the real keys at or before them, as on the XLA path; padding queries
see other padding instead of real keys, and their outputs are never used (they are
never scored and a row only ever attends through its own query). Sliding windows and
score soft-caps (Mistral, Gemma 2) are not in the flash kernel: those models, rows
whose length is not a multiple of 128, and every non-TPU platform take the XLA path
under `impl="auto"`.
"""

import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

from kernels import dispatch

ATTENTION_IMPLS = ("auto", "xla", "pallas")
_BLOCK = 128  # the flash kernels' default tiles


def flash_supported(seq_len: int, window: bool, softcap: float) -> bool:
  """Whether the flash kernels compute this attention exactly."""
  return seq_len % _BLOCK == 0 and not window and not softcap


def resolve(impl: str, seq_len: int, window: bool, softcap: float) -> str:
  """`impl` checked, with "auto" -> "pallas" on TPU when `flash_supported`, else "xla"."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; choose one of {ATTENTION_IMPLS}")
  if impl == "auto":
    use = dispatch.target_platform() == "tpu" and flash_supported(seq_len, window, softcap)
    return "pallas" if use else "xla"
  if impl == "pallas" and not flash_supported(seq_len, window, softcap):
    raise ValueError(f"the flash kernels need rows of a multiple of {_BLOCK} tokens "
                     f"(got {seq_len}) and no sliding window or score soft-cap")
  return impl


def flash_causal_attention(q_BxTxHxK, k_BxTxVxK, v_BxTxVxK, mask_BxT, scale: float):
  """The flash path: `[B, T, H, K]` out in the dtype of `q`; differentiable in q, k, v.

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
