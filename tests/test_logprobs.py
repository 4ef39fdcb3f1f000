"""`kernels.fused_logprobs` against float64 NumPy and the naive reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels


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


def _inputs(N, D, V, dtype, scale=1.0, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  h = (jax.random.normal(k[0], (N, D)) * scale).astype(dtype)
  w = (jax.random.normal(k[1], (D, V)) / np.sqrt(D)).astype(dtype)
  t = jax.random.randint(k[2], (N,), 0, V)
  t = t.at[::5].set(-100)
  g = jax.random.normal(k[3], (N,))
  return h, w, t, g


def _rel(got, want):
  return np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30)


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("N,D,V,chunk", [(13, 24, 37, 8), (9, 16, 1, None), (16, 8, 64, 16)])
def test_against_float64(impl, dtype, tol, N, D, V, chunk):
  h, w, t, g = _inputs(N, D, V, dtype)
  if V == 1:
    t = jnp.where(t == -100, -100, 0)
  bs = chunk if impl == "xla" else None
  f = lambda h, w: kernels.fused_logprobs(h, w, t, impl=impl, block_sizes=bs)
  out, vjp = jax.vjp(f, h, w)
  dh, dw = vjp(g)
  want = numpy_logprobs(np.asarray(h, np.float32), np.asarray(w, np.float32), np.asarray(t))[0]
  want_dh, want_dw = numpy_grads(np.asarray(h, np.float32), np.asarray(w, np.float32),
                                 np.asarray(t), np.asarray(g))
  assert out.dtype == jnp.float32 and dh.dtype == h.dtype and dw.dtype == w.dtype
  assert _rel(out, want) <= tol
  assert _rel(dh, want_dh) <= tol
  assert _rel(dw, want_dw) <= tol
  np.testing.assert_array_equal(np.asarray(out)[np.asarray(t) == -100], 0.0)


def test_large_logits_and_all_ignored_rows():
  h, w, t, g = _inputs(12, 16, 50, jnp.float32, scale=1e3 * 4)  # logits ~ 1e3
  t = t.at[:4].set(-100)
  out, vjp = jax.vjp(lambda h, w: kernels.fused_logprobs(h, w, t, impl="xla", block_sizes=16),
                     h, w)
  dh, dw = vjp(g)
  want = numpy_logprobs(np.asarray(h), np.asarray(w), np.asarray(t))[0]
  assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dw)).all()
  assert _rel(out, want) <= 1e-5
  np.testing.assert_array_equal(np.asarray(dh)[:4], 0.0)


def test_leading_axes_jit_and_errors():
  h, w, t, _ = _inputs(12, 16, 20, jnp.float32)
  h3, t3 = h.reshape(2, 6, 16), t.reshape(2, 6)
  out = jax.jit(lambda h, w, t: kernels.fused_logprobs(h, w, t))(h3, w, t3)
  want = kernels.fused_logprobs(h, w, t, impl="reference").reshape(2, 6)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="out of range"):
    kernels.fused_logprobs(h, w, t.at[1].set(20))
  with pytest.raises(ValueError, match="unknown fused_logprobs impl"):
    kernels.fused_logprobs(h, w, t, impl="cuda")
  with pytest.raises(ValueError, match="disagree"):
    kernels.fused_logprobs(h, w, t3)
