"""Tiles of the log-prob kernels: defaults per TPU generation and the VMEM checks.

Whether the chosen tiles really compile is `test_tpu_compile.py` (needs libtpu); these
check the choice itself, on any host.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from tunix_kernels import LogprobsBlockSizes as BlockSizes
from tunix_kernels import tpu
from tunix_kernels import tuned
from tunix_kernels.logprobs import blocks as logprobs_blocks

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


def test_get_default_takes_a_generations_measured_tiles(tmp_path, monkeypatch):
  """A table in `tuned/` decides the tiles on its generation for its D and dtype at the
  nearest measured vocabulary (within 2x), capped at the head, the VMEM limit raised as
  far as they need; tiles that do not fit, another D, chip or vocabulary keep the rule."""
  (tmp_path / "v5e.json").write_text(json.dumps({"entries": [
      dict(d_model=4096, dtype="bfloat16", vocab_size=128256, block_n=1024, block_v=1024,
           block_n_bwd=256, block_v_bwd=1024),
      dict(d_model=4096, dtype="bfloat16", vocab_size=32000, block_n=512, block_v=512,
           block_n_bwd=128, block_v_bwd=512),
      dict(d_model=2048, dtype="bfloat16", vocab_size=128256, block_n=4096, block_v=4096,
           block_n_bwd=4096, block_v_bwd=4096)]}))  # far past 128 MiB of VMEM
  get = BlockSizes.get_default
  others = [(4096, jnp.bfloat16, "v5e", 8192, 8000),  # more than 2x from every entry
            (4096, jnp.float32, "v5e", 8192, 128256), (4096, jnp.bfloat16, "v6e", 8192, 128256),
            (2048, jnp.bfloat16, "v5e", 8192, 128256)]  # the entry does not fit

  def with_table(directory):
    monkeypatch.setattr(logprobs_blocks, "TUNED_DIR", str(directory))
    tuned.load.cache_clear()
    return [get(d, dt, c, num_tokens=n, vocab_size=v) for d, dt, c, n, v in others]

  try:
    assert with_table(tmp_path) == with_table(tmp_path / "no-table")
    with_table(tmp_path)
    bs = get(4096, jnp.bfloat16, "v5e", num_tokens=8192, vocab_size=100000)
    assert (bs.block_n, bs.block_v, bs.backward_tiles) == (1024, 1024, (256, 1024)), bs
    # Hand-sized: 2 x (1024 + 1024) x 4096 bf16 tiles (32 MiB) and 5 [1024, 1024]
    # float32 temporaries (20 MiB), past the 16 MiB default: the limit raised for them.
    assert 52 * MiB < bs.vmem_bytes(4096, jnp.bfloat16) <= 0.9 * bs.vmem_limit_bytes
    assert bs.vmem_limit_bytes <= bs.vmem_bytes(4096, jnp.bfloat16) / 0.9 + MiB
    small = get(4096, jnp.bfloat16, "v5e", num_tokens=300, vocab_size=40000)
    assert (small.block_n, small.block_v, small.backward_tiles) == (304, 512, (128, 512))
    assert get(4096, jnp.bfloat16, "v5e") == bs  # no vocabulary given: the largest
  finally:
    tuned.load.cache_clear()


def test_shipped_tables_fit_their_chips():
  """Every shipped entry is what `get_default` gives for its own head: tiles within its
  generation's VMEM, the scoped limit raised where they need it, that `check` accepts."""
  names = sorted(os.listdir(logprobs_blocks.TUNED_DIR))
  assert names, "no table shipped"
  for name in names:
    chip = tpu.get_chip(name.removesuffix(".json"))
    for e in tuned.load(logprobs_blocks.TUNED_DIR, chip.name):
      bs = BlockSizes.get_default(e["d_model"], e["dtype"], chip, num_tokens=e["num_tokens"],
                                  vocab_size=e["vocab_size"])
      assert (bs.block_n, bs.block_v, *bs.backward_tiles) == (
          e["block_n"], e["block_v"], e["block_n_bwd"], e["block_v_bwd"]), (name, e)
      bs.check(e["d_model"], e["dtype"], chip)


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


