"""The math of one attention tile, shared by the Pallas kernels (`attention_pallas`):
the static `TileDims`, the visibility mask built from the row vectors, the scaled and
soft-capped scores, and the backward's `p` and `dS`."""

import math
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tunix_kernels.attention import blocks as attention_blocks
from tunix_kernels.attention import visits as attention_visits

F32 = jnp.float32
# The name (`jax.ad_checkpoint.checkpoint_name`) of the forward's out and log-sum-exp, the
# residuals the backward needs besides q, k and v: a remat policy that saves them (the
# trainer's `dots`) keeps the forward from running again inside the backward.
RESIDUALS = "attention_residuals"
# The name of q, k and v as the kernels take them (heads first, after whatever the caller
# did to them, e.g. the rotary embedding): a policy that saves them spares the backward
# recomputing the caller's work and the transposes to reach them.
INPUTS = "attention_inputs"


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
  def prescaled(self):
    """Whether q enters the kernels already multiplied by `scale` (`prescale`): where
    the scale is a power of two (1/8 at head dim 64) that is exact, and it saves the
    vector units a multiply per score."""
    return math.frexp(self.scale)[0] == 0.5

  @property
  def dk_scale(self):
    """What dk's accumulated `dS^T q` is multiplied by: 1 when q came prescaled."""
    return 1.0 if self.prescaled else self.scale

  @property
  def ragged_q(self):
    return self.t % self.bq != 0

  @property
  def ragged_k(self):
    return self.t % self.bk != 0


def causal_mask(q_first, k_first, d: TileDims, keys_down=False):
  """The causal rule on the tile of query block `q_first` and key block `k_first`, a
  key at or before its query in the row: `[bq, bk]`, or `[bk, bq]` with `keys_down`.
  Alone it is `mask` on a `visits.CAUSAL` tile: one comparison per entry."""
  shape, q_axis = ((d.bk, d.bq), 1) if keys_down else ((d.bq, d.bk), 0)
  ahead = (jax.lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
           - jax.lax.broadcasted_iota(jnp.int32, shape, q_axis))
  return ahead <= q_first * d.bq - k_first * d.bk


def mask(q_first, k_first, qv, kv, window, d: TileDims, keys_down=False):
  """Which entries of the tile of query block `q_first` and key block `k_first` are
  visible: `[bq, bk]` from query vectors `qv [bq, 3]` and key vectors `kv [3, bk]`, or,
  with `keys_down`, `[bk, bq]` from `kv [bk, 3]` and `qv [3, bq]` (the backward's
  orientation)."""
  if keys_down:
    q_axis, q_vec, k_vec = 1, (lambda r: qv[r:r + 1, :]), (lambda r: kv[:, r:r + 1])
  else:
    q_axis, q_vec, k_vec = 0, (lambda r: qv[:, r:r + 1]), (lambda r: kv[r:r + 1, :])
  ok = causal_mask(q_first, k_first, d, keys_down) & (k_vec(0) == q_vec(0))
  if d.ragged_q or d.ragged_k:  # vectors past the row are garbage
    ok &= q_first * d.bq + jax.lax.broadcasted_iota(jnp.int32, ok.shape, q_axis) < d.t
  branch = k_vec(1)
  ok &= (branch == 0) | (branch == q_vec(1))
  if d.windowed:
    ok &= q_vec(2) - k_vec(2) < window
  return ok


def prescale(q, d: TileDims):
  """`q` times the scale, exactly, where the kernels take it so (`TileDims.prescaled`)."""
  return q * jnp.asarray(d.scale, q.dtype) if d.prescaled and d.scale != 1 else q


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
  """float32 `q k^T * scale` (q came multiplied where `d.prescaled`), soft-capped; and
  `1 - tanh^2` of the cap (None without)."""
  s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)
  if not d.prescaled:
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


def when_visited(listed, kind, visit, q_first, k_first, qv, kv, window, d: TileDims,
                 keys_down=False):
  """In a kernel: `visit(ok)` on a listed tile, with the mask its `visits` kind needs
  (None on a FULL tile: nothing is built or applied); the other arguments are `mask`'s."""

  @pl.when(listed & (kind == attention_visits.FULL))
  def _full():
    visit(None)

  @pl.when(listed & (kind == attention_visits.CAUSAL))
  def _causal():
    visit(causal_mask(q_first, k_first, d, keys_down))

  @pl.when(listed & (kind == attention_visits.MASKED))
  def _masked():
    visit(mask(q_first, k_first, qv, kv, window, d, keys_down))


def compiler_params(d: TileDims, semantics, vmem_limit_bytes=None):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=vmem_limit_bytes or d.vmem_limit_bytes)


def cost(kernel, q, d: TileDims):
  """`attention_blocks.cost_estimate` of `kernel` on heads-first `q [B, H, T, K]`."""
  B, H, T, K = q.shape
  return attention_blocks.cost_estimate(kernel, B, H, T, K, q.dtype, d.bq, d.bk, d.softcap,
                                        d.groups)
