"""`fused_logprobs`: per-token log-probs of targets under a linear LM head.

The public op flattens leading axes, checks its inputs, routes ignored positions
(`targets == ignore_index`) to a valid id with zero cotangent, and dispatches through
`tunix_kernels.dispatch` to an implementation. The `[N, V]` logits are only ever built by
`impl="naive"`. With `vocab_axis` the weight is one device's vocabulary slice and
`tunix_kernels.logprobs.vocab` combines the slices' results across that `shard_map` axis.

The package is the op; its modules are the chunked XLA path (`xla`), the Pallas TPU
kernels (`pallas`: forward, split backward; `fused_bwd`: both gradients from one logit
recompute) and their tile math (`tile`), the tiles, VMEM model and cost estimates
(`blocks`), the vocabulary-parallel combine (`vocab`) and the GSPMD rule (`gspmd`).
"""

import operator

import jax
import jax.numpy as jnp
import numpy as np
from tunix_kernels import common
from tunix_kernels import dispatch
# Not `gspmd`: the package's own `gspmd` submodule owns that name in this namespace.
from tunix_kernels import gspmd as gspmd_lib
from tunix_kernels.logprobs import blocks as logprobs_blocks
from tunix_kernels.logprobs import gspmd as logprobs_gspmd
from tunix_kernels.logprobs import pallas as logprobs_pallas
from tunix_kernels.logprobs import vocab as logprobs_vocab
from tunix_kernels.logprobs import xla as logprobs_xla
from tunix_kernels import naive
from tunix_kernels import tpu
from tunix_kernels.dispatch import IGNORE_INDEX

DEFAULT_XLA_CHUNK = 4096


def _check_targets_concrete(targets, vocab_size, ignore_index):
  if isinstance(targets, jax.core.Tracer):
    return
  t = np.asarray(targets)
  bad = (t != ignore_index) & ((t < 0) | (t >= vocab_size))
  if bad.any():
    raise ValueError(f"targets out of range [0, {vocab_size}): found {t[bad][:5].tolist()} "
                     f"(ignore_index is {ignore_index})")


