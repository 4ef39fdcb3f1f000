"""Every Pallas kernel's tile choice fits its VMEM at every shape, on every generation.

No compile: the tiles the kernels would take (`BlockSizes.get_default`, and for
attention the backward's plan) are checked against the kernels' own VMEM model
(`vmem_bytes`, `fused_backward_bytes`) and the chip's limits. That the model is at
least what Mosaic allocates is `test_tpu_compile.py`'s (ahead of time, libtpu).
"""

import itertools

import jax.numpy as jnp
import pytest

from tunix_kernels import tpu
from tunix_kernels.attention import blocks as attention_blocks
from tunix_kernels.dpo_loss import pallas as loss_pallas
from tunix_kernels.logprobs import blocks as logprobs_blocks

CHIPS = [tpu.CHIPS[name] for name in sorted(tpu.CHIPS)]
ROWS = (128, 200, 1000, 1280, 2048, 2800, 4096, 5000, 8192, 12345, 16384, 32768)
SMEM_LIST_BYTES = 256 << 10  # the attention kernels' visit lists (`attention.__init__`)


def _room(limit, chip):
  """The share of a kernel's VMEM limit its tiles may fill (None: the chip's default)."""
  assert limit is None or limit <= chip.vmem_bytes, (limit, chip.vmem_bytes)
  return (limit or chip.scoped_vmem_bytes) * tpu.VMEM_HEADROOM


@pytest.mark.parametrize("chip", CHIPS, ids=lambda c: c.name)
def test_attention_tiles_fit_vmem_at_every_shape(chip):
  for head_dim, groups, seq_len, dtype in itertools.product(
      (64, 128, 256), range(1, 9), ROWS, (jnp.bfloat16, jnp.float32)):
    bs = attention_blocks.BlockSizes.get_default(head_dim, dtype, chip, seq_len=seq_len,
                                                 groups=groups)
    shape = (chip.name, head_dim, groups, seq_len, jnp.dtype(dtype).name, bs)
    assert bs.vmem_bytes(head_dim, dtype) <= _room(bs.vmem_limit_bytes, chip), shape
    fused, limit = bs.backward_plan(head_dim, dtype, seq_len, chip, groups)
    if fused:
      need = bs.fused_backward_bytes(head_dim, dtype, seq_len, groups)
      assert need <= _room(limit, chip), shape
    bq, bk = bs.tiles(seq_len)
    assert -(-seq_len // bq) * -(-seq_len // bk) * 4 <= SMEM_LIST_BYTES, shape


def test_attention_vmem_counts_a_head_dim_of_64_as_128_lanes():
  # Mosaic lays a [rows, 64] tile over whole 128-lane vregs: at 64 the tiles take what
  # they take at 128 (the figure the compiler refused Qwen2.5-0.5B's backward over).
  bs = attention_blocks.BlockSizes(512, 1024)
  for dtype in (jnp.bfloat16, jnp.float32):
    assert bs.vmem_bytes(64, dtype) == bs.vmem_bytes(128, dtype)
    assert (bs.fused_backward_bytes(64, dtype, 2800, 7)
            == bs.fused_backward_bytes(128, dtype, 2800, 7))
  assert bs.vmem_bytes(256, jnp.bfloat16) > bs.vmem_bytes(128, jnp.bfloat16)


@pytest.mark.parametrize("chip", CHIPS, ids=lambda c: c.name)
def test_logprob_tiles_fit_vmem_at_every_shape(chip):
  for d, v, n, dtype in itertools.product(
      (576, 896, 960, 2048, 2304, 3584, 4096, 8192), (32000, 49152, 128256, 151936, 256000),
      ROWS, (jnp.bfloat16, jnp.float32)):
    bs = logprobs_blocks.BlockSizes.get_default(d, dtype, chip, num_tokens=n, vocab_size=v)
    bs.check(d, dtype, chip)  # ValueError naming the tiles if they do not fit


def test_logprob_vmem_counts_the_hidden_size_in_whole_lanes():
  # SmolLM2-135M's D = 576 occupies 640 lanes of a [block_n, D] tile.
  assert (logprobs_blocks._fwd_vmem(256, 512, 576, 2)  # pylint: disable=protected-access
          == logprobs_blocks._fwd_vmem(256, 512, 640, 2))  # pylint: disable=protected-access


def test_loss_tiles_fit_vmem_at_every_shape():
  for rows, seq_len in itertools.product((1, 8, 37, 64, 512, 1100, 4096, 20000), ROWS):
    bs = loss_pallas.BlockSizes.get_default(rows, seq_len)
    assert bs.block_t <= -(-seq_len // 128) * 128
    assert bs.vmem_bytes(rows) <= tpu.MIN_SCOPED_VMEM_BYTES * tpu.VMEM_HEADROOM, (rows, bs)
    assert bs.block_b is None or bs.block_b >= 256, (rows, seq_len, bs)  # as many as fit
    assert rows > 64 or bs.block_b is None, (rows, seq_len, bs)
