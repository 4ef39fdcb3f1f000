"""The parameter layouts of a run behind one protocol: ZeRO-1, FSDP, and tensor
parallelism over either.

A layout decides where params and optimizer state live and how a step computes with
and updates them; the step calls the protocol and never asks which layout it has.
`make` is the one place the choice is made (from `--fsdp` and `--model_parallel`); what
every layout provides is `protocol.Layout`:

- `Zero1`: params replicated over "data"; the optimizer state is 1/N per device
  (`zero.ShardedOptimizer`: bucketed reduce-scatter, local update, all-gather);
  `Single` on one data shard: the state in the params' own shapes, nothing flattened.
- `FSDP`: params in `fsdp.FsdpLayout`'s flat pieces split over "data", one layer gathered at
  a time inside the layer scan; the update stays local.
- `TensorParallel`: either of them applied to each of the K slices of a "model" axis
  (`tensor_parallel`): heads, MLP columns and vocabulary split Megatron-style.

Three forms of the same params appear: *logical* arrays (what a checkpoint or an HF
directory holds), the *step* form the train state keeps (ZeRO-1: the logical arrays,
split over "model" under TP; FSDP: `[N, ...]` pieces) and, inside `shard_map`, what one
device *computes* with (`gather`). The optimizer state is always `[num_shards, ...]`
rows of `cut`'s pieces.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tunix_core import model as model_lib
from tunix_core.model import quant
from tunix_core.parallel import collectives
from tunix_core.parallel import fsdp as fsdp_lib
from tunix_core.parallel import tensor_parallel as tp_lib
from tunix_core.parallel import zero
from tunix_core.parallel.protocol import DATA, MODEL, Layout  # pylint: disable=unused-import


def _convert(fn, tree: dict, shardings: dict) -> dict:
  """`fn(tree)` computed on the devices, its output placed with `shardings`."""
  return jax.jit(fn, out_shardings=shardings)(tree)


def _abstract(shapes: dict, dtype, lead: tuple = ()) -> dict:
  """ShapeDtypeStructs of `shapes` with `lead` dimensions in front (floating leaves in
  `dtype`, default their own; a quantized base's codes and scales keep theirs)."""
  cast = quant.cast_floats(shapes, dtype) if dtype else shapes
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(lead + x.shape, x.dtype), cast)


class Whole:
  """The compute side of params a device holds whole (no TP, no gathering): ZeRO-1's,
  and `WHOLE`, for the objective on plain params outside any step."""

  model_axis = None

  def gather(self, params: dict) -> tuple:
    return params, None

  def forward(self, params, gather_layer, tokens_BxT, mask_BxT, mcfg, **rows):
    return model_lib.forward(params, tokens_BxT, mask_BxT, mcfg, gather_layer, **rows)

  def sync_grads(self, grads: dict) -> dict:
    return grads

  def policy(self, params: dict, frozen) -> dict:
    return params

  def reference(self, frozen):
    return frozen


WHOLE = Whole()


class Zero1(Whole):
  """ZeRO-1: replicated params, optimizer state split over "data"."""

  name, replica_axis = "zero1", DATA
  _cut = zero.Zero1Layout  # the optimizer state's rows, from the optimizer's bucket plan

  def __init__(self, param_shapes: dict, opt: zero.ShardedOptimizer):
    self.param_shapes, self.opt = param_shapes, opt
    self.cut = self._cut(opt.plan)
    self.num_shards = self.cut.num_shards
    self.param_specs = jax.tree.map(lambda _: P(), param_shapes)
    self.row_spec = P(DATA)

  def logical_specs(self) -> dict:
    return self.param_specs

  def to_step(self, logical: dict) -> dict:
    return logical

  def from_step(self, params: dict) -> dict:
    return params

  def logical(self, params: dict, shardings: dict) -> dict:
    return params

  def place(self, logical: dict, shardings: dict) -> dict:
    return jax.device_put(logical, shardings)

  def abstract_params(self, dtype=None) -> dict:
    return _abstract(self.param_shapes, dtype)

  def init_opt(self, params: dict):
    return self.opt.init(params)

  def update(self, grads, opt_state, params, accept=None) -> zero.UpdateResult:
    return self.opt.update(grads, opt_state, params, accept)


