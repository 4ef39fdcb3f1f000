"""What every log-prob kernel does to one tile: the float32 logit tile (soft-capped, columns
past V masked), its `g * (onehot - softmax)` cotangent, and edge handling.

Nothing is padded: the last token and vocabulary blocks may run past `N` and `V`, and
what the DMA leaves there is garbage (NaN in interpret mode). Logit columns past `V`
become `MASK_VALUE` (no softmax mass); cotangent rows past `N` become 0; and the operand
rows or columns a matmul contracts against those zeros are zeroed too, since `0 * NaN`
is NaN.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tunix_kernels.common import MASK_VALUE

F32 = jnp.float32


def edge_split(is_edge, ragged, body):
  """Runs `body(masked)`: with `masked=True` on the edge block when the axis is ragged,
  so the other blocks skip the masking work."""
  if not ragged:
    body(False)
    return
  pl.when(is_edge)(lambda: body(True))
  pl.when(jnp.logical_not(is_edge))(lambda: body(False))


def accumulate(acc_ref, part, first):
  """`acc = part` on the first contribution, `acc += part` after."""
  pl.when(first)(lambda: acc_ref.__setitem__(Ellipsis, part))
  pl.when(jnp.logical_not(first))(lambda: acc_ref.__setitem__(Ellipsis, acc_ref[...] + part))


def index_from(start, shape, axis):
  """`start + iota` along `axis` of an int32 array of `shape` (row or column ids)."""
  return start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def masked_logits(logits, j, bv, v, softcap):
  """The finished float32 logit tile of vocabulary block `j` (soft-capped), columns past
  `v` set to MASK_VALUE; its column ids; and d capped / d raw (None without a cap)."""
  dcap = None
  if softcap is not None:
    tanh = jnp.tanh(logits * (1.0 / softcap))
    logits, dcap = softcap * tanh, 1.0 - tanh * tanh
  cols = index_from(j * bv, logits.shape, 1)
  if v % bv:
    logits = jnp.where(cols < v, logits, MASK_VALUE)
    if dcap is not None:  # garbage there may be NaN, and 0 * NaN is NaN
      dcap = jnp.where(cols < v, dcap, 0.0)
  return logits, cols, dcap


def dlogits(logits, targets_bnx1, lse_bnx1, g_bnx1, j, bv, v, softcap, row_ids=None, n=None):
  """`g * (onehot - softmax) * d cap` of a raw float32 logit tile `[bn, bv]`, given the
  log-sum-exp over the whole vocabulary; rows with `row_ids >= n` zeroed when given (their
  statistics are garbage). A target of -1 matches no column (a vocabulary slice that
  does not own it)."""
  logits, cols, dcap = masked_logits(logits, j, bv, v, softcap)
  p = jnp.exp(logits - lse_bnx1)  # masked columns: exp(-huge) = 0
  dl = g_bnx1 * ((cols == targets_bnx1).astype(F32) - p)
  if dcap is not None:
    dl = dl * dcap
  if row_ids is not None:
    dl = jnp.where(row_ids < n, dl, 0.0)
  return dl
