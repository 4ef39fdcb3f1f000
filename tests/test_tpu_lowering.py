"""The Pallas kernels lowered for TPU on CPU (`jax.export(platforms=["tpu"])`).

Mosaic's lowering checks block shapes against TPU tiling rules, so a tiling mistake
fails here even though no TPU exists.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import export

import kernels
from kernels import logprobs_pallas


def _export_logprobs(N, D, V, dtype, block_sizes=None):
  args = (jax.ShapeDtypeStruct((N, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
          jax.ShapeDtypeStruct((N,), jnp.int32))

  def fwd_bwd(h, w, t):
    f = lambda h, w: kernels.fused_logprobs(h, w, t, impl="pallas", block_sizes=block_sizes)
    logp, vjp = jax.vjp(f, h, w)
    return logp, vjp(jnp.ones_like(logp))

  return export.export(jax.jit(fwd_bwd), platforms=["tpu"])(*args)


@pytest.mark.parametrize("N,D,V", [(8192, 4096, 128256), (8192, 2304, 256000)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_logprobs_lower_at_production_shapes(N, D, V, dtype):
  exported = _export_logprobs(N, D, V, dtype)
  assert exported.platforms == ("tpu",)
  # forward, d_hidden and d_weight kernels
  assert exported.mlir_module().count("tpu_custom_call") == 3


@pytest.mark.parametrize("block_sizes", [logprobs_pallas.BlockSizes(block_n=4, block_v=128),
                                         logprobs_pallas.BlockSizes(block_n=8, block_v=100)])
def test_illegal_block_is_rejected_by_the_tpu_lowering(block_sizes):
  # Call the kernel directly, past BlockSizes.validate, so Mosaic itself must object.
  args = (jax.ShapeDtypeStruct((64, 256), jnp.float32),
          jax.ShapeDtypeStruct((256, 1000 if block_sizes.block_v == 100 else 1024), jnp.float32),
          jax.ShapeDtypeStruct((64,), jnp.int32))
  f = lambda h, w, t: logprobs_pallas.logprobs_pallas(h, w, t, block_sizes, 1000, False)
  with pytest.raises(ValueError, match="divisible by 8 and 128"):
    export.export(jax.jit(f), platforms=["tpu"])(*args)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_dpo_loss_kernel_lowers(loss_type):
  x = jax.ShapeDtypeStruct((64, 2048), jnp.float32)
  m = jax.ShapeDtypeStruct((64, 2048), jnp.int32)

  def loss(pc, pr, rc, rr, cm, rmask):
    f = lambda pc, pr: kernels.dpo_loss(pc, pr, rc, rr, chosen_mask=cm, rejected_mask=rmask,
                                        loss_type=loss_type, label_smoothing=0.1,
                                        impl="pallas")[0]
    return jax.value_and_grad(f, argnums=(0, 1))(pc, pr)

  exported = export.export(jax.jit(loss), platforms=["tpu"])(x, x, x, x, m, m)
  assert exported.mlir_module().count("tpu_custom_call") == 2
