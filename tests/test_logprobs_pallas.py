"""The Pallas log-prob kernels, run in TPU interpret mode on small grids."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import tunix_kernels
from tunix_kernels import IGNORE_INDEX
from tunix_kernels import LogprobsBlockSizes as BlockSizes
from oracles import make_inputs, rel_error, numpy_logprob_grads, numpy_logprobs

SMALL_F32 = BlockSizes(block_n=8, block_v=128)
SMALL_BF16 = BlockSizes(block_n=16, block_v=128)


def _check(h, w, t, g, bs, tol):
  f = lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl="interpret", block_sizes=bs)
  out, vjp = jax.vjp(f, h, w)
  dh, dw = vjp(g)
  h32, w32, t_np = np.asarray(h, np.float32), np.asarray(w, np.float32), np.asarray(t)
  want = numpy_logprobs(h32, w32, t_np)[0]
  want_dh, want_dw = numpy_logprob_grads(h32, w32, t_np, np.asarray(g))
  assert out.dtype == jnp.float32 and dh.dtype == h.dtype and dw.dtype == w.dtype
  assert rel_error(out, want) <= tol, rel_error(out, want)
  assert rel_error(dh, want_dh) <= tol, rel_error(dh, want_dh)
  assert rel_error(dw, want_dw) <= tol, rel_error(dw, want_dw)
  np.testing.assert_array_equal(np.asarray(out)[t_np == IGNORE_INDEX], 0.0)
  return out


@pytest.mark.parametrize("dtype,bs,tol", [(jnp.float32, SMALL_F32, 1e-5),
                                          pytest.param(jnp.bfloat16, SMALL_BF16, 2e-2,
                                                       marks=pytest.mark.slow)])
def test_against_float64_unaligned_sizes(dtype, bs, tol):
  # N=13 (20) and V=300 are not block multiples: a 2 x 3 grid whose last blocks run past
  # the arrays. Interpret mode fills what lies past them with NaN, so any unmasked
  # out-of-range row or column poisons the result.
  h, w, t, g = make_inputs(13 if dtype == jnp.float32 else 20, 32, 300, dtype)
  _check(h, w, t, g, bs, tol)


@pytest.mark.parametrize("dtype,block_n,d,block_d,tol", [
    (jnp.float32, 8, 384, 128, 1e-5),
    pytest.param(jnp.bfloat16, 16, 512, 256, 2e-2, marks=pytest.mark.slow)])
def test_hidden_size_split_into_blocks(dtype, block_n, d, block_d, tol):
  # 3 and 2 hidden blocks with ragged N and V, so the two-phase backward runs on edge
  # blocks too. Float32 d_weight accumulates in place, bfloat16 in VMEM scratch.
  h, w, t, g = make_inputs(block_n + 3, d, 200, dtype)
  _check(h, w, t, g, BlockSizes(block_n, 128, block_d), tol)


@pytest.mark.parametrize("n,v,cores,softcap", [
    (13, 300, 2, 5.0), pytest.param(8, 1000, 2, None, marks=pytest.mark.slow),
    pytest.param(24, 256, 1, None, marks=pytest.mark.slow)])
def test_fused_backward_per_core_partials_without_races(n, v, cores, softcap):
  """The fused backward as a megacore chip runs it: TPU interpret mode with `cores`
  simulated TensorCores splitting the leading grid axis and its race detector on, so a
  d_hidden row written by two cores, or a hand-made copy read before its write lands,
  fails. Ragged N and V (NaN past the edges), a soft-cap, one token block (the rows
  read back are the ones written the step before) and an odd number of vocabulary
  blocks (the last core has fewer), against the float64 oracle."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # private: race state
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  from tunix_kernels.logprobs import pallas as logprobs_pallas  # pylint: disable=g-import-not-at-top
  h, w, t, g = make_inputs(n, 128, v, jnp.float32, scale=3.0)
  t = jnp.where(t == IGNORE_INDEX, 0, t)  # the kernel takes in-range ids
  bs = BlockSizes(8, 128, block_n_bwd=8 if n > 8 else 16, block_v_bwd=256 if v > 300 else 128)
  params = pltpu.InterpretParams(num_cores_or_threads=cores, detect_races=True)
  f = lambda h, w: logprobs_pallas.logprobs_pallas(h, w, t, bs, softcap, params, cores)
  out, vjp = jax.vjp(f, h, w)
  dh, dw = vjp(g)
  assert not interpret_pallas_call.races.races_found
  h64, w64, t_np = np.asarray(h, np.float64), np.asarray(w, np.float64), np.asarray(t)
  want = numpy_logprobs(h64, w64, t_np, softcap=softcap)[0]
  want_dh, want_dw = numpy_logprob_grads(h64, w64, t_np, np.asarray(g), softcap=softcap)
  for got, ref in ((out, want), (dh, want_dh), (dw, want_dw)):
    assert rel_error(got, ref) <= 1e-5, rel_error(got, ref)


