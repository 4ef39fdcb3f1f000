"""Float64 NumPy oracles and inputs shared by the log-prob tests."""

import jax
import numpy as np


def numpy_logprobs(h, w, t, ignore_index=-100):
  """Float64 log_softmax(h @ w)[t] and its gradients for an upstream cotangent g."""
  logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  m = logits.max(-1, keepdims=True)
  lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
  ignored = t == ignore_index
  safe = np.where(ignored, 0, t)
  picked = np.take_along_axis(logits, safe[..., None], -1)[..., 0] - lse
  return np.where(ignored, 0.0, picked), logits, lse


def numpy_grads(h, w, t, g, ignore_index=-100):
  _, logits, lse = numpy_logprobs(h, w, t, ignore_index)
  p = np.exp(logits - lse[..., None])
  ignored = t == ignore_index
  onehot = np.eye(w.shape[1])[np.where(ignored, 0, t)]
  dlogits = np.where(ignored, 0.0, g)[..., None] * (onehot - p)
  h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
  dh = dlogits @ w64.T
  dw = h64.reshape(-1, h64.shape[-1]).T @ dlogits.reshape(-1, w64.shape[1])
  return dh, dw


def make_inputs(N, D, V, dtype, scale=1.0, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  h = (jax.random.normal(k[0], (N, D)) * scale).astype(dtype)
  w = (jax.random.normal(k[1], (D, V)) / np.sqrt(D)).astype(dtype)
  t = jax.random.randint(k[2], (N,), 0, V)
  t = t.at[::5].set(-100)
  g = jax.random.normal(k[3], (N,))
  return h, w, t, g


def rel_error(got, want):
  return np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
