"""Fused linear + log-softmax + gather as a `lax.scan` over vocabulary chunks (CPU/GPU path).

Forward keeps a running max, running sum of exponentials and the target logit per row
while it walks `[D, C]` slices of the weight, so only one `[N, C]` logit tile exists at a
time. Backward recomputes each tile and turns it into `softmax - onehot` on the fly.
"""

import functools

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def _chunks(weight_DxV, chunk):
  """Pads V to a multiple of `chunk`; returns the padded weight and the chunk count."""
  V = weight_DxV.shape[1]
  num_chunks = -(-V // chunk)
  pad = num_chunks * chunk - V
  if pad:
    weight_DxV = jnp.pad(weight_DxV, ((0, 0), (0, pad)))
  return weight_DxV, num_chunks


def _tile(hidden_NxD, weight_DxVp, c, chunk, V):
  """Float32 logits of vocabulary chunk `c`, padded columns set to -inf; and their ids."""
  w_DxC = jax.lax.dynamic_slice_in_dim(weight_DxVp, c * chunk, chunk, axis=1)
  logits_NxC = jnp.dot(hidden_NxD, w_DxC, preferred_element_type=jnp.float32)
  cols_C = c * chunk + jnp.arange(chunk)
  return jnp.where(cols_C < V, logits_NxC, _NEG_INF), cols_C, w_DxC


def _forward(hidden_NxD, weight_DxV, targets_N, chunk):
  N, V = hidden_NxD.shape[0], weight_DxV.shape[1]
  weight_DxVp, num_chunks = _chunks(weight_DxV, chunk)

  def body(carry, c):
    m_N, s_N, t_N = carry
    logits_NxC, cols_C, _ = _tile(hidden_NxD, weight_DxVp, c, chunk, V)
    m_new = jnp.maximum(m_N, logits_NxC.max(axis=1))
    s_N = s_N * jnp.exp(m_N - m_new) + jnp.exp(logits_NxC - m_new[:, None]).sum(axis=1)
    t_N = t_N + jnp.where(cols_C[None] == targets_N[:, None], logits_NxC, 0.0).sum(axis=1)
    return (m_new, s_N, t_N), None

  init = (jnp.full((N,), _NEG_INF, jnp.float32), jnp.zeros((N,), jnp.float32),
          jnp.zeros((N,), jnp.float32))
  (m_N, s_N, t_N), _ = jax.lax.scan(body, init, jnp.arange(num_chunks))
  lse_N = m_N + jnp.log(s_N)
  return t_N - lse_N, lse_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def logprobs_xla(hidden_NxD, weight_DxV, targets_N, chunk):
  """`log_softmax(hidden @ weight)[targets]`, float32 `[N]`; targets must be in range.

  Rows to ignore are the caller's business: pass any valid id and zero their
  cotangent (as `kernels.fused_logprobs` does).
  """
  return _forward(hidden_NxD, weight_DxV, targets_N, chunk)[0]


def _fwd(hidden_NxD, weight_DxV, targets_N, chunk):
  logp_N, lse_N = _forward(hidden_NxD, weight_DxV, targets_N, chunk)
  return logp_N, (hidden_NxD, weight_DxV, targets_N, lse_N)


def _bwd(chunk, res, g_N):
  hidden_NxD, weight_DxV, targets_N, lse_N = res
  V = weight_DxV.shape[1]
  weight_DxVp, num_chunks = _chunks(weight_DxV, chunk)
  g_N = g_N.astype(jnp.float32)

  def body(dh_NxD, c):
    logits_NxC, cols_C, w_DxC = _tile(hidden_NxD, weight_DxVp, c, chunk, V)
    p_NxC = jnp.exp(logits_NxC - lse_N[:, None])  # padded columns: exp(-inf) = 0
    onehot_NxC = (cols_C[None] == targets_N[:, None]).astype(jnp.float32)
    # d logp / d logits = onehot - softmax, scaled by the incoming cotangent.
    dlogits_NxC = (g_N[:, None] * (onehot_NxC - p_NxC)).astype(hidden_NxD.dtype)
    dh_NxD = dh_NxD + jnp.dot(dlogits_NxC, w_DxC.T, preferred_element_type=jnp.float32)
    dw_DxC = jnp.dot(hidden_NxD.T, dlogits_NxC, preferred_element_type=jnp.float32)
    return dh_NxD, dw_DxC.astype(weight_DxV.dtype)

  dh_NxD, dw_KxDxC = jax.lax.scan(body, jnp.zeros(hidden_NxD.shape, jnp.float32),
                                  jnp.arange(num_chunks))
  dw_DxVp = jnp.moveaxis(dw_KxDxC, 0, 1).reshape(weight_DxV.shape[0], -1)
  return dh_NxD.astype(hidden_NxD.dtype), dw_DxVp[:, :V], None


logprobs_xla.defvjp(_fwd, _bwd)
