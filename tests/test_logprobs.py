"""`tunix_kernels.fused_logprobs` against float64 NumPy and the naive implementation, and the
shared dispatch layer (`tunix_kernels.dispatch`) that both ops use."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh, PartitionSpec as P

import tunix_kernels
from tunix_kernels import dispatch
from tunix_kernels import IGNORE_INDEX
from oracles import make_inputs, rel_error, numpy_logprob_grads, numpy_logprobs


@pytest.mark.parametrize("impl", ["xla", "naive"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("N,D,V,chunk", [(13, 24, 37, 8), (9, 16, 1, None), (16, 8, 64, 16)])
def test_against_float64(impl, dtype, tol, N, D, V, chunk):
  h, w, t, g = make_inputs(N, D, V, dtype)
  if V == 1:
    t = jnp.where(t == IGNORE_INDEX, IGNORE_INDEX, 0)
  chunk = chunk if impl == "xla" else None
  f = lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl=impl, xla_chunk=chunk)
  out, vjp = jax.vjp(f, h, w)
  dh, dw = vjp(g)
  want = numpy_logprobs(np.asarray(h, np.float32), np.asarray(w, np.float32), np.asarray(t))[0]
  want_dh, want_dw = numpy_logprob_grads(np.asarray(h, np.float32), np.asarray(w, np.float32),
                                 np.asarray(t), np.asarray(g))
  assert out.dtype == jnp.float32 and dh.dtype == h.dtype and dw.dtype == w.dtype
  assert rel_error(out, want) <= tol
  assert rel_error(dh, want_dh) <= tol
  assert rel_error(dw, want_dw) <= tol
  np.testing.assert_array_equal(np.asarray(out)[np.asarray(t) == IGNORE_INDEX], 0.0)


@pytest.mark.parametrize("impl,kw", [("xla", dict(xla_chunk=16)), ("naive", {}),
                                     ("interpret", dict(block_sizes=tunix_kernels.LogprobsBlockSizes(
                                         8, 128, 128)))])
def test_logit_softcap_against_float64(impl, kw):
  # Logits ~ N(0, 3^2) under a cap of 2: tanh saturates, so the cap moves the log-probs by
  # far more than the tolerance. The interpret case has ragged N and V and 2 hidden blocks.
  h, w, t, g = make_inputs(13, 256, 300, jnp.float32, scale=3.0)
  f = lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl=impl, logit_softcap=2.0, **kw)
  out, vjp = jax.vjp(f, h, w)
  dh, dw = vjp(g)
  h64, w64, t64 = np.asarray(h), np.asarray(w), np.asarray(t)
  want = numpy_logprobs(h64, w64, t64, softcap=2.0)[0]
  want_dh, want_dw = numpy_logprob_grads(h64, w64, t64, np.asarray(g), softcap=2.0)
  assert np.abs(want - numpy_logprobs(h64, w64, t64)[0]).max() > 1.0  # the cap bites
  assert rel_error(out, want) <= 1e-5
  assert rel_error(dh, want_dh) <= 1e-5
  assert rel_error(dw, want_dw) <= 1e-5
  for bad in (0.0, -1.0, "30", True):
    with pytest.raises(ValueError, match="logit_softcap must be a positive float"):
      tunix_kernels.fused_logprobs(h, w, t, impl=impl, logit_softcap=bad, **kw)


def test_large_logits_and_all_ignored_rows():
  h, w, t, g = make_inputs(12, 16, 50, jnp.float32, scale=1e3 * 4)  # logits ~ 1e3
  t = t.at[:4].set(IGNORE_INDEX)
  out, vjp = jax.vjp(lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl="xla", xla_chunk=16),
                     h, w)
  dh, dw = vjp(g)
  want = numpy_logprobs(np.asarray(h), np.asarray(w), np.asarray(t))[0]
  assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dw)).all()
  assert rel_error(out, want) <= 1e-5
  np.testing.assert_array_equal(np.asarray(dh)[:4], 0.0)


def test_leading_axes_jit_and_errors():
  h, w, t, _ = make_inputs(12, 16, 20, jnp.float32)
  h3, t3 = h.reshape(2, 6, 16), t.reshape(2, 6)
  out = jax.jit(lambda h, w, t: tunix_kernels.fused_logprobs(h, w, t))(h3, w, t3)
  want = tunix_kernels.fused_logprobs(h, w, t, impl="naive").reshape(2, 6)
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="out of range"):
    tunix_kernels.fused_logprobs(h, w, t.at[1].set(20))
  with pytest.raises(ValueError, match="unknown fused_logprobs impl"):
    tunix_kernels.fused_logprobs(h, w, t, impl="cuda")
  with pytest.raises(ValueError, match="disagree"):
    tunix_kernels.fused_logprobs(h, w, t3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_path_never_holds_logits_or_a_weight_copy(dtype):
  # Compiled memory analysis is exact: forward+backward temporaries stay far below one
  # [N, V] f32 logits array, and below an f32 copy of the weight (XLA:CPU upcasts bf16
  # dots; the op keeps that conversion to one chunk).
  N, D, V = 1024, 256, 32000

  def loss(h, w, t):
    return jnp.sum(tunix_kernels.fused_logprobs(h, w, t, impl="xla"))

  args = (jax.ShapeDtypeStruct((N, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
          jax.ShapeDtypeStruct((N,), jnp.int32))
  temp = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile() \
      .memory_analysis().temp_size_in_bytes
  assert temp < N * V * 4 / 4
  assert temp < D * V * 4


def test_reference_is_not_an_impl():
  # "reference" only ever means DPO's frozen reference model; the oracle is "naive".
  assert tunix_kernels.IMPLS == ("auto", "xla", "naive", "pallas", "interpret")
  assert not hasattr(tunix_kernels, "LOGPROB_IMPLS")  # one spelling: both ops take IMPLS
  h, w, t, _ = make_inputs(4, 8, 16, jnp.float32)
  with pytest.raises(ValueError, match=r"unknown fused_logprobs impl 'reference'; choose "
                     r"one of \('auto', 'xla', 'naive', 'pallas', 'interpret'\)"):
    tunix_kernels.fused_logprobs(h, w, t, impl="reference")


def test_block_sizes_and_xla_chunk_are_separate():
  h, w, t, _ = make_inputs(12, 16, 40, jnp.float32)
  want = numpy_logprobs(np.asarray(h), np.asarray(w), np.asarray(t))[0]
  # A BlockSizes is ignored by the xla path, xla_chunk by the others.
  got = tunix_kernels.fused_logprobs(h, w, t, impl="xla", xla_chunk=np.int64(16),
                               block_sizes=tunix_kernels.LogprobsBlockSizes(8, 128))
  assert rel_error(got, want) <= 1e-5
  with pytest.raises(TypeError, match="must be a BlockSizes.*xla_chunk="):
    tunix_kernels.fused_logprobs(h, w, t, impl="xla", block_sizes=16)
  with pytest.raises(TypeError, match="xla_chunk must be an int"):
    tunix_kernels.fused_logprobs(h, w, t, impl="xla", xla_chunk=16.0)
  with pytest.raises(ValueError, match="xla chunk must be positive"):
    tunix_kernels.fused_logprobs(h, w, t, impl="xla", xla_chunk=0)


TPU_V5E = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")


def test_auto_follows_the_mesh_being_compiled_for():
  resolve = functools.partial(dispatch.resolve_impl, "fused_logprobs")
  assert dispatch.target_platform() == "cpu" and resolve("auto") == "xla"  # no mesh
  assert resolve("interpret") == "interpret"
  with pytest.raises(ValueError, match="unknown fused_logprobs impl 'tpu'"):
    resolve("tpu")
  with jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("data",), (AxisType.Explicit,),
                                                   abstract_device=TPU_V5E)):
    assert dispatch.target_platform() == "tpu" and resolve("auto") == "pallas"

  seen = []

  def record(x):
    seen.append((dispatch.target_platform(), resolve("auto")))
    return x

  for mesh in (Mesh(np.array(jax.devices()[:2]), ("data",)),
               AbstractMesh((2,), ("data",), (AxisType.Auto,), abstract_device=TPU_V5E)):
    f = jax.shard_map(record, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    jax.jit(f).trace(jax.ShapeDtypeStruct((4,), jnp.float32))
  assert seen == [("cpu", "xla"), ("tpu", "pallas")]
  with jax.set_mesh(Mesh(np.array(jax.devices()[:2]), ("data",))):
    assert resolve("auto") == "xla"


def test_xla_bf16_workaround_follows_the_compile_target():
  # The chunk-in-a-conditional workaround is for XLA:CPU only: it is traced for this CPU
  # host and left out when the computation is compiled for TPU.
  shapes = (jax.ShapeDtypeStruct((8, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 256), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32))
  f = lambda h, w, t: tunix_kernels.fused_logprobs(h, w, t, impl="xla", xla_chunk=128)
  assert "cond" in str(jax.make_jaxpr(f)(*shapes))
  tpu = AbstractMesh((1,), ("data",), abstract_device=TPU_V5E)
  on_tpu = jax.shard_map(f, mesh=tpu, in_specs=(P(), P(), P()), out_specs=P())
  assert "cond" not in str(jax.jit(on_tpu).trace(*shapes).jaxpr)


class SameWithAndWithoutJitTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters((impl, impl) for impl in ("xla", "naive", "interpret"))
  def test_against_float64(self, impl):
    h, w, t, g = make_inputs(10, 16, 200, jnp.float32)

    @self.variant
    def fwd_bwd(h, w, t, g):
      # Each impl ignores the other impls' tiling argument.
      f = lambda h, w: tunix_kernels.fused_logprobs(
          h, w, t, impl=impl, block_sizes=tunix_kernels.LogprobsBlockSizes(8, 128), xla_chunk=64)
      out, vjp = jax.vjp(f, h, w)
      return (out, *vjp(g))

    out, dh, dw = fwd_bwd(h, w, t, g)
    h64, w64, t64 = np.asarray(h), np.asarray(w), np.asarray(t)
    want_dh, want_dw = numpy_logprob_grads(h64, w64, t64, np.asarray(g))
    assert rel_error(out, numpy_logprobs(h64, w64, t64)[0]) <= 1e-5
    assert rel_error(dh, want_dh) <= 1e-5
    assert rel_error(dw, want_dw) <= 1e-5