class Single(Zero1):
  """ZeRO-1 on one data shard without TP: the optimizer state in the params' own shapes
  (`zero.SingleShardOptimizer`: no flattening, no collectives)."""

  name, _cut = "single", zero.SingleLayout


class FSDP(Zero1):
  """FSDP: params, gradients and optimizer state split over "data" in `fsdp.FsdpLayout`'s
  pieces (`[N, ...]` step form, a `[1, ...]` block per device)."""

  name, replica_axis = "fsdp", None

  def __init__(self, param_shapes: dict, opt: zero.ShardedOptimizer, compute_dtype,
               comm_dtype, gather_stages=None):
    self.param_shapes, self.opt = param_shapes, opt
    self.cut = fsdp_lib.FsdpLayout(param_shapes, opt.plan.num_shards, DATA,
                               compute_dtype=compute_dtype, impl=opt.impl,
                               comm_dtype=comm_dtype, gather_stages=gather_stages)
    self.num_shards = self.cut.num_shards
    self.row_spec = P(DATA)
    self.param_specs = jax.tree.map(lambda _: self.row_spec, param_shapes)

  def logical_specs(self) -> dict:
    return fsdp_lib.logical_specs(self.param_shapes, self.cut.num_shards, DATA)

  def to_step(self, logical: dict) -> dict:
    return self.cut.to_pieces(logical)

  def from_step(self, params: dict) -> dict:
    return self.cut.to_logical(params)

  def logical(self, params: dict, shardings: dict) -> dict:
    return _convert(self.from_step, params, shardings)

  def place(self, logical: dict, shardings: dict) -> dict:
    return _convert(self.to_step, logical, shardings)

  def abstract_params(self, dtype=None) -> dict:
    return _abstract(self.cut.local_shapes(), dtype, (self.num_shards,))

  def gather(self, params: dict) -> tuple:
    local = self.cut.local(params)
    return dict(self.cut.gather_rest(local), layers=local["layers"]), self.cut.gather_layer

  def init_opt(self, params: dict):
    return self.opt.tx.init(self.cut.local(params))

  def update(self, grads, opt_state, params, accept=None) -> zero.UpdateResult:
    # The gathers' VJP reduce-scattered the gradients already: the update is local.
    local = self.cut.local
    out = self.opt.update_sharded(local(grads), opt_state, local(params), accept)
    return out._replace(params=jax.tree.map(lambda x: x[None], out.params))


class TensorParallel:
  """`inner` (a `Zero1` or `FSDP` over one model slice's shapes) on each of the K slices
  of the "model" axis that `specs` (the logical params' PartitionSpecs over it) say.
  Under ZeRO-1 the step form is the logical params split by `specs`; under FSDP,
  `tensor_parallel.Stacked` rows over both axes."""

  model_axis = MODEL

  def __init__(self, inner: Zero1, specs: dict, k: int, param_shapes: dict):
    self.inner, self.param_shapes = inner, param_shapes
    self.name, self.replica_axis = inner.name, inner.replica_axis
    self.cut = tp_lib.Stacked(inner.cut, specs, k)
    self.num_shards = self.cut.num_shards
    self.row_spec = P((DATA, MODEL))
    self.pieces = inner.replica_axis is None  # FSDP: the params are rows too
    self.param_specs = (jax.tree.map(lambda _: self.row_spec, inner.param_shapes)
                        if self.pieces else specs)

  def logical_specs(self) -> dict:
    if not self.pieces:
      return self.param_specs
    return fsdp_lib.logical_specs(self.param_shapes, self.inner.cut.num_shards, DATA)

  def to_step(self, logical: dict) -> dict:
    return self.cut.to_pieces(logical) if self.pieces else logical

  def from_step(self, params: dict) -> dict:
    return self.cut.to_logical(params) if self.pieces else params

  def logical(self, params: dict, shardings: dict) -> dict:
    return _convert(self.from_step, params, shardings) if self.pieces else params

  def place(self, logical: dict, shardings: dict) -> dict:
    if self.pieces:
      return _convert(self.to_step, logical, shardings)
    return jax.device_put(logical, shardings)

  def abstract_params(self, dtype=None) -> dict:
    if not self.pieces:
      return _abstract(self.param_shapes, dtype)
    return _abstract(self.cut.local_shapes(), dtype, (self.num_shards,))

  def gather(self, params: dict) -> tuple:
    return self.inner.gather(params)

  def forward(self, params, gather_layer, tokens_BxT, mask_BxT, mcfg, **rows):
    return tp_lib.forward(params, tokens_BxT, mask_BxT, mcfg, MODEL, gather_layer, **rows)

  def sync_grads(self, grads: dict) -> dict:
    return tp_lib.sync_replicated_grads(grads, MODEL)

  policy, reference = Whole.policy, Whole.reference

  def init_opt(self, params: dict):
    return self.inner.init_opt(params)

  def update(self, grads, opt_state, params, accept=None) -> zero.UpdateResult:
    return self.inner.update(grads, opt_state, params, accept)


