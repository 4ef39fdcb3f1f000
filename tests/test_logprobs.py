"""`kernels.fused_logprobs` against float64 NumPy and the naive reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from oracles import make_inputs, rel_error, numpy_grads, numpy_logprobs


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("N,D,V,chunk", [(13, 24, 37, 8), (9, 16, 1, None), (16, 8, 64, 16)])
def test_against_float64(impl, dtype, tol, N, D, V, chunk):
  h, w, t, g = make_inputs(N, D, V, dtype)
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
  assert rel_error(out, want) <= tol
  assert rel_error(dh, want_dh) <= tol
  assert rel_error(dw, want_dw) <= tol
  np.testing.assert_array_equal(np.asarray(out)[np.asarray(t) == -100], 0.0)


def test_large_logits_and_all_ignored_rows():
  h, w, t, g = make_inputs(12, 16, 50, jnp.float32, scale=1e3 * 4)  # logits ~ 1e3
  t = t.at[:4].set(-100)
  out, vjp = jax.vjp(lambda h, w: kernels.fused_logprobs(h, w, t, impl="xla", block_sizes=16),
                     h, w)
  dh, dw = vjp(g)
  want = numpy_logprobs(np.asarray(h), np.asarray(w), np.asarray(t))[0]
  assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dw)).all()
  assert rel_error(out, want) <= 1e-5
  np.testing.assert_array_equal(np.asarray(dh)[:4], 0.0)


def test_leading_axes_jit_and_errors():
  h, w, t, _ = make_inputs(12, 16, 20, jnp.float32)
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_path_never_holds_logits_or_a_weight_copy(dtype):
  # Compiled memory analysis is exact: forward+backward temporaries stay far below one
  # [N, V] f32 logits array, and below an f32 copy of the weight (XLA:CPU upcasts bf16
  # dots; the op keeps that conversion to one chunk).
  N, D, V = 1024, 256, 32000

  def loss(h, w, t):
    return jnp.sum(kernels.fused_logprobs(h, w, t, impl="xla"))

  args = (jax.ShapeDtypeStruct((N, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
          jax.ShapeDtypeStruct((N,), jnp.int32))
  temp = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile() \
      .memory_analysis().temp_size_in_bytes
  assert temp < N * V * 4 / 4
  assert temp < D * V * 4
