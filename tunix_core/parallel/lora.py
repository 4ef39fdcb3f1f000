"""LoRA as a parameter layout: the adapters train, the base is frozen.

The train state's params are the adapters (`model.lora`), in the `adapters` layout:
ZeRO-1 (replicated over "data", their optimizer state 1/N per device, the bucketed
gradient sync and global-norm clipping over the adapters only, so checkpoints hold only
them), under tensor parallelism split over "model" the way their projections are
(`model.lora.param_specs`). The base is not in the state: the step takes it as its
frozen input, in its own layout (`base`: ZeRO-1's replicated arrays, FSDP's pieces
gathered per layer, either split Megatron-style), in `--ref_dtype`. The frozen input is
`{"base": ...}`, plus `"ref_adapters"` when the run started from a PEFT adapter
(`--lora_init`).

The policy is the base with the trained adapters; DPO's reference is the base with
`ref_adapters` (without them: the bare base, adapters off). No second copy of the
weights exists.
"""

import jax
from jax.sharding import PartitionSpec as P

from tunix_core import model as model_lib
from tunix_core.model import lora as lora_lib
from tunix_core.model.config import ModelConfig
from tunix_core.parallel import layout as layout_lib
from tunix_core.parallel import tensor_parallel as tp_lib


class LoRA:
  """Adapters in the `adapters` layout (the train state: params, optimizer state,
  update) over a frozen base in the `base` layout (the compute: gather, forward)."""

  def __init__(self, adapters: layout_lib.Layout, base: layout_lib.Layout,
               read: layout_lib.Layout | None = None):
    # `read`: the unquantized base's layout, where a quantized base's float weights are
    # read (each leaf quantized as soon as it is read); the base's own otherwise.
    self.adapters, self.base, self.read = adapters, base, read or base
    for name in ("name", "num_shards", "model_axis", "replica_axis", "param_shapes", "cut",
                 "param_specs", "row_spec"):
      setattr(self, name, getattr(adapters, name))
    for name in ("logical_specs", "to_step", "from_step", "logical", "place",
                 "abstract_params", "init_opt", "update"):
      setattr(self, name, getattr(adapters, name))
    # Under TP an adapter's replicated factor acts inside the sharded heads or columns:
    # each device's gradient of it is its slice's share, summed over the model axis.
    self._slice_shares = jax.tree.map(lambda s: self.model_axis is not None and
                                      self.model_axis not in s, self.param_specs,
                                      is_leaf=lambda x: isinstance(x, P))

  def frozen_specs(self, ref_adapters: bool) -> dict:
    """PartitionSpecs of the step's frozen input."""
    specs = {"base": self.base.param_specs}
    if ref_adapters:
      specs["ref_adapters"] = self.param_specs
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

  def sync_grads(self, grads: dict) -> dict:
    return jax.tree.map(lambda g, share: jax.lax.psum(g, self.model_axis) if share else g,
                        grads, self._slice_shares)


def make(mcfg: ModelConfig, lcfg: lora_lib.LoraConfig, tx, *, data_shards: int,
         model_parallel: int = 1, fsdp: bool = False, quantize: str = "", **kw) -> LoRA:
  """The LoRA layout of `lcfg`'s adapters on `mcfg`'s base, on `data_shards` x
  `model_parallel` devices, updating the adapters with the optax transformation `tx`
  (`fsdp`: the base's layout; `quantize`: QLoRA's base, `model.quant`; `kw`:
  `parallel.layout.build`'s settings)."""
  base_of = lambda kind: layout_lib.make(mcfg, tx, data_shards=data_shards,
                                        model_parallel=model_parallel, fsdp=fsdp,
                                        quantize=kind, **kw)
  base = base_of(quantize)
  k, dtype = model_parallel, model_lib.DTYPES[mcfg.param_dtype]
  shapes = lambda cfg: jax.eval_shape(lambda: lora_lib.init_adapters(
      jax.random.PRNGKey(0), cfg, lcfg, dtype))
  local = shapes(tp_lib.local_config(mcfg, k)) if k > 1 else shapes(mcfg)
  adapters = layout_lib.build(shapes(mcfg), local, lora_lib.param_specs(lcfg, layout_lib.MODEL),
                              tx, data_shards=data_shards, model_parallel=k, **kw)
  return LoRA(adapters, base, base_of("") if quantize else None)
