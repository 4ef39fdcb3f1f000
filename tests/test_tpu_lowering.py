"""The Pallas kernels lowered for TPU on CPU (`jax.export(platforms=["tpu"])`).

Mosaic's lowering checks block shapes against TPU tiling rules, so a tiling mistake
fails here even though no TPU exists.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, PartitionSpec as P

import tunix_kernels
from tunix_kernels.logprobs import blocks as logprobs_blocks
from tunix_kernels.logprobs import pallas as logprobs_pallas

TPU_V5E = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")


def _export_logprobs(N, D, V, dtype, block_sizes=None):
  args = (jax.ShapeDtypeStruct((N, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
          jax.ShapeDtypeStruct((N,), jnp.int32))

  def fwd_bwd(h, w, t):
    f = lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl="pallas", block_sizes=block_sizes)
    logp, vjp = jax.vjp(f, h, w)
    return logp, vjp(jnp.ones_like(logp))

  return export.export(jax.jit(fwd_bwd), platforms=["tpu"])(*args)


@pytest.mark.parametrize("N,D,V", [(8192, 4096, 128256), (8192, 2304, 256000)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_logprobs_lower_at_production_shapes(N, D, V, dtype):
  exported = _export_logprobs(N, D, V, dtype)
  assert exported.platforms == ("tpu",)
  # the forward and the fused backward
  assert exported.mlir_module().count("tpu_custom_call") == 2


def _unchecked_block_sizes(block_n, block_v):
  """A `BlockSizes` built past its `__post_init__` checks."""
  bs = object.__new__(tunix_kernels.LogprobsBlockSizes)
  for name, value in dict(block_n=block_n, block_v=block_v, block_d=None,
                          vmem_limit_bytes=None).items():
    object.__setattr__(bs, name, value)
  return bs


@pytest.mark.parametrize("block_sizes", [_unchecked_block_sizes(4, 128),
                                         _unchecked_block_sizes(8, 100)])
def test_illegal_block_is_rejected_by_the_tpu_lowering(block_sizes):
  # Call the kernel directly, past the BlockSizes checks, so Mosaic itself must object.
  args = (jax.ShapeDtypeStruct((64, 256), jnp.float32),
          jax.ShapeDtypeStruct((256, 1000 if block_sizes.block_v == 100 else 1024), jnp.float32),
          jax.ShapeDtypeStruct((64,), jnp.int32))
  f = lambda h, w, t: logprobs_pallas.logprobs_pallas(h, w, t, block_sizes, None, False)
  with pytest.raises(ValueError, match="divisible by 8 and 128"):
    export.export(jax.jit(f), platforms=["tpu"])(*args)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_dpo_loss_kernel_lowers(loss_type):
  x = jax.ShapeDtypeStruct((64, 2048), jnp.float32)
  m = jax.ShapeDtypeStruct((64, 2048), jnp.int32)

  def loss(pc, pr, rc, rr, cm, rmask):
    f = lambda pc, pr: tunix_kernels.dpo_loss(pc, pr, rc, rr, chosen_mask=cm, rejected_mask=rmask,
                                        loss_type=loss_type, label_smoothing=0.1,
                                        impl="pallas")[0]
    return jax.value_and_grad(f, argnums=(0, 1))(pc, pr)

  exported = export.export(jax.jit(loss), platforms=["tpu"])(x, x, x, x, m, m)
  assert exported.mlir_module().count("tpu_custom_call") == 2


def _kernels_in(mlir_text):
  """`{kernel_name: (flops, transcendentals, bytes_accessed)}` of each TPU custom call,
  read from its `kernel_name` and the cost estimate in its backend config."""
  found = {}
  for line in mlir_text.splitlines():
    if "tpu_custom_call" not in line or "kernel_name" not in line:
      continue
    name = re.search(r'kernel_name = "([^"]+)"', line).group(1)
    cost = [int(re.search(rf"{key}\\22:\s*(\d+)", line).group(1))
            for key in ("flops", "transcendentals", "bytes_accessed")]
    found[name] = tuple(cost)
  return found


def test_kernel_names_and_cost_estimates_in_the_tpu_module():
  # N=64, D=128, V=1000 in f32 with 32 x 256 tiles: a 2 x 4 grid, the last vocabulary
  # block ragged (masked, not padded). h = 64*128*4 = 32768 B, w = 128*1000*4 = 512000 B,
  # targets [64, 1] lane-padded in HBM to 64*128*4 = 32768 B, the two f32 [64, 128] row
  # statistics 2*32768 = 65536 B.
  exported = _export_logprobs(64, 128, 1000, jnp.float32,
                              tunix_kernels.LogprobsBlockSizes(block_n=32, block_v=256))
  got = _kernels_in(exported.mlir_module())
  assert got == {
      # 2*64*128*1000 flops; 64*1000 exps + 64 rows * 4 vocab blocks of rescales;
      # h once, w once per token block (2), targets, logp and lse.
      "fused_logprobs_fwd": (16384000, 64256, 32768 + 2 * 512000 + 32768 + 65536),
      # logits recomputed once + two gradient matmuls: 6*64*128*1000. h and the [64, 3]
      # row statistics (targets, lse, g; lane-padded to 32768 B) once per vocabulary
      # block (4); w read once,
      # dw written once with its columns padded to 1024 (128*1024*4 B); the float32
      # [64, 128] d_hidden partial written on each of the 4 vocabulary blocks and read
      # back on the last 3.
      "fused_logprobs_bwd": (49152000, 64000, 4 * (32768 + 32768) + 512000 + 524288
                             + (4 + 3) * 32768),
  }
  # Splitting D=256 into 2 blocks (h = 65536 B, w = 1024000 B) re-reads h per
  # vocabulary block in the forward and walks one operand in both backward phases.
  h, w = jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((256, 1000),
                                                                            jnp.float32)
  split = tunix_kernels.LogprobsBlockSizes(block_n=32, block_v=256, block_d=128)
  cost = lambda k: logprobs_blocks.cost_estimate(k, h, w, split).bytes_accessed
  assert cost("fwd") == 4 * 65536 + 2 * 1024000 + 32768 + 65536
  assert cost("dhidden") == 4 * 65536 + 2 * 2 * 1024000 + 32768 + 65536 + 65536
  assert cost("dweight") == 2 * 4 * 65536 + 2 * 1024000 + 4 * (32768 + 65536) + 1024000

  # B=5, T=300 pads to 8 x 384 (one block); six f32 inputs of 8*384*4 = 12288 B, the
  # [8, 128] table 4096 B.
  x = jax.ShapeDtypeStruct((5, 300), jnp.float32)

  def loss(pc, pr, rc, rr, cm, rm):
    f = lambda pc, pr: tunix_kernels.dpo_loss(pc, pr, rc, rr, chosen_mask=cm, rejected_mask=rm,
                                        impl="pallas")[0]
    return jax.value_and_grad(f, argnums=(0, 1))(pc, pr)

  got = _kernels_in(export.export(jax.jit(loss), platforms=["tpu"])(*[x] * 6).mlir_module())
  assert got == {
      # 10 flops per position + 48 per table entry; sigmoid: 6 exps/logs per entry.
      "dpo_loss_fwd": (10 * 8 * 384 + 48 * 8 * 128, 6 * 8 * 128, 6 * 12288 + 4096),
      # one multiply per position per gradient; table + 2 masks in, 2 gradients out.
      "dpo_loss_bwd": (2 * 8 * 384, 0, 4096 + 4 * 12288),
  }


def test_auto_picks_the_tpu_kernels_when_compiling_for_tpu_from_this_cpu_host():
  # A shard_map over a TPU mesh that has no real devices: "auto" must follow the mesh,
  # not this process's CPU backend.
  mesh = AbstractMesh((2,), ("data",), (AxisType.Auto,), abstract_device=TPU_V5E)
  h = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
  t = jax.ShapeDtypeStruct((64,), jnp.int32)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                     out_specs=P())
  def step(h, w, t):
    logp = tunix_kernels.fused_logprobs(h, w, t).reshape(2, 16)
    loss, _ = tunix_kernels.dpo_loss(logp[0], logp[1], logp[0], logp[1])
    return jax.lax.pmean(loss, "data")

  text = export.export(jax.jit(jax.grad(step, argnums=(0, 1))), platforms=["tpu"])(
      h, w, t).mlir_module()
  assert set(_kernels_in(text)) == {"fused_logprobs_fwd", "fused_logprobs_bwd",
                                    "dpo_loss_fwd", "dpo_loss_bwd"}
