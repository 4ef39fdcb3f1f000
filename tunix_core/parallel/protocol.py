"""The parameter layout protocol: what the step, checkpoints and resume need of a layout
(`parallel.layout` holds ZeRO-1, FSDP and tensor parallelism behind it), and the mesh
axes layouts split over."""

from typing import Protocol

import jax
from jax.sharding import PartitionSpec as P

from tunix_core import model as model_lib
from tunix_core.parallel import zero

DATA, MODEL = "data", "model"


class Layout(Protocol):
  """What the step, checkpoints and resume need of a parameter layout."""

  name: str                # "zero1", "single" or "fsdp": how checkpoints record the
                           # optimizer state's rows
  num_shards: int          # rows of the optimizer state (data shards x model slices)
  model_axis: str | None   # the tensor-parallel mesh axis; None without TP
  replica_axis: str | None  # the axis params are replicated over (None: no replicas)
  param_shapes: dict       # ShapeDtypeStructs of the logical params
  cut: object              # the optimizer state's cut: `to_pieces`, `to_logical`,
                           # `local_shapes`, `num_shards`, `treedef`
  param_specs: dict        # PartitionSpecs of the step-form params (params' structure)
  row_spec: P              # PartitionSpec of `[num_shards, ...]` rows

  def logical_specs(self) -> dict:
    """PartitionSpecs of logical params outside the step (loading, checkpoints)."""

  def to_step(self, logical: dict) -> dict:
    """Logical params -> the step form; jit-able."""

  def from_step(self, params: dict) -> dict:
    """The step form -> logical params; jit-able."""

  def logical(self, params: dict, shardings: dict) -> dict:
    """Outside the step: step-form params as logical arrays placed with `shardings`
    (`params` themselves where the two forms are one: no copy)."""

  def place(self, logical: dict, shardings: dict) -> dict:
    """Outside the step: logical params in the step form, placed with `shardings`."""

  def abstract_params(self, dtype=None) -> dict:
    """ShapeDtypeStructs of the step form (global shapes; leaves in `dtype`)."""

  def gather(self, params: dict) -> tuple:
    """Inside `shard_map`: `(params, gather_layer)`: the device's step-form params with
    every non-layer leaf whole, and the function the layer scan gathers each layer's
    slice with (None: layers are whole). Differentiable."""

  def forward(self, params: dict, gather_layer, tokens_BxT, mask_BxT,
              mcfg: model_lib.ModelConfig, **rows) -> jax.Array:
    """Inside `shard_map`: hidden states `[B, T, D]` of `model.forward` on `gather`'s
    params; `rows` are its packed-row keywords."""

  def sync_grads(self, grads: dict) -> dict:
    """Inside `shard_map`: gradients of the step-form params made whole within the
    device's model slice (before the data-parallel sync of `update`)."""

  def policy(self, params: dict, frozen) -> dict:
    """What `gather` takes for the policy: the trained params with the step's frozen
    input (`parallel.lora`: the base); full fine-tuning: `params`."""

  def reference(self, frozen):
    """What `gather` takes for DPO's reference, from the step's frozen input (full
    fine-tuning: the reference params themselves)."""

  def init_opt(self, params: dict):
    """Inside `shard_map`: this device's optimizer state for the step-form params."""

  def update(self, grads: dict, opt_state, params: dict, accept=None) -> zero.UpdateResult:
    """Inside `shard_map`: synced, clipped and applied; the new params in step form.
    `accept(grad_norm)` False keeps params and state as they were."""