def _fetched_bytes(call, cores=1) -> int:
  """HBM bytes a `pallas_call` moves through its BlockSpecs, counted from its grid and
  index maps alone: an input block is fetched, and an output block written back,
  whenever its block index changes between consecutive grid steps of a core (the last
  axis the fastest; a megacore chip's `cores` take contiguous shares of the leading
  axis, each starting afresh), each time the block's in-bounds part of its array, its
  minor dimension padded to 128 lanes as HBM's (8, 128) tiles lay out a narrow one.
  Operands left in HBM (`memory_space=ANY`) are moved by hand and not counted here."""
  grid = call["grid"]
  steps = np.stack(np.meshgrid(*[np.arange(g) for g in grid], indexing="ij"), -1)
  steps = steps.reshape(-1, len(grid))
  core = steps[:, 0] * cores // grid[0]
  total = 0
  for spec, operand in zip(call["in_specs"] + call["out_specs"],
                           call["operands"] + call["out_shape"]):
    if spec.block_shape is None:
      continue
    index = spec.index_map(*[steps[:, a] for a in range(len(grid))])
    index = np.stack([np.broadcast_to(np.asarray(x), len(steps)) for x in index], -1)
    moved = np.ones(len(steps), bool)
    moved[1:] = (index[1:] != index[:-1]).any(-1) | (core[1:] != core[:-1])
    blocks, counts = np.unique(index[moved], axis=0, return_counts=True)
    for block, count in zip(blocks, counts):
      extent = [min(b, dim - i * b) for i, b, dim in
                zip(block, spec.block_shape, operand.shape)]
      extent[-1] = -(-extent[-1] // 128) * 128
      total += int(count) * int(np.prod(extent)) * np.dtype(operand.dtype).itemsize
  return total


def _fused_backward_dma_bytes(call, n, d, v, bs) -> int:
  """What the fused backward moves by hand: each core walks its run of vocabulary
  blocks over every token block, writing that block's float32 `[bn, D]` d_hidden partial
  each step and reading it back first on every block after the core's first; and each
  d_weight column is copied out once."""
  cores, per, nb = call["grid"]
  bn, bv = bs.backward_tiles
  vb = -(-v // bv)
  moved = d * v * 2
  for c in range(cores):
    for jj in range(min(per, vb - c * per)):
      moved += nb * bn * d * 4 * (2 if jj else 1)
  return moved


def _record_pallas_calls(module, monkeypatch) -> list:
  """Makes `module`'s `pallas_call`s record their grid, specs, operands and estimate
  (and return zeros) instead of compiling: the calls of whatever is traced next."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  calls = []

  def record(kernel, *, grid, in_specs, out_specs, out_shape, cost_estimate, name, **_):
    del kernel

    def run(*operands):
      outs = list(out_shape) if isinstance(out_shape, (list, tuple)) else [out_shape]
      calls.append(dict(name=name, grid=grid, in_specs=list(in_specs),
                        out_specs=list(out_specs) if isinstance(out_specs, (list, tuple))
                        else [out_specs], operands=list(operands), out_shape=outs,
                        cost=cost_estimate))
      zeros = [jnp.zeros(o.shape, o.dtype) for o in outs]
      return zeros if isinstance(out_shape, (list, tuple)) else zeros[0]
    return run

  monkeypatch.setattr(module, "pl", type("Pallas", (), dict(
      vars(pl), pallas_call=staticmethod(record))))
  return calls


@pytest.mark.parametrize("chip", ["v4", "v5e", "v5p", "v6e"])
@pytest.mark.parametrize("n,d,v", [(8192, 4096, 128256), (4096, 8192, 128256),
                                   (8192, 2304, 256000)])
def test_cost_estimates_count_the_bytes_pallas_fetches(chip, n, d, v, monkeypatch):
  """Each log-prob kernel's `cost_estimate` bytes equal the bytes its grid and
  BlockSpecs (and, in the fused backward, its hand-made copies) move at the default
  tiles of Llama-3-8B's, Llama-3-70B's and Gemma-2-2B's heads (traced abstractly,
  nothing runs); v4's small VMEM gets the split kernels at some of them."""
  from tunix_kernels.logprobs import fused_bwd as logprobs_fused_bwd  # pylint: disable=g-import-not-at-top
  from tunix_kernels.logprobs import pallas as logprobs_pallas  # pylint: disable=g-import-not-at-top
  calls = _record_pallas_calls(logprobs_pallas, monkeypatch)
  calls_bwd = _record_pallas_calls(logprobs_fused_bwd, monkeypatch)
  cores = tpu.get_chip(chip).cores
  bs = BlockSizes.get_default(d, jnp.bfloat16, chip, num_tokens=n, vocab_size=v)
  hidden = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
  targets = jax.ShapeDtypeStruct((n,), jnp.int32)

  def fwd_bwd(h, w, t):
    logp, lse = logprobs_pallas.forward(h, w, t, bs, None, False, cores)
    return logprobs_pallas.backward(h, w, t, lse, logp, bs, None, False, cores)

  jax.eval_shape(fwd_bwd, hidden, weight, targets)
  calls += calls_bwd
  assert [c["name"] for c in calls] == ["fused_logprobs_fwd"] + (
      ["fused_logprobs_bwd"] if bs.fused else
      ["fused_logprobs_dhidden", "fused_logprobs_dweight"])
  if chip != "v4":  # the fused backward wherever whole-D tiles fit
    assert bs.fused, bs
  for c in calls:
    moved = _fetched_bytes(c, cores)
    if c["name"] == "fused_logprobs_bwd":
      moved += _fused_backward_dma_bytes(c, n, d, v, bs)
    assert c["cost"].bytes_accessed == moved, (c["name"], bs)
    assert c["cost"].flops == (6 if c["name"] == "fused_logprobs_bwd" else
                               2 if c["name"] == "fused_logprobs_fwd" else 4) * n * d * v


@pytest.mark.parametrize("B,T", [(16, 1024), (64, 4096)])
def test_dpo_loss_cost_estimates_count_the_bytes_pallas_fetches(B, T, monkeypatch):
  """The same for the DPO loss kernels at their default tiles."""
  from tunix_kernels.dpo_loss import pallas as dpo_loss_pallas  # pylint: disable=g-import-not-at-top
  calls = _record_pallas_calls(dpo_loss_pallas, monkeypatch)
  bs = dpo_loss_pallas.BlockSizes.get_default()
  rows = jax.ShapeDtypeStruct((B, T), jnp.float32)

  def fwd_bwd(*x):  # pylint: disable=protected-access
    table = dpo_loss_pallas._forward(*x, 0.1, "sigmoid", 0.0, B, bs, False)
    return dpo_loss_pallas._backward(table, x[4], x[5], bs, False)

  jax.eval_shape(fwd_bwd, *[rows] * 6)
  assert [c["name"] for c in calls] == ["dpo_loss_fwd", "dpo_loss_bwd"]
  for c in calls:
    assert c["cost"].bytes_accessed == _fetched_bytes(c), c["name"]