def fused_logprobs(hidden, weight, targets, *, impl="auto", block_sizes=None,
                   xla_chunk=None, ignore_index=IGNORE_INDEX, logit_softcap=None,
                   vocab_axis=None):
  """`log_softmax(cap(hidden @ weight))[targets]` without materialising the logits.

  Args:
    hidden: `[..., D]` bf16 or f32; differentiable.
    weight: `[D, V]`; differentiable. With `vocab_axis`, this device's slice `[D, V/K]`.
    targets: `[...]` int32 ids in `[0, V)`, or `ignore_index`; global ids with `vocab_axis`.
    impl: one of `tunix_kernels.IMPLS`: "pallas" (Mosaic TPU kernels), "interpret" (the same
      kernels in TPU interpret mode, for CPU tests), "xla" (chunked `lax.scan`), "naive"
      (materialises the logits; the oracle), "auto" (pallas when the devices it is
      compiled for are TPUs, else xla; see `dispatch.target_platform`).
    block_sizes: tiles of the Pallas kernels ("pallas"/"interpret"), a
      `tunix_kernels.LogprobsBlockSizes`; ignored by the other impls, anything else is a
      TypeError. None picks `LogprobsBlockSizes.get_default(D, dtype, chip)` for the
      TPU generation being compiled for (`tunix_kernels.tpu.target_chip`); when that is
      unknown (a CPU host), tiles that fit every generation's default VMEM. Explicit
      tiles that cannot fit are a ValueError before anything is compiled.
    xla_chunk: the largest vocabulary chunk of the "xla" path, an int (default 4096;
      see `pick_chunk`); ignored by the other impls.
    ignore_index: target value whose position returns 0 and gets zero gradient.
    logit_softcap: None, or a positive float c: the logits become `c * tanh(logits / c)`
      before the softmax (Gemma 2's final soft-cap), applied per tile in every impl, and
      its derivative `1 - tanh^2` enters every backward.
    vocab_axis: None, or the name of a mesh axis of the enclosing `jax.shard_map`, of K
      devices, for a vocabulary-parallel LM head: `hidden` and `targets` are the same on
      every device of the axis, `weight` is device k's contiguous slice `[D, V/K]` of
      global ids `[k V/K, (k+1) V/K)`. Each device runs `impl` on its slice; the
      log-sum-exp is combined across the axis and each target logit comes from its owner
      (one pmax and two psums of `[N]`), so every device returns the same log-probs and
      no `[N, V/K]` array is built beyond what `impl` builds. `hidden` gets its full
      gradient on every device and `weight` its slice's gradient, under `check_vma`
      True or False when gradients are taken inside the `shard_map` body (as the
      trainer does), and also from outside under `check_vma=True`. (From outside a
      `check_vma=False` shard_map, JAX hands each device 1/K of the replicated output's
      cotangent, so the weight's gradient comes out divided by K; see
      `tunix_kernels.logprobs.vocab`.)

  Under plain `jax.jit` (outside any `shard_map`) the Pallas impls partition over the
  operands' shardings (`tunix_kernels.logprobs.gspmd`): tokens and the weight's vocabulary stay
  split where they arrive, D is gathered; see docs/embedding.md.

  Returns:
    float32 array with the shape of `targets`, differentiable in `hidden` and `weight`
    (custom VJP; gradients in their dtypes). The log-sum-exp is accumulated in float32
    whatever the input dtype.
  """
  impl = dispatch.resolve_impl("fused_logprobs", impl)
  if block_sizes is not None and not isinstance(block_sizes, logprobs_blocks.BlockSizes):
    raise TypeError("block_sizes for the Pallas kernels must be a BlockSizes "
                    f"(tunix_kernels.LogprobsBlockSizes), got {block_sizes!r}; the xla path's "
                    "vocabulary chunk is xla_chunk=")
  try:
    max_chunk = DEFAULT_XLA_CHUNK if xla_chunk is None else operator.index(xla_chunk)
  except TypeError:
    raise TypeError(f"xla_chunk must be an int, got {xla_chunk!r}") from None
  if hidden.shape[:-1] != targets.shape:
    raise ValueError(f"hidden {hidden.shape} and targets {targets.shape} disagree: hidden "
                     "must be targets.shape + (D,)")
  if weight.ndim != 2 or weight.shape[0] != hidden.shape[-1]:
    raise ValueError(f"weight must be [D, V] with D = {hidden.shape[-1]}, got {weight.shape}")
  if not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"targets must be integer, got {targets.dtype}")
  vocab_size = weight.shape[1]
  if vocab_axis is not None:
    vocab_size *= _vocab_axis_size(vocab_axis)
  _check_targets_concrete(targets, vocab_size, ignore_index)
  if logit_softcap is not None:
    if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, (int, float)) or \
        not logit_softcap > 0:
      raise ValueError(f"logit_softcap must be a positive float or None, got "
                       f"{logit_softcap!r}")
    logit_softcap = float(logit_softcap)

  if impl == "naive" and vocab_axis is None:
    return naive.logprobs_naive(hidden, weight, targets, ignore_index=ignore_index,
                                logit_softcap=logit_softcap)

  def local(hidden_NxD, weight_DxV, safe_N):  # every id in range
    if impl == "naive":
      return naive.logprobs_naive(hidden_NxD, weight_DxV, safe_N, ignore_index=-1,
                                  logit_softcap=logit_softcap)
    if impl == "xla":
      chunk = pick_chunk(weight_DxV.shape[1], max_chunk)
      return logprobs_xla.logprobs_xla(hidden_NxD, weight_DxV, safe_N, chunk, logit_softcap)
    return _pallas(hidden_NxD, weight_DxV, safe_N, block_sizes, logit_softcap,
                   interpret=impl == "interpret")

  hidden_NxD = hidden.reshape(-1, hidden.shape[-1])
  targets_N = targets.reshape(-1).astype(jnp.int32)
  ignored_N = targets_N == ignore_index
  # Ignored rows compute a harmless log-prob of id 0; zeroing them through `where`
  # also zeroes their cotangent, so they contribute nothing to either gradient.
  safe_N = jnp.where(ignored_N, 0, targets_N)
  if vocab_axis is None:
    logp_N = local(hidden_NxD, weight, safe_N)
  else:
    logp_N = logprobs_vocab.vocab_parallel_logprobs(hidden_NxD, weight, targets_N, ignored_N,
                                                    vocab_axis, local, logit_softcap)
  return jnp.where(ignored_N, 0.0, logp_N).reshape(targets.shape)


