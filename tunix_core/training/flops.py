"""Model FLOPs of a planned DPO step, the devices' peak, and so MFU.

**FLOPs** count the matmul work the planned step does (`plan.StepPlan`: its model rows
and LM-head slots), never more: per model-row position

    dense     = 2 * matmul params of all layers                       (qkv, o, MLP)

and per row, per layer, attention `4 * num_heads * head_dim` per (query, key) pair the
kernels compute (QK^T and PV): the tiles they visit times the tile's area. A tile none
of whose entries is visible is skipped by the kernels and is not work: above the
diagonal (causal), a rejected response's queries against the chosen one's keys (prefix
sharing), another packed sequence's keys, keys past a sliding window
(`attention_visits.visible_tiles` on the row, tiles of `BlockSizes.get_default` for the
smallest generation's VMEM). The row is the plan's worst case: full, a shared row a
prompt of `--max_prompt_length` tokens and two equal responses, a packed row sequences
of `band` tokens back to back. The LM head costs `2 d_model vocab` per head slot.
A step runs the policy forward and backward (3 forwards: the backward costs two) plus
the frozen reference's forward when it runs in the step. Norms, rope, softmax and the
loss are left out (under 1% at these shapes), so MFU cannot pass 100%.

**Peak** (`peak_flops`): the chip's nominal dense bfloat16 matmul peak from a table of
TPU generations and common GPUs (vendor spec sheets; a GPU computing in float32 is
measured instead). Anywhere else (a CPU), the median
of several timed `n x n` matmuls in the compute dtype, measured once per machine and
cached on disk (`$XDG_CACHE_HOME/tunix_core/matmul_peak.json`, by default under
`~/.cache`; keyed by device kind, dtype and jax version), so two launches of one run
share the denominator.
"""

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tunix_kernels.attention import blocks as attention_blocks
from tunix_kernels.attention import visits as attention_visits
from tunix_core.model import config as model_config_lib

# Dense bfloat16 FLOP/s per chip, by a substring of `jax.Device.device_kind`: Google
# Cloud TPU system architecture pages (v4, v5e, v5p, v6e) and NVIDIA data sheets
# (SXM parts, without sparsity). Most specific names first.
PEAK_FLOPS = (
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5p", 459e12),
    ("TPU v5", 459e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
    ("H200", 989e12), ("H100", 989e12), ("A100", 312e12),
)
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                     "tunix_core", "matmul_peak.json")


def layer_matmul_params(mcfg: model_config_lib.ModelConfig) -> int:
  """Weights of all layers' matmuls (wq wk wv, wo, gate up down)."""
  D, F, K = mcfg.d_model, mcfg.mlp_dim, mcfg.head_dim
  q, kv = mcfg.num_heads * K, mcfg.num_kv_heads * K
  return mcfg.num_layers * (D * (q + 2 * kv) + q * D + 3 * D * F)


def forward_flops(mcfg: model_config_lib.ModelConfig, positions: int, keys: int,
                  head_slots: int) -> float:
  """Forward FLOPs of `positions` row positions, each scored against `keys` keys, and
  the LM head on `head_slots` positions."""
  attention = 4 * mcfg.num_layers * mcfg.num_heads * mcfg.head_dim * keys
  return (positions * (2.0 * layer_matmul_params(mcfg) + attention)
          + head_slots * 2.0 * mcfg.d_model * mcfg.vocab_size)


def planned_row(rows, prompt: int) -> tuple:
  """`(segments, branches, positions)` `[1, L]` int32 of a full planned row (`rows`, a
  `data.packing.Spec`): one sequence (plain), or sequences of `rows.band` tokens back
  to back (packed); with prefix sharing each is a prompt of up to `prompt` tokens and
  two responses of equal length."""
  L = rows.length
  segments, branches, positions = (np.zeros((1, L), np.int32) for _ in range(3))
  start, segment = 0, 1
  while start < L:
    n = min(rows.band or L, L - start)
    p = min(prompt, max(n - 2, 0)) if rows.share else n
    chosen = (n - p + 1) // 2
    branch = np.repeat([0, 1, 2], [p, chosen, n - p - chosen])
    at = slice(start, start + n)
    segments[0, at], branches[0, at] = segment, branch
    positions[0, at] = np.where(branch == 2, np.arange(n) - chosen, np.arange(n))
    start, segment = start + n, segment + 1
  return segments, branches, positions


