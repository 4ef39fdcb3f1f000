"""Tiles of the log-prob kernels: defaults per TPU generation and the VMEM checks.

Whether the chosen tiles really compile is `test_tpu_compile.py` (needs libtpu); these
check the choice itself, on any host.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from tunix_kernels import LogprobsBlockSizes as BlockSizes
from tunix_kernels import tpu

MiB = 1 << 20
HIDDEN_SIZES = (2048, 2304, 3072, 4096, 5120, 8192)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_unknown_chip_defaults_fit_the_smallest_scoped_vmem(dtype):
  for d in HIDDEN_SIZES + (128, 96, 2880, 1728):  # the last two: no 128-multiple divisor
    bs = BlockSizes.get_default(d, dtype)
    assert bs.vmem_limit_bytes is None, bs  # never raised when the chip is unknown
    assert bs.vmem_bytes(d, dtype) <= 0.9 * 16 * MiB, (d, bs)
    assert bs.block_d is None or d % bs.block_d == 0
    bs.check(d, dtype)  # the op's own check agrees
  # Past what 16 MiB can hold ([D, 128] d_weight tiles alone are 2 x 4 MiB at D=16384),
  # the smallest tiles come back rather than an error at trace time.
  assert BlockSizes.get_default(16384, dtype).block_v == 128


@pytest.mark.parametrize("chip", sorted(tpu.CHIPS))
def test_known_chip_defaults_stay_inside_its_vmem(chip):
  info = tpu.get_chip(chip)
  for dtype in (jnp.bfloat16, jnp.float32):
    for d in HIDDEN_SIZES:
      bs = BlockSizes.get_default(d, dtype, chip)
      limit = bs.vmem_limit_bytes or info.scoped_vmem_bytes
      assert limit <= info.vmem_bytes
      assert bs.vmem_bytes(d, dtype) <= 0.9 * limit, (chip, d, bs)
      bs.check(d, dtype, chip)
  # v4 has no VMEM beyond its scoped default; v5e and v6e have 128 MiB per core.
  assert BlockSizes.get_default(4096, jnp.bfloat16, "v4").vmem_limit_bytes is None
  big = BlockSizes.get_default(4096, jnp.bfloat16, "v5e")
  assert big.vmem_limit_bytes and big.block_n * big.block_v > 256 * 256


def test_small_problems_get_small_tiles():
  bs = BlockSizes.get_default(64, jnp.bfloat16, num_tokens=20, vocab_size=300)
  assert (bs.block_n, bs.block_v, bs.block_d) == (32, 384, None)
  bs = BlockSizes.get_default(64, jnp.float32, num_tokens=3, vocab_size=1)
  assert (bs.block_n, bs.block_v) == (8, 128)


def test_check_names_what_does_not_fit():
  bs = BlockSizes(512, 512)  # whole D=4096: 2 x 4 MiB hidden + 2 x 4 MiB weight tiles
  with pytest.raises(ValueError, match="default scoped VMEM of TPU v4"):
    bs.check(4096, jnp.bfloat16, "v4")
  raised = BlockSizes(512, 512, None, 100 * MiB)
  raised.check(4096, jnp.bfloat16, "v5e")  # an explicit limit the chip has room for
  with pytest.raises(ValueError, match="exceeds the 16777216 bytes of VMEM of a TPU v4"):
    raised.check(4096, jnp.bfloat16, "v4")
  with pytest.raises(ValueError, match="block_n=8 must be a positive multiple of 16"):
    BlockSizes(8, 128).check(128, jnp.bfloat16)
  with pytest.raises(ValueError, match="unknown TPU generation 'v9'"):
    bs.check(4096, jnp.bfloat16, "v9")


def test_chip_of_the_mesh_being_compiled_for():
  assert tpu.target_chip() is None  # a CPU host without a TPU mesh
  for kind, name in (("TPU v5 lite", "v5e"), ("TPU v4", "v4"), ("TPU v5", "v5p"),
                     ("TPU v6 lite", "v6e")):
    device = AbstractDevice(device_kind=kind, num_cores=1, platform="tpu")
    mesh = AbstractMesh((2,), ("data",), (AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
      assert tpu.target_chip() == tpu.CHIPS[name] == tpu.get_chip(kind)
  unknown = AbstractDevice(device_kind="TPU v99", num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("data",), (AxisType.Explicit,),
                                                   abstract_device=unknown)):
    assert tpu.target_chip() is None  # an unknown generation gets the safe tiles
