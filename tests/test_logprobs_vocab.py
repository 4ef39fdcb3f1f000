"""`tunix_kernels.fused_logprobs(..., vocab_axis=...)`: a vocabulary-parallel LM head inside
`jax.shard_map`, against float64 NumPy, under `check_vma` True and False."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh, PartitionSpec as P

import tunix_kernels
from tunix_kernels import IGNORE_INDEX
from oracles import make_inputs, numpy_logprob_grads, numpy_logprobs, rel_error

N, D, V = 16, 16, 64
SPECS = (P(), P(None, "model"), P(), P())  # hidden, weight slice, targets, cotangent


def _mesh(K):
  return Mesh(np.array(jax.devices()[:K]), ("model",))


def _inputs(K, dtype=jnp.float32):
  """make_inputs (every 5th row ignored) with each shard's first and last id as targets."""
  h, w, t, g = make_inputs(N, D, V, dtype, scale=3.0)
  vk = V // K
  rows = [i for i in range(N) if i % 5][:2 * K]
  t = t.at[np.array(rows)].set(np.array([k * vk + j for k in range(K) for j in (0, vk - 1)]))
  return h, w, t, g


def _want(h, w, t, g, cap):
  args = (np.asarray(h, np.float32), np.asarray(w, np.float32), np.asarray(t))
  return (numpy_logprobs(*args, softcap=cap)[0],) + numpy_logprob_grads(
      *args, np.asarray(g), softcap=cap)


def _logp(impl, cap):
  kw = dict(xla_chunk=8) if impl == "xla" else {}
  return lambda h, w, t: tunix_kernels.fused_logprobs(h, w, t, impl=impl, logit_softcap=cap,
                                                vocab_axis="model", **kw)


def _inside(logp, mesh, check_vma, specs=SPECS, dh_spec=P("model")):
  """Log-probs and the vjp of a replicated cotangent taken inside the body (as the
  trainer does); each device's hidden gradient is returned, stacked over "model"."""
  def body(h, w, t, g):
    out, vjp = jax.vjp(lambda h, w: logp(h, w, t), h, w)
    dh, dw = vjp(g)
    return out, dh[None], dw
  out_specs = (specs[2], dh_spec, specs[1])
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs,
                               check_vma=check_vma))


def _outside(logp, mesh, check_vma):
  """Gradients of `sum(g * logp)` (computed in the body) w.r.t. hidden and the full weight."""
  loss = jax.shard_map(lambda h, w, t, g: jnp.sum(g * logp(h, w, t)), mesh=mesh,
                       in_specs=SPECS, out_specs=P(), check_vma=check_vma)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _check(K, out, dh_K, dw, want, tol):
  want_out, want_dh, want_dw = want
  assert rel_error(out, want_out) <= tol
  for k in range(K):  # the full hidden gradient on every device
    assert rel_error(dh_K[k], want_dh) <= tol
  assert rel_error(dw, want_dw) <= tol


# Every pair of (K, check_vma, cap) levels once among the fast xla cases; the rest slow.
FAST = [("xla", 2, False, None), ("xla", 2, True, 2.0), ("xla", 4, False, 2.0),
        ("xla", 4, True, None)]
FAST += [("naive", 2, False, None), ("naive", 4, True, 2.0),
         ("interpret", 4, False, 2.0), ("interpret", 2, True, None)]
SLOW = [(impl, K, vma, cap) for impl in ("xla", "interpret") for K in (2, 4)
        for vma in (False, True) for cap in (None, 2.0) if (impl, K, vma, cap) not in FAST]


@pytest.mark.parametrize("impl,K,check_vma,cap", FAST + [
    pytest.param(*case, marks=pytest.mark.slow) for case in SLOW])
def test_against_float64(impl, K, check_vma, cap):
  h, w, t, g = _inputs(K)
  want = _want(h, w, t, g, cap)
  if cap is not None:  # the cap bites: it moves the log-probs by far more than the tolerance
    assert np.abs(want[0] - _want(h, w, t, g, None)[0]).max() > 0.1
  mesh, logp = _mesh(K), _logp(impl, cap)
  out, dh_K, dw = _inside(logp, mesh, check_vma)(h, w, t, g)
  assert out.dtype == jnp.float32 and out.shape == t.shape
  np.testing.assert_array_equal(np.asarray(out)[np.asarray(t) == IGNORE_INDEX], 0.0)
  _check(K, out, dh_K, dw, want, 1e-5)
  if check_vma:  # with checked types, differentiating from outside agrees
    dh, dw = _outside(logp, mesh, check_vma)(h, w, t, g)
    _check(K, out, dh[None], dw, want, 1e-5)


def test_unchecked_gradient_from_outside_is_the_documented_one():
  # Transposing a check_vma=False shard_map from outside, JAX hands each device 1/K of
  # the replicated output's cotangent: hidden's gradient stays right, weight's is / K.
  K = 2
  h, w, t, g = _inputs(K)
  _, want_dh, want_dw = _want(h, w, t, g, None)
  dh, dw = _outside(_logp("xla", None), _mesh(K), False)(h, w, t, g)
  assert rel_error(dh, want_dh) <= 1e-5
  assert rel_error(dw, want_dw / K) <= 1e-5


