"""Fused linear + log-softmax + gather as a `lax.scan` over vocabulary chunks (CPU/GPU path).

Forward keeps a running max, a running sum of exponentials and the target logit per
row while it walks `[D, C]` slices of the weight, so only one `[N, C]` logit tile exists
at a time. Backward recomputes each tile, turns it into `g * (onehot - softmax)` on the
fly and writes each `d_weight` slice in place, in the weight's dtype.

When C does not divide V, the last chunk starts at `V - C` and overlaps its
predecessor; the overlap is masked wherever a column would otherwise count twice, so
the weight is never padded or copied.
"""

import functools

import jax
import jax.numpy as jnp

from tunix_kernels import dispatch
from tunix_kernels.common import cotangent_for
from tunix_kernels.common import vary_like


def _tile(hidden_NxD, weight_DxV, targets_N, c, chunk, softcap):
  """Chunk `c`: float32 logits `[N, C]` (soft-capped), d capped / d raw (None without a
  cap), its first column, its weight slice `[D, C]`, the one-hot of the targets in it,
  and a `[C]` mask that is False on columns an earlier chunk already covered (None when
  chunks tile V exactly)."""
  V = weight_DxV.shape[1]
  start = jnp.minimum(c * chunk, V - chunk)
  w_DxC = _weight_chunk(weight_DxV, start, chunk)
  logits_NxC = jnp.dot(hidden_NxD, w_DxC, preferred_element_type=jnp.float32)
  dcap_NxC = None
  if softcap is not None:
    tanh_NxC = jnp.tanh(logits_NxC / softcap)
    logits_NxC, dcap_NxC = softcap * tanh_NxC, 1.0 - tanh_NxC * tanh_NxC
  cols_C = start + jnp.arange(chunk)
  onehot_NxC = cols_C[None] == targets_N[:, None]
  fresh_C = None if V % chunk == 0 else cols_C >= c * chunk
  return logits_NxC, dcap_NxC, start, w_DxC, onehot_NxC, fresh_C


def _weight_chunk(weight_DxV, start, chunk):
  take = lambda: jax.lax.dynamic_slice_in_dim(weight_DxV, start, chunk, axis=1)
  if weight_DxV.dtype == jnp.float32 or dispatch.target_platform() != "cpu":
    return take()
  # XLA:CPU computes bf16 dots in f32 and would hoist the conversion of the *whole*
  # weight out of the loop (a [D, V] f32 copy). Slicing inside a conditional, which
  # XLA does not look through, keeps the conversion to one [D, C] chunk at a time.
  # Keyed off the compile target like "auto", so a CPU host tracing for TPU skips it.
  return jax.lax.cond(start >= 0, take, lambda: vary_like(
      jnp.zeros((weight_DxV.shape[0], chunk), weight_DxV.dtype), weight_DxV))


def _forward(hidden_NxD, weight_DxV, targets_N, chunk, softcap):
  N, V = hidden_NxD.shape[0], weight_DxV.shape[1]

  def body(carry, c):
    m_N, s_N, t_N = carry
    logits_NxC, _, _, _, onehot_NxC, fresh_C = _tile(hidden_NxD, weight_DxV, targets_N, c,
                                                     chunk, softcap)
    if fresh_C is not None:
      logits_NxC = jnp.where(fresh_C[None], logits_NxC, -jnp.inf)
      onehot_NxC = onehot_NxC & fresh_C[None]
    m_new = jnp.maximum(m_N, logits_NxC.max(axis=1))
    s_N = s_N * jnp.exp(m_N - m_new) + jnp.exp(logits_NxC - m_new[:, None]).sum(axis=1)
    t_N = t_N + jnp.where(onehot_NxC, logits_NxC, 0.0).sum(axis=1)
    return (m_new, s_N, t_N), None

  init = (jnp.full((N,), -jnp.inf, jnp.float32), jnp.zeros((N,), jnp.float32),
          jnp.zeros((N,), jnp.float32))
  init = tuple(vary_like(x, hidden_NxD, weight_DxV, targets_N) for x in init)
  (m_N, s_N, t_N), _ = jax.lax.scan(body, init, jnp.arange(-(-V // chunk)))
  lse_N = m_N + jnp.log(s_N)
  return t_N - lse_N, lse_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def logprobs_xla(hidden_NxD, weight_DxV, targets_N, chunk, softcap=None):
  """`log_softmax(hidden @ weight)[targets]`, float32 `[N]`; `chunk <= V` columns per step;
  logits soft-capped to `softcap * tanh(logits / softcap)` unless `softcap` is None.

  Targets must be in range. Rows to ignore are the caller's business: pass any valid
  id and zero their cotangent (as `tunix_kernels.fused_logprobs` does).
  """
  return _forward(hidden_NxD, weight_DxV, targets_N, chunk, softcap)[0]


def _fwd(hidden_NxD, weight_DxV, targets_N, chunk, softcap):
  logp_N, lse_N = _forward(hidden_NxD, weight_DxV, targets_N, chunk, softcap)
  return logp_N, (hidden_NxD, weight_DxV, targets_N, lse_N)


def _bwd(chunk, softcap, res, g_N):
  hidden_NxD, weight_DxV, targets_N, lse_N = res
  g_N = g_N.astype(jnp.float32)
  dtype = hidden_NxD.dtype

  def body(carry, c):
    dh_NxD, dw_DxV = carry
    logits_NxC, dcap_NxC, start, w_DxC, onehot_NxC, fresh_C = _tile(
        hidden_NxD, weight_DxV, targets_N, c, chunk, softcap)
    # d logp / d logits = onehot - softmax, scaled by the incoming cotangent (and by the
    # cap's derivative: the softmax is over the capped logits).
    p_NxC = jnp.exp(logits_NxC - lse_N[:, None])
    dlogits_NxC = g_N[:, None] * (onehot_NxC - p_NxC)
    if dcap_NxC is not None:
      dlogits_NxC = dlogits_NxC * dcap_NxC
    dlogits_NxC = dlogits_NxC.astype(dtype)
    # d_weight columns are independent, so an overlapped column is just rewritten with
    # the same value; d_hidden sums over columns, so the overlap is masked there.
    dw_DxC = jnp.dot(hidden_NxD.T, dlogits_NxC, preferred_element_type=jnp.float32)
    dw_DxV = jax.lax.dynamic_update_slice_in_dim(dw_DxV, dw_DxC.astype(dw_DxV.dtype), start,
                                                 axis=1)
    if fresh_C is not None:
      dlogits_NxC = jnp.where(fresh_C[None], dlogits_NxC, 0)
    dh_NxD = dh_NxD + jnp.dot(dlogits_NxC, w_DxC.T, preferred_element_type=jnp.float32)
    return (dh_NxD, dw_DxV), None

  init = tuple(vary_like(x, hidden_NxD, weight_DxV, targets_N, g_N) for x in (
      jnp.zeros(hidden_NxD.shape, jnp.float32), jnp.zeros_like(weight_DxV)))
  (dh_NxD, dw_DxV), _ = jax.lax.scan(body, init,
                                     jnp.arange(-(-weight_DxV.shape[1] // chunk)))
  return (cotangent_for(dh_NxD.astype(dtype), hidden_NxD), cotangent_for(dw_DxV, weight_DxV),
          None)


logprobs_xla.defvjp(_fwd, _bwd)
