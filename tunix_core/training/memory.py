"""A train step's bytes per device, estimated before compiling (`training.fit`'s order).

`estimate(steps)` adds what the step holds, known exactly from its abstract inputs (the
state, the frozen reference or base, the batch, each as this device's shard), to a model
of what it allocates while running:

- the gradients of the trained params, float32, whole on each device under ZeRO-1
  (reduce-scattered after the backward) and one layer's under FSDP, plus a
  micro-batch accumulator of this device's shard when there are several;
- the activations the backward keeps, per layer and token of one micro-batch, by remat
  policy (`SAVED`: counted in the compute dtype's bytes, in units of the layer's widths);
- the working set of one layer's backward: its forward recomputed and its gradients
  (`WORKING`, the same units), for the layer being differentiated.

The figures are a model, meant as a lower bound, checked against the TPU compiler's own
(`test_aot.py` compiles a sample ahead of time): too low costs `training.fit` one more
compile (a refusal takes seconds), too high a costlier policy or more micro-batches for
the whole run. `fit` compiles only the candidate it takes, and takes the next one when
the compiled step does not fit after all.
"""

import math

import jax
import numpy as np

from tunix_core import model as model_lib
from tunix_core.training import offload

# Activations a remat policy keeps per layer and token, in units of the layer's widths
# (D: d_model, Q: query heads x head dim, KV: key/value heads x head dim, F: MLP width):
# `none` keeps every intermediate (norms, projections before and after RoPE, the gated
# MLP's four [F] rows), `dots` the matmul outputs and attention's out, `attention` the
# kernels' q, k, v and out, `full` the layer's input.
SAVED = {
    "none": dict(D=7, Q=4, KV=4, F=5),
    "dots": dict(D=3, Q=2, KV=2, F=2),
    "attention": dict(D=1, Q=2, KV=2, F=0),
    "offload": dict(D=1, Q=0, KV=0, F=0),
    "full": dict(D=1, Q=0, KV=0, F=0),
    "full_prefetch": dict(D=1, Q=0, KV=0, F=0),
    "dots_no_batch": dict(D=3, Q=2, KV=2, F=2),
}
# One layer's backward: its recomputed forward (the cotangents flowing through it reuse
# what the backward frees as it goes).
WORKING = SAVED["none"]


def shard_bytes(tree, memory_kind: str = "device") -> int:
  """Bytes of one device's shard of every `jax.ShapeDtypeStruct` leaf of `tree` held in
  `memory_kind`: the device's memory, or "pinned_host" (`--offload_optimizer`)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if offload.on_host(x) != (memory_kind == "pinned_host"):
      continue
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * np.dtype(x.dtype).itemsize
  return total


def _per_token(widths: dict, mcfg: model_lib.ModelConfig, model_parallel: int) -> float:
  """Elements per token of `widths` for one layer (heads and MLP split over the
  "model" axis)."""
  q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
  return (widths["D"] * mcfg.d_model
          + (widths["Q"] * q + widths["KV"] * kv + widths["F"] * mcfg.mlp_dim) / model_parallel)


def groups_per_micro_batch(plan) -> int:
  """Row groups (`data.packing.Spec`) one device computes at once: its micro-batch."""
  return max(plan.pairs_per_device // plan.micro_batches // plan.rows.pairs, 1)


def estimate(steps) -> int:
  """Bytes per device of `steps.train_step` (`training.step.StepFunctions`), modelled
  (module docstring)."""
  plan, mcfg = steps.plan, steps.plan.model
  state, frozen, batch = steps.abstract_inputs()
  held = shard_bytes((state, frozen, batch))
  trained = sum(math.prod(x.shape) for x in jax.tree.leaves(steps.param_shapes))
  trained_per_device = trained / plan.model_parallel
  if plan.fsdp:  # gathered and reduce-scattered one layer at a time
    grads = 4 * (trained_per_device / plan.data_shards
                 + trained_per_device / max(mcfg.num_layers, 1))
  else:
    grads = 4 * trained_per_device
  if plan.micro_batches > 1:  # the accumulator of this device's synced shard
    grads += 4 * trained_per_device / plan.data_shards
  size = np.dtype(model_lib.DTYPES[mcfg.compute_dtype]).itemsize
  groups = groups_per_micro_batch(plan)
  tokens = groups * plan.rows.rows * plan.rows.length
  saved = _per_token(SAVED.get(mcfg.remat, SAVED["none"]), mcfg, plan.model_parallel)
  working = _per_token(WORKING, mcfg, plan.model_parallel)
  # The LM head's float32 hidden states and their gradient at the scored slots.
  head = 3 * 4 * mcfg.d_model * plan.rows.head * groups
  activations = size * tokens * (mcfg.num_layers * saved + working) + head
  return int(held + grads + activations)