@pytest.mark.parametrize("check_vma", [False, True])
def test_data_and_model_axes(check_vma):
  # The trainer's layout: rows split over "data", the vocabulary over "model". Each
  # device returns its gradients stacked over both axes. The weight is replicated over
  # "data": with checked types JAX sums its gradient over "data" itself (the transpose of
  # the implicit broadcast), unchecked each data shard has its rows' part to sum.
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
  h, w, t, g = _inputs(2)
  logp = _logp("xla", 2.0)

  def body(h, w, t, g):
    out, vjp = jax.vjp(lambda h, w: logp(h, w, t), h, w)
    dh, dw = vjp(g)
    return out, dh[None], dw[None]

  rows = P("data")
  f = jax.shard_map(body, mesh=mesh, in_specs=(rows, P(None, "model"), rows, rows),
                    out_specs=(rows, P("model", "data"), P("data", None, "model")),
                    check_vma=check_vma)
  out, dh_K, dw_2 = jax.jit(f)(h, w, t, g)
  if check_vma:
    np.testing.assert_array_equal(dw_2[0], dw_2[1])
  _check(2, out, dh_K, dw_2[0] if check_vma else dw_2.sum(0), _want(h, w, t, g, 2.0), 1e-5)


@pytest.mark.parametrize("check_vma", [False, True])
def test_bfloat16(check_vma):
  K = 4
  h, w, t, g = _inputs(K, jnp.bfloat16)
  out, dh_K, dw = _inside(_logp("xla", None), _mesh(K), check_vma)(h, w, t, g)
  assert out.dtype == jnp.float32 and dh_K.dtype == dw.dtype == jnp.bfloat16
  _check(K, out, dh_K, dw, _want(h, w, t, g, None), 2e-2)


def test_never_holds_slice_logits():
  # Compiled per-device temporaries of forward + backward stay far below the [N, V/K]
  # float32 logits of a slice (N = 1024, V/K = 16000).
  n, d, v, K = 1024, 256, 32000, 2
  logp = _logp("xla", None)

  def loss(h, w, t):
    return jax.grad(lambda h, w: jnp.sum(logp(h, w, t)), argnums=(0, 1))(h, w)

  f = jax.jit(jax.shard_map(loss, mesh=_mesh(K), in_specs=SPECS[:3],
                            out_specs=(P(), P(None, "model")), check_vma=False))
  args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
          jax.ShapeDtypeStruct((n,), jnp.int32))
  temp = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
  assert temp < n * (v // K) * 4 / 4


def test_matches_the_unsharded_op_and_checks_its_arguments():
  K = 4
  h, w, t, _ = _inputs(K)
  mesh = _mesh(K)
  want = tunix_kernels.fused_logprobs(h, w, t, impl="naive")

  def run(t_closed, h=h, **kw):  # concrete targets closed over: range check sees K * V/K
    f = lambda h, w: tunix_kernels.fused_logprobs(h, w, t_closed, impl="auto", **kw)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=SPECS[:2], out_specs=P()))(h, w)

  np.testing.assert_allclose(np.asarray(run(t, vocab_axis="model")), np.asarray(want),
                             rtol=1e-5, atol=1e-6)
  three = run(t.reshape(2, 8), h.reshape(2, 8, D), vocab_axis="model")  # leading axes kept
  assert three.shape == (2, 8)
  np.testing.assert_allclose(np.asarray(three).reshape(-1), np.asarray(want), rtol=1e-5,
                             atol=1e-6)
  with pytest.raises(ValueError, match="out of range"):
    run(t.at[1].set(V), vocab_axis="model")
  for bad in (("model",), "", 3):
    with pytest.raises(ValueError, match="vocab_axis must be a mesh axis name"):
      run(t, vocab_axis=bad)
  with pytest.raises(ValueError, match="not an axis of an enclosing jax.shard_map"):
    run(t, vocab_axis="data")
  with pytest.raises(ValueError, match="not an axis of an enclosing jax.shard_map"):
    tunix_kernels.fused_logprobs(h, w, t, vocab_axis="model")


@pytest.mark.parametrize("check_vma", [False, True])
def test_lowers_for_tpu_with_the_pallas_kernels(check_vma):
  # "auto" under a TPU mesh picks the Pallas kernels for each slice (forward, d_hidden,
  # d_weight); the forward adds a pmax and two psums of [N], the backward one psum of
  # d_hidden and nothing else.
  tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  mesh = AbstractMesh((4,), ("model",), (AxisType.Auto,), abstract_device=tpu)

  def body(h, w, t):
    logp, vjp = jax.vjp(lambda h, w: tunix_kernels.fused_logprobs(h, w, t, vocab_axis="model"),
                        h, w)
    return (logp,) + vjp(jnp.ones_like(logp))

  f = jax.shard_map(body, mesh=mesh, in_specs=SPECS[:3], out_specs=(P(), P(), P(None, "model")),
                    check_vma=check_vma)
  args = (jax.ShapeDtypeStruct((256, 512), jnp.bfloat16),
          jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((256,), jnp.int32))
  text = export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
  assert text.count("tpu_custom_call") == 2  # the forward and the fused backward
  assert text.count("stablehlo.all_reduce") == 4
