"""The math of one attention tile, shared by the Pallas kernels (`attention_pallas`):
the static `TileDims`, the visibility mask built from the row vectors, the scaled and
soft-capped scores, and the backward's `p` and `dS`."""

from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tunix_kernels.attention import blocks as attention_blocks

F32 = jnp.float32
# The name (`jax.ad_checkpoint.checkpoint_name`) of the forward's out and log-sum-exp, the
# residuals the backward needs besides q, k and v: a remat policy that saves them (the
# trainer's `dots`) keeps the forward from running again inside the backward.
RESIDUALS = "attention_residuals"


class TileDims(NamedTuple):
  """Static facts a kernel body needs (hashable)."""
  t: int
  bq: int
  bk: int
  nq: int
  nk: int
  groups: int          # query heads per key/value head
  scale: float
  softcap: float       # 0: none
  windowed: bool       # whether the window test is traced at all
  vmem_limit_bytes: int | None
  interpret: object    # False (Mosaic) or a `pltpu.InterpretParams`
  # The backward as one kernel (`attention.backward`), under this VMEM limit (None: the
  # compiler's default), or, when False, as the dq and the dk/dv kernels.
  fused_backward: bool = False
  fused_vmem_limit_bytes: int | None = None

  @property
  def ragged_q(self):
    return self.t % self.bq != 0

  @property
  def ragged_k(self):
    return self.t % self.bk != 0


def mask(q_first, k_first, qv, kv, window, d: TileDims, keys_down=False):
  """Which entries of the tile of query block `q_first` and key block `k_first` are
  visible: `[bq, bk]` from query vectors `qv [bq, 3]` and key vectors `kv [3, bk]`, or,
  with `keys_down`, `[bk, bq]` from `kv [bk, 3]` and `qv [3, bq]` (the backward's
  orientation)."""
  if keys_down:
    shape, q_axis = (kv.shape[0], qv.shape[1]), 1
    q_vec, k_vec = (lambda r: qv[r:r + 1, :]), (lambda r: kv[:, r:r + 1])
  else:
    shape, q_axis = (qv.shape[0], kv.shape[1]), 0
    q_vec, k_vec = (lambda r: qv[:, r:r + 1]), (lambda r: kv[r:r + 1, :])
  q_index = q_first * d.bq + jax.lax.broadcasted_iota(jnp.int32, shape, q_axis)
  k_index = k_first * d.bk + jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
  ok = (k_index <= q_index) & (k_vec(0) == q_vec(0))
  if d.ragged_q or d.ragged_k:  # vectors past the row are garbage
    ok &= q_index < d.t
  branch = k_vec(1)
  ok &= (branch == 0) | (branch == q_vec(1))
  if d.windowed:
    ok &= q_vec(2) - k_vec(2) < window
  return ok


def residuals(o, lse):
  """`(o, lse)` named `RESIDUALS` for remat policies."""
  return tuple(checkpoint_name(x, RESIDUALS) for x in (o, lse))


def keep(ok, x, fill):
  """`x` where `ok`, else `fill`; `x` itself on a tile visible everywhere (`ok` None)."""
  return x if ok is None else jnp.where(ok, x, fill)


def real_rows(x, block, first, d: TileDims):
  """`x [n, K]` with rows past the row's end zeroed (0 * garbage may be NaN)."""
  rows = first * block + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where(rows < d.t, x, jnp.zeros_like(x))


def scores(q, k, d: TileDims):
  """float32 `q k^T * scale`, soft-capped; and `1 - tanh^2` of the cap (None without)."""
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)
  s = s * d.scale
  if not d.softcap:
    return s, None
  t = jnp.tanh(s * (1.0 / d.softcap))
  return d.softcap * t, 1.0 - t * t


def grad_tile(q, k, v, do, lse, delta, ok, d: TileDims):
  """`p^T` and `dS^T` (the cotangent of the raw scaled scores), float32 `[bk, bq]`, of
  one tile; `lse`, `delta` are `[1, bq]` rows; `ok` its mask `[bk, bq]` (None: visible
  everywhere). dS is masked again: past a ragged row's end dP holds whatever the DMA
  left there."""
  s, dcap = scores(k, q, d)
  p = keep(ok, jnp.exp(s - lse), 0.0)
  dp = jax.lax.dot_general(v, do, (((1,), (1,)), ((), ())), preferred_element_type=F32)
  ds = keep(ok, p * (dp - delta), 0.0)
  return p, ds if dcap is None else ds * dcap


def when_visited(listed, full, visit, mask):
  """In a kernel: `visit(ok)` on a listed tile, `ok` None where `full` (the tile is
  visible everywhere, so no mask is built or applied), else `mask()`."""

  @pl.when(listed & (full == 1))
  def _full():
    visit(None)

  @pl.when(listed & (full == 0))
  def _partial():
    visit(mask())


def compiler_params(d: TileDims, semantics, vmem_limit_bytes=None):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=vmem_limit_bytes or d.vmem_limit_bytes)


def cost(kernel, q, d: TileDims):
  """`attention_blocks.cost_estimate` of `kernel` on heads-first `q [B, H, T, K]`."""
  B, H, T, K = q.shape
  return attention_blocks.cost_estimate(kernel, B, H, T, K, q.dtype, d.bq, d.bk, d.softcap)
