"""The Pallas kernels compiled by the real TPU compiler, ahead of time, for v4, v5e, v5p
and v6e (needs `libtpu`: `pip install -e '.[tpu]'`; skipped without it).

Nothing runs: each case is lowered with `jax.ShapeDtypeStruct` inputs under a mesh of
one device of the chip and compiled, which includes Mosaic's VMEM allocation. Values are
checked in interpret mode by `test_logprobs_pallas.py`; `benchmarks/logprobs_tpu.py`
prints the full matrix.
"""

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import pytest

import tunix_kernels
from tunix_kernels.logprobs import blocks as logprobs_blocks
from tunix_kernels.logprobs import pallas as logprobs_pallas
from tunix_kernels import tpu
from tunix_kernels import aot_tpu
from tunix_kernels import attention as attention_lib

# The benchmark script's compile, by path: the repository is not on sys.path (conftest.py).
_BENCH = importlib.util.spec_from_file_location("logprobs_tpu", os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "logprobs_tpu.py"))
_bench = importlib.util.module_from_spec(_BENCH)
_BENCH.loader.exec_module(_bench)
compile_case = _bench.compile_case

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not aot_tpu.has_libtpu(), reason="needs libtpu (.[tpu] extra)")]

N = 8192
CHIPS = sorted(tpu.CHIPS)
BF16 = jnp.bfloat16
# (tokens, D, V, dtype): a point of the production bf16 grid per chip, every D and V on
# some chip, and on the one-core chips a ragged token count (v6e's in float32; every
# chip's float32 tiles compile in the chip-agnostic test below).
# (`benchmarks/logprobs_tpu.py` compiles the whole grid on every chip.)
GRID = [(N, d, v, BF16) for d in (2048, 4096, 8192) for v in (128256, 256000)]
EXTRA = {"v5e": (8000, 2048, 128256, BF16), "v6e": (4097, 3072, 151936, jnp.float32)}
CASES = [(chip, *GRID[(2 * i + i % 2) % len(GRID)]) for i, chip in enumerate(CHIPS)]
CASES += [(chip, *case) for chip, case in EXTRA.items()]


@pytest.mark.parametrize("chip,n,d,v,dtype", CASES,
                         ids=lambda c: str(getattr(c, "__name__", c)))
def test_fwd_bwd_compiles_with_default_tiles_and_no_more_temp_than_xla(chip, n, d, v, dtype):
  pallas = compile_case(chip, n, d, v, dtype, "auto")  # "auto" under a TPU mesh
  xla = compile_case(chip, n, d, v, dtype, "xla")
  assert pallas["ok"], pallas["error"]
  assert xla["ok"], xla["error"]
  assert pallas["temp"] <= xla["temp"], (pallas["temp"], xla["temp"])
  # The kernels' cost estimates reach the compiled cost analysis: forward 2NDV, the
  # fused backward 6NDV (logits recomputed once), or each split backward kernel 4NDV
  # (v4 at large D); the few XLA ops around them add < 1%.
  bs = tunix_kernels.LogprobsBlockSizes.get_default(d, dtype, chip, num_tokens=n, vocab_size=v)
  assert pallas["flops"] == pytest.approx((8 if bs.fused else 10) * n * d * v, rel=0.01)
  h, w = jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype)
  kernels = ("fwd", "bwd") if bs.fused else ("fwd", "dhidden", "dweight")
  cores = tpu.get_chip(chip).cores
  estimated = sum(logprobs_blocks.cost_estimate(k, h, w, bs, cores=cores).bytes_accessed
                  for k in kernels)
  if bs.fused:  # XLA sums the float32 per-core d_hidden partials into d_hidden
    estimated += cores * n * d * 4 + n * d * jnp.dtype(dtype).itemsize
  assert estimated <= pallas["bytes_accessed"] <= 1.01 * estimated + (64 << 20)


@pytest.mark.parametrize("chip", CHIPS)
def test_tiles_chosen_without_knowing_the_chip_compile_on_every_generation(chip):
  # Traced as a CPU host sees it (no TPU mesh), compiled for the chip: the defaults must
  # fit the smallest default scoped VMEM without raising the limit.
  for d, dtype in ((4096, BF16), (8192, BF16), (4096, jnp.float32)):
    got = compile_case(chip, N, d, 128256, dtype, "pallas", chip_known=False)
    assert got["ok"], (d, dtype, got["error"])


