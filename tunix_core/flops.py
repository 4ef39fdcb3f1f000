"""Model FLOPs of a DPO step and the machine's measured matmul peak, for MFU.

The count is the nominal work of the model on every position of every row, whatever the
step skips (the LM head on unscored positions, `--head_on_scored`), so MFU compares
like with like across settings, as `tokens_per_sec` does. Per token of a row of T:

    forward = 2 * (matmul params of all layers + d_model * vocab)   (dense layers, head)
            + 4 * num_layers * T * num_heads * head_dim             (QK^T and PV, full T x T)

A DPO step runs the policy forward and backward (3 forwards: the backward costs two) on
both rows of each pair, plus the frozen reference's forward unless its log-probs are
precomputed or the run is reference-free: `step_flops = (3 + reference) * 2 B T forward`.
Norms, rope, softmax and the loss are left out (under 1% at these shapes).

`matmul_peak` times a large `jnp.dot` on the devices of the run, in the compute dtype:
the machine's own achievable peak, so MFU is `step_flops / step_time / (peak * devices)`.
"""

import statistics
import time

import jax
import jax.numpy as jnp

from tunix_core import model_config as model_config_lib


def forward_flops_per_token(mcfg: model_config_lib.ModelConfig, T: int) -> float:
  """Forward FLOPs of one token in a row of `T` (see the module docstring)."""
  D, F, K = mcfg.d_model, mcfg.mlp_dim, mcfg.head_dim
  q, kv = mcfg.num_heads * K, mcfg.num_kv_heads * K
  per_layer = D * (q + 2 * kv) + q * D + 3 * D * F  # wq wk wv, wo, gate up down
  dense = mcfg.num_layers * per_layer + D * mcfg.vocab_size
  attention = 4 * mcfg.num_layers * T * mcfg.num_heads * K
  return 2.0 * dense + attention


def step_flops(mcfg: model_config_lib.ModelConfig, pairs: int, T: int,
               reference_forward: bool) -> float:
  """Model FLOPs of one DPO train step on `pairs` pairs of rows of `T` tokens."""
  passes = 3 + (1 if reference_forward else 0)
  return passes * 2 * pairs * T * forward_flops_per_token(mcfg, T)


def matmul_peak(dtype=jnp.float32, n: int = 2048, repeats: int = 5, device=None) -> float:
  """Achieved FLOP/s of an `n x n` by `n x n` matmul in `dtype` on one device (the median
  of `repeats` timed runs after a warm-up)."""
  device = device or jax.devices()[0]
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  dot = jax.jit(lambda x: x @ x)
  dot(a).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    dot(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2.0 * n ** 3 / statistics.median(times)
