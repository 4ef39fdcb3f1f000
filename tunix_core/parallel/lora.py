"""LoRA as a parameter layout: the adapters train, the base is frozen.

The train state's params are the adapters (`model.lora`), held as ZeRO-1 holds params:
replicated over "data", their optimizer state 1/N per device, the bucketed gradient sync
and global-norm clipping over the adapters only, so checkpoints hold only them. The
base is not in the state: the step takes it as its frozen input, in its own layout
(`base`: ZeRO-1's replicated arrays or FSDP's pieces, gathered per layer as in full
fine-tuning), in `--ref_dtype`. The frozen input is `{"base": ...}`, plus
`"ref_adapters"` when the run started from a PEFT adapter (`--lora_init`).

The policy is the base with the trained adapters; DPO's reference is the base with
`ref_adapters` (without them: the bare base, adapters off). No second copy of the
weights exists.
"""

import jax
from jax.sharding import PartitionSpec as P

from tunix_core import model as model_lib
from tunix_core.model import lora as lora_lib
from tunix_core.model.config import ModelConfig
from tunix_core.parallel import collectives
from tunix_core.parallel import layout as layout_lib
from tunix_core.parallel import zero


class LoRA(layout_lib.Zero1):
  """Adapters as ZeRO-1 params over a frozen base in the `base` layout."""

  def __init__(self, adapter_shapes: dict, opt: zero.ShardedOptimizer,
               base: layout_lib.Layout):
    super().__init__(adapter_shapes, opt)
    self.base = base

  def frozen_specs(self, ref_adapters: bool) -> dict:
    """PartitionSpecs of the step's frozen input."""
    specs = {"base": self.base.param_specs}
    if ref_adapters:
      specs["ref_adapters"] = jax.tree.map(lambda _: P(), self.param_shapes)
    return specs

  def abstract_frozen(self, dtype, ref_adapters: bool) -> dict:
    """ShapeDtypeStructs of the frozen input (the base's leaves in `dtype`)."""
    out = {"base": self.base.abstract_params(dtype)}
    if ref_adapters:
      out["ref_adapters"] = self.abstract_params()
    return out

  def policy(self, params: dict, frozen: dict) -> dict:
    return {"base": frozen["base"], "adapters": params}

  def reference(self, frozen: dict) -> dict:
    return {"base": frozen["base"], "adapters": frozen.get("ref_adapters")}

  def gather(self, params: dict) -> tuple:
    """`policy`'s or `reference`'s params -> the base gathered as its layout gathers it,
    with the adapters attached; each layer's adapters pass the base's per-layer gather
    untouched."""
    base, gather_layer = self.base.gather(params["base"])
    if params["adapters"] is None:
      return base, gather_layer
    adapted = lora_lib.attach(base, params["adapters"])
    if gather_layer is None:
      return adapted, None

    def gather_adapted_layer(layer):
      rest = {k: v for k, v in layer.items() if k != "lora"}
      return dict(gather_layer(rest), lora=layer["lora"])

    return adapted, gather_adapted_layer

  def forward(self, params, gather_layer, tokens_BxT, mask_BxT, mcfg, **rows):
    return self.base.forward(params, gather_layer, tokens_BxT, mask_BxT, mcfg, **rows)


def make(mcfg: ModelConfig, lcfg: lora_lib.LoraConfig, tx, *, data_shards: int,
         bucket_bytes: int = 25 << 20, sync_impl: str = "xla", comm_dtype=None,
         max_grad_norm: float | None = None, **base_kw) -> LoRA:
  """The LoRA layout of `lcfg`'s adapters on `mcfg`'s base (`base_kw`: the base's layout
  as `parallel.layout.make` takes it, e.g. `fsdp=True`), updating the adapters with the
  optax transformation `tx`."""
  base = layout_lib.make(mcfg, tx, data_shards=data_shards, bucket_bytes=bucket_bytes,
                         sync_impl=sync_impl, comm_dtype=comm_dtype, **base_kw)
  shapes = jax.eval_shape(lambda: lora_lib.init_adapters(
      jax.random.PRNGKey(0), mcfg, lcfg, model_lib.DTYPES[mcfg.param_dtype]))
  plan = collectives.BucketPlan.create(shapes, data_shards, bucket_bytes)
  opt = zero.ShardedOptimizer(tx, plan, layout_lib.DATA, max_grad_norm=max_grad_norm,
                              impl=sync_impl, comm_dtype=comm_dtype)
  return LoRA(shapes, opt, base)