def test_explicit_tiles_are_checked_before_compiling():
  h, w, t, _ = make_inputs(8, 256, 128, jnp.float32)
  with pytest.raises(ValueError, match="block_d=384 must divide the hidden size D=256"):
    tunix_kernels.fused_logprobs(h, w, t, impl="interpret", block_sizes=BlockSizes(8, 128, 384))
  h, w = jnp.zeros((8, 8192), jnp.float32), jnp.zeros((8192, 128), jnp.float32)
  # [512, 8192] f32 hidden tiles alone are 2 x 16 MiB: far past any default scoped VMEM.
  with pytest.raises(ValueError, match=r"needs about \d+\.\d MiB of VMEM for D=8192 float32, "
                     r"more than 90% of the default scoped VMEM of the smallest TPU"):
    tunix_kernels.fused_logprobs(h, w, t, impl="interpret", block_sizes=BlockSizes(512, 128))


@pytest.mark.slow  # 8 s of interpret mode; the fast tier keeps the unaligned-size tests
def test_large_logits_all_ignored_rows_and_vocab_of_one():
  h, w, t, g = make_inputs(16, 32, 200, jnp.float32, scale=4e3)  # logits ~ 1e3
  t = t.at[:8].set(IGNORE_INDEX)  # the whole first token block is ignored
  out = _check(h, w, t, g, SMALL_F32, 1e-5)
  assert np.isfinite(np.asarray(out)).all()
  h, w, t, g = make_inputs(8, 16, 1, jnp.float32)
  t = jnp.where(t == IGNORE_INDEX, IGNORE_INDEX, 0)
  out = _check(h, w, t, g, SMALL_F32, 1e-5)
  np.testing.assert_array_equal(np.asarray(out), 0.0)  # log_softmax over one class


def test_matches_xla_under_jit_with_leading_axes():
  h, w, t, _ = make_inputs(16, 32, 256, jnp.float32)
  h, t = h.reshape(2, 8, 32), t.reshape(2, 8)

  @jax.jit
  def both(h, w):
    loss = lambda impl, **kw: jnp.sum(tunix_kernels.fused_logprobs(h, w, t, impl=impl, **kw))
    return (jax.value_and_grad(lambda w: loss("interpret", block_sizes=SMALL_F32))(w),
            jax.value_and_grad(lambda w: loss("xla", xla_chunk=128))(w))

  (a, ga), (b, gb) = both(h, w)
  np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl,kw", [("interpret", dict(block_sizes=SMALL_F32)),
                                     ("xla", dict(xla_chunk=64))])
def test_per_device_inside_shard_map(impl, kw):
  # Hidden states and targets split over 2 devices, the LM head replicated: the head's
  # gradient must come back summed over devices, as for any replicated input.
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  h, w, t, g = make_inputs(16, 32, 128, jnp.float32)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P(), P("data"), P("data")),
                     out_specs=(P("data"), P("data"), P()))
  def per_device(h, w, t, g):
    f = lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl=impl, **kw)
    out, vjp = jax.vjp(f, h, w)
    return (out, *vjp(g))

  out, dh, dw = jax.jit(per_device)(h, w, t, g)
  h64, w64, t64 = np.asarray(h), np.asarray(w), np.asarray(t)
  want_dh, want_dw = numpy_logprob_grads(h64, w64, t64, np.asarray(g))
  assert rel_error(out, numpy_logprobs(h64, w64, t64)[0]) <= 1e-5
  assert rel_error(dh, want_dh) <= 1e-5
  assert rel_error(dw, want_dw) <= 1e-5


def test_bad_block_sizes():
  h, w, t, _ = make_inputs(8, 16, 128, jnp.float32)
  with pytest.raises(ValueError, match="block_v=100 must be a positive multiple of 128"):
    tunix_kernels.fused_logprobs(h, w, t, impl="interpret", block_sizes=BlockSizes(8, 100))
  with pytest.raises(ValueError, match="block_n=8 must be a positive multiple of 16"):
    tunix_kernels.fused_logprobs(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), t,
                           impl="interpret", block_sizes=BlockSizes(8, 128))
  with pytest.raises(ValueError, match="hidden and weight of one dtype, got float32 and"):
    tunix_kernels.fused_logprobs(h, w.astype(jnp.bfloat16), t, impl="interpret")
  with pytest.raises(TypeError, match="must be a BlockSizes"):
    tunix_kernels.fused_logprobs(h, w, t, impl="interpret", block_sizes=128)


def test_block_sizes_check_themselves_on_construction():
  assert tunix_kernels.DPOLossBlockSizes.get_default() == tunix_kernels.DPOLossBlockSizes(block_t=512)
  for bad, message in (((4, 128), "block_n=4 must be a positive multiple of 8"),
                       ((0, 128), "block_n=0 must be a positive multiple of 8"),
                       ((8, 0), "block_v=0 must be a positive multiple of 128"),
                       ((8, 128.0), "block_v=128.0 must be a positive multiple of 128"),
                       ((8, 128, 100), "block_d=100 must be a positive multiple of 128"),
                       ((8, 128, None, 0), "vmem_limit_bytes=0 must be a positive int")):
    with pytest.raises(ValueError, match=message):
      BlockSizes(*bad)
  for block_t in (0, 100, -128):
    with pytest.raises(ValueError, match=f"block_t={block_t} must be a positive multiple"):
      tunix_kernels.DPOLossBlockSizes(block_t=block_t)
  with pytest.raises(dataclasses.FrozenInstanceError):
    BlockSizes.get_default(2048).block_n = 8