def _vocab_axis_size(vocab_axis) -> int:
  """K, the size of the enclosing `shard_map` axis `vocab_axis`; ValueError if there is none."""
  if not isinstance(vocab_axis, str) or not vocab_axis:
    raise ValueError(f"vocab_axis must be a mesh axis name (a str) or None, got "
                     f"{vocab_axis!r}")
  try:
    return jax.lax.axis_size(vocab_axis)
  except NameError:
    raise ValueError(f"vocab_axis={vocab_axis!r} is not an axis of an enclosing "
                     "jax.shard_map: call fused_logprobs inside shard_map over that mesh "
                     "axis, with weight this device's vocabulary slice") from None


def pick_chunk(vocab_size: int, max_chunk: int) -> int:
  """The vocabulary chunk of the xla path: the largest divisor of V in
  `[max_chunk / 2, max_chunk]` when there is one (no overlap masking needed; 4008 for
  V = 128256, 4000 for 32000 or 256000), else `max_chunk`, and never more than V."""
  if max_chunk < 1:
    raise ValueError(f"the xla chunk must be positive, got {max_chunk}")
  if max_chunk >= vocab_size:
    return vocab_size
  for chunk in range(max_chunk, max_chunk // 2 - 1, -1):
    if vocab_size % chunk == 0:
      return chunk
  return max_chunk


def _pallas(hidden_NxD, weight_DxV, targets_N, block_sizes, softcap, interpret):
  """Checks (or picks) the tiles for the chip being compiled for and runs the kernels;
  nothing is padded: ragged N and V are masked inside the kernels. Outside a
  `shard_map` the kernels run partitioned over the operands' shardings
  (`tunix_kernels.logprobs.gspmd`), with default tiles picked for the local pieces."""
  (n, d), v = hidden_NxD.shape, weight_DxV.shape[1]
  if hidden_NxD.dtype != weight_DxV.dtype:  # the tiles and VMEM budget assume one dtype
    raise ValueError(f"the Pallas kernels take hidden and weight of one dtype, got "
                     f"{hidden_NxD.dtype} and {weight_DxV.dtype}; cast the weight to the "
                     "compute dtype")
  chip = tpu.target_chip()
  if block_sizes is not None:
    block_sizes.check(d, hidden_NxD.dtype, chip)
  if not gspmd_lib.in_manual_context():
    # Interpret mode here is Pallas' generic interpreter: custom partitioning cannot
    # carry the TPU interpreter's host callbacks.
    cfg = logprobs_gspmd.Config(block_sizes, softcap, interpret, chip)
    return logprobs_gspmd.logprobs(hidden_NxD, weight_DxV, targets_N, cfg)
  bs = block_sizes or logprobs_blocks.BlockSizes.get_default(
      d, hidden_NxD.dtype, chip, num_tokens=n, vocab_size=v)
  cores = 1 if chip is None else chip.cores
  if not interpret:
    return logprobs_pallas.logprobs_pallas(hidden_NxD, weight_DxV, targets_N, bs, softcap,
                                           False, cores)
  return common.call_interpret(lambda params: logprobs_pallas.logprobs_pallas(
      hidden_NxD, weight_DxV, targets_N, bs, softcap, params, cores))