def attended_pairs(plan, chip=None) -> int:
  """(query, key) pairs one planned row's attention computes, summed over the layers:
  per layer, the tiles the kernels visit on `chip` (`tunix_kernels.tpu`'s; None: the
  tiles of an unknown chip) (`attention_visits.visible_tiles`, the window of a sliding
  layer included) times the tile's area."""
  mcfg, rows = plan.model, plan.rows
  bq, bk = attention_blocks.BlockSizes.get_default(
      mcfg.head_dim, jnp.dtype(mcfg.compute_dtype), chip,
      seq_len=rows.length).tiles(rows.length)
  segments, branches, positions = planned_row(rows, plan.max_prompt_length)
  valid = np.ones_like(segments)
  count = lambda window: int(np.sum(attention_visits.visible_tiles(
      segments, branches, positions, valid, window, bq, bk))) * bq * bk
  windows = [mcfg.sliding_window if s else attention_visits.NO_WINDOW
             for s in mcfg.sliding_layers()]
  return sum(count(w) * windows.count(w) for w in set(windows))


def step_flops(plan, chip=None) -> float:
  """Model FLOPs of one train step of `plan` (a `plan.StepPlan`) over all devices, its
  attention as the kernels' tiles on `chip` count it (`attended_pairs`)."""
  rows, mcfg = plan.rows, plan.model
  groups = plan.batch_size // rows.pairs
  attention = 4 * mcfg.num_heads * mcfg.head_dim * rows.rows * attended_pairs(plan, chip)
  # keys=0: the attention is the kernels' visited tiles above, not a key count per position
  forward = groups * (forward_flops(mcfg, rows.rows * rows.length, 0, rows.head)
                      + attention)
  return (3 + (plan.reference == "step")) * forward


def _measured_peak(dtype, n: int, repeats: int, device) -> float:
  """FLOP/s of an `n x n` by `n x n` matmul in `dtype` on `device`: the median of
  `repeats` timed runs after a warm-up."""
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  dot = jax.jit(lambda x: x @ x)
  dot(a).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    dot(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2.0 * n ** 3 / statistics.median(times)


def peak_flops(device, dtype=jnp.float32, n: int = 1024, repeats: int = 9,
               cache: str | None = CACHE) -> tuple[float, str]:
  """`(FLOP/s, where it comes from)` of one `device` computing in `dtype`: the nominal
  peak of a known chip, else a measured matmul peak cached in `cache` (None: not
  cached)."""
  kind = device.device_kind
  for name, flops in PEAK_FLOPS:
    # A TPU's MXU peak is its peak in any dtype; a GPU's table entry is bf16 only.
    if name.lower() in kind.lower() and (name.startswith("TPU")
                                         or jnp.dtype(dtype) == jnp.bfloat16):
      return flops, f"nominal {name} peak"
  key = f"{kind}|{jnp.dtype(dtype).name}|{n}|jax {jax.__version__}"
  table = {}
  if cache and os.path.exists(cache):
    try:
      with open(cache) as f:
        table = json.load(f)
    except (OSError, ValueError):
      table = {}  # unreadable: measure again and rewrite it
  if key not in table:
    table[key] = _measured_peak(dtype, n, repeats, device)
    if cache:
      try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
          json.dump(table, f, indent=1)
        os.replace(tmp, cache)
      except OSError:
        pass  # a read-only home: the peak is measured again next time
  return table[key], f"measured matmul peak of {kind} (median of {repeats}, cached)"