def build(param_shapes: dict, local_shapes: dict, specs: dict, tx, *, data_shards: int,
          model_parallel: int = 1, fsdp: bool = False, compute_dtype=None,
          bucket_bytes: int = 25 << 20, sync_impl: str = "xla", comm_dtype=None,
          max_grad_norm: float | None = None, slice_axis: str | None = None,
          gather_stages: tuple | None = None, single: bool | None = None) -> Layout:
  """The layout of any params tree (`param_shapes`, logical) on `data_shards` x
  `model_parallel` devices of one slice: `local_shapes` are one model slice's, `specs`
  the logical params' PartitionSpecs over "model" (unused without TP). With
  `slice_axis` the layout is the same in every slice (replicated across it) and the
  gradients are averaged across slices in the update (`zero.ShardedOptimizer`).
  `gather_stages`: FSDP's weight gathers in stages (`mesh.gather_stages`). `single`:
  False keeps ZeRO-1's flat rows on one data shard (a checkpoint written before
  "single"); otherwise one data shard without TP or FSDP is `Single`."""
  k = model_parallel
  split = None
  if k > 1:
    split = jax.tree.map(lambda d: d is not None, tp_lib.split_dims(specs, MODEL),
                         is_leaf=lambda x: x is None)
  plan = collectives.BucketPlan.create(local_shapes, data_shards, bucket_bytes)
  # One data shard without TP or FSDP; a checkpoint's flat rows of one shard say False.
  single = (single is not False) and data_shards == 1 and k == 1 and not fsdp
  optimizer = zero.SingleShardOptimizer if single else zero.ShardedOptimizer
  opt = optimizer(tx, plan, DATA, max_grad_norm=max_grad_norm, impl=sync_impl,
                  comm_dtype=comm_dtype, model_axis=MODEL if k > 1 else None, split=split,
                  slice_axis=slice_axis)
  inner = (FSDP(local_shapes, opt, compute_dtype, comm_dtype, gather_stages) if fsdp
           else (Single if single else Zero1)(local_shapes, opt))
  return TensorParallel(inner, specs, k, param_shapes) if k > 1 else inner


def make(mcfg: model_lib.ModelConfig, tx, *, data_shards: int, model_parallel: int = 1,
         quantize: str = "", **kw) -> Layout:
  """The layout of `mcfg`'s params on `data_shards` x `model_parallel` devices, updating
  with the optax transformation `tx` (`kw`: `build`'s settings, e.g. `fsdp=True`);
  `quantize`: the params' projections are `model.quant`'s (a frozen QLoRA base)."""
  k = model_parallel
  shapes = lambda cfg: jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0),
                                                                    cfg, quantize))
  param_shapes = shapes(mcfg)
  local_shapes = shapes(tp_lib.local_config(mcfg, k)) if k > 1 else param_shapes
  specs = model_lib.param_specs(mcfg, MODEL)
  return build(param_shapes, local_shapes,
               quant.quantized_specs(specs, quantize) if quantize else specs, tx,
               data_shards=data_shards, model_parallel=k,
               compute_dtype=model_lib.DTYPES[mcfg.compute_dtype], **kw)