@pytest.mark.parametrize("chip", CHIPS)
def test_soft_capped_gemma2_head_compiles(chip):
  # Gemma 2 2B's head: D=2304, V=256000, final logits capped at 30.
  got = compile_case(chip, N, 2304, 256000, BF16, "auto", logit_softcap=30.0)
  assert got["ok"], got["error"]


@pytest.mark.parametrize("d,dtype,bs", [
    # the fused backward's tiles past the limit (the forward's fit)
    (2048, BF16, tunix_kernels.LogprobsBlockSizes(128, 128, block_n_bwd=512,
                                                  block_v_bwd=1024)),
    (4096, BF16, tunix_kernels.LogprobsBlockSizes(256, 512, 1024)),  # the split kernels
    (2048, jnp.float32, tunix_kernels.LogprobsBlockSizes(512, 1024)),
])
def test_vmem_model_is_at_least_what_the_compiler_allocates(d, dtype, bs):
  # Tiles past the 16 MiB default: the compiler's error names the scoped allocation it
  # wanted for the first kernel that does not fit; `vmem_bytes` must not be below it.
  # Called past the op's own check, which would refuse these tiles first.
  def f(h, w, t):
    loss = lambda h, w: jnp.sum(logprobs_pallas.logprobs_pallas(h, w, t, bs, None, False))
    return jax.grad(loss, argnums=(0, 1))(h, w)

  shapes = (jax.ShapeDtypeStruct((N, d), dtype), jax.ShapeDtypeStruct((d, 128256), dtype),
            jax.ShapeDtypeStruct((N,), jnp.int32))
  with pytest.raises(Exception, match="CompileTimeScopedVmemOom") as info:
    aot_tpu.compile_for("v5e", f, *shapes)
  wanted = re.search(r"Scoped allocation with size ([\d.]+)M", str(info.value))
  assert wanted, str(info.value)[:500]
  assert bs.vmem_bytes(d, dtype) >= float(wanted.group(1)) * 2**20


@pytest.mark.parametrize("chip", CHIPS)
def test_dpo_loss_kernels_compile_up_to_64_pairs_of_8192_tokens(chip):
  def loss(pc, pr, rc, rr, cm, rm):
    f = lambda pc, pr: tunix_kernels.dpo_loss(pc, pr, rc, rr, chosen_mask=cm, rejected_mask=rm,
                                        label_smoothing=0.1)[0]
    return jax.value_and_grad(f, argnums=(0, 1))(pc, pr)

  for b, t in ((64, 8192), (37, 3000), (1, 128)):
    x = jax.ShapeDtypeStruct((b, t), jnp.float32)
    m = jax.ShapeDtypeStruct((b, t), jnp.int32)
    compiled = aot_tpu.compile_for(chip, loss, x, x, x, x, m, m)
    assert "dpo_loss_fwd" in compiled.as_text()


# (chip, rows, query heads, key/value heads, head dim): the tile sweep's corners
# (`test_tiles.py`), compiled with the tiles the op picks. Qwen2.5-0.5B's 7-head groups
# at head dim 64 overflowed VMEM at 8,192 tokens while the model counted 64 lanes.
ATTENTION_SAMPLE = [("v5e", 8192, 14, 2, 64), ("v6e", 5000, 16, 2, 128),
                    ("v4", 2800, 8, 4, 256), ("v5p", 12345, 4, 4, 64)]


@pytest.mark.parametrize("chip,t,h,kv,k", ATTENTION_SAMPLE, ids=str)
def test_attention_default_tiles_compile_forward_and_backward(chip, t, h, kv, k):
  def f(q, k_, v, positions):
    vis = attention_lib.Visibility(positions, jnp.ones_like(positions))
    out = lambda q, k_, v: attention_lib.attention(
        q, k_, v, vis, scale=k ** -0.5, impl="pallas").astype(jnp.float32).sum()
    return jax.grad(out, argnums=(0, 1, 2))(q, k_, v)

  shape = lambda heads: jax.ShapeDtypeStruct((1, t, heads, k), BF16)
  aot_tpu.compile_for(chip, f, shape(h), shape(kv), shape(kv),
                      jax.ShapeDtypeStruct((1, t), jnp.int32))


def test_logprob_default_tiles_compile_at_hidden_sizes_off_the_lanes():
  # SmolLM2-135M's and -360M's heads (D = 576, 960: [block_n, D] tiles padded to 640
  # and 1,024 lanes) at ragged token counts.
  for chip, n, d, v in (("v5e", 5000, 576, 49152), ("v6e", 12345, 960, 49152)):
    got = compile_case(chip, n, d, v, BF16, "auto")
    assert got["ok"], (chip, n, d, got["error"])
