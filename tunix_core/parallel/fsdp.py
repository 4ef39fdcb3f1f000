"""FSDP (ZeRO-3): params, gradients, the frozen reference and the optimizer state all split
over the "data" axis; one layer is gathered at a time, inside the layer scan.

**Layout.** As ZeRO-1's optimizer state, each param lives in flat, zero-padded pieces, so
no dimension has to divide the device count; layer leaves are cut per layer, so the scan
can gather one layer at a time (N devices, `piece = ceil(size of one slice / N)`):

    layer leaf  [L, *s] -> [N, L, piece]        other leaf  [*s] -> [N, piece]

Row i is device i's piece (sharded `P("data")`); inside `shard_map` a device holds
`[L, piece]` and `[piece]`. `layer_plan` (one bucket holding one layer) and `rest_plans`
(one per other param: embedding, final norm, head) are the `collectives.BucketPlan`s of
that cut. `to_pieces` / `to_logical` convert any tree with the
params' structure (params, Adam's `mu` and `nu`) between logical arrays and this layout.

**Gathering.** `gather_layer` and `gather_rest` cast the local pieces to the compute dtype
(so bf16 compute moves bf16 bytes), all-gather them with `collectives.all_gather` and
unpack full arrays. Their custom VJP reduce-scatters the cotangents with
`collectives.reduce_scatter`: mean over devices, float32 sums, `comm_dtype` on the wire.
The gradient of a local piece is therefore already the device-mean gradient of that
piece, and the optimizer updates it where it lies (`zero.ShardedOptimizer.update_sharded`):
no all-gather after the step. `model.forward(..., gather_layer=)` rematerialises each
layer with a policy that never saves the gathered weights, so the backward gathers each
layer once more before its reduce-scatter.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tunix_core.model import quant
from tunix_core.parallel import collectives

# A bucket limit no layer reaches: every leaf of one layer travels in one bucket.
_ONE_BUCKET = 1 << 62
# Largest float32 operand of one reduce-scatter in the backward (see `reduce_scatter`).
_SCATTER_CHUNK_BYTES = 64 * 2**20


def _cut(x, lead: tuple, piece: int, n: int):
  """`[*lead, *s]` -> `[n, *lead, piece]`: each lead slice flattened, padded, split."""
  flat = x.reshape(lead + (-1,))
  flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, piece * n - flat.shape[-1])])
  return jnp.moveaxis(flat.reshape(lead + (n, piece)), -2, 0)


def _join(pieces, lead: tuple, shape: tuple):
  """Inverse of `_cut`: `[n, *lead, piece]` -> `[*lead, *shape]`."""
  flat = jnp.moveaxis(pieces, 0, -2).reshape(lead + (-1,))
  return flat[..., :math.prod(shape)].reshape(lead + shape)


def _gather_op(plan_param, plan_compute, axis_name, impl, comm_dtype, stages):
  """A differentiable all-gather of a tree of local pieces into full arrays in the
  compute dtype, whose VJP is the mean reduce-scatter back to pieces."""
  compute_dtypes = [jnp.dtype(d) for d in plan_compute.dtypes]

  @jax.custom_vjp
  def gather(pieces):
    # The barrier keeps the cast on this layer's slice: without it XLA casts the whole
    # stacked [L, piece] params to bf16 before the layer loop (1.5 GiB per chip at 7B).
    leaves, treedef = jax.tree.flatten(jax.lax.optimization_barrier(pieces))
    cast = jax.tree.unflatten(treedef, [x.astype(d) for x, d in zip(leaves, compute_dtypes)])
    return collectives.all_gather(plan_compute.tree_to_shards(cast), plan_compute,
                                  axis_name, impl=impl, stages=stages)

  def fwd(pieces):
    return gather(pieces), None  # no residuals: the backward needs only the cotangent

  def bwd(_, cotangent):
    # The cotangent stays in the compute dtype; `reduce_scatter` casts it to the params'
    # dtype one chunk at a time, so the sums accumulate in float32 (the wire dtype is
    # `comm_dtype`, i.e. --grad_sync_dtype) without a float32 copy of the whole layer.
    shards = collectives.reduce_scatter(cotangent, plan_param, axis_name, impl=impl,
                                        mean=True, comm_dtype=comm_dtype,
                                        chunk_bytes=_SCATTER_CHUNK_BYTES)
    return (plan_param.shards_to_tree(shards),)

  gather.defvjp(fwd, bwd)
  return gather


class FsdpLayout:
  """The FSDP layout of a model's params on `num_shards` devices of `axis_name`.

  Args:
    param_shapes: the logical params (arrays or ShapeDtypeStructs) with a "layers"
      subtree of `[L, ...]` leaves.
    compute_dtype: the dtype gathered weights travel and are used in.
    impl, comm_dtype: of the collectives (`--sync_impl`, `--grad_sync_dtype`).
    gather_stages: the weight gathers' stages (`collectives.all_gather`), or None.
  """

  def __init__(self, param_shapes, num_shards: int, axis_name: str = "data", *,
               compute_dtype=jnp.float32, impl: str = "xla", comm_dtype=None,
               gather_stages=None):
    self.num_shards, self.axis_name = num_shards, axis_name
    self.param_shapes = param_shapes
    self.treedef = jax.tree.structure(param_shapes)
    self.num_layers = jax.tree.leaves(param_shapes["layers"])[0].shape[0]
    one_layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                             param_shapes["layers"])
    rest = {k: v for k, v in param_shapes.items() if k != "layers"}

    def plans(tree, limit):
      # A quantized base's codes and scales travel as they are, dequantized after.
      as_compute = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                quant.cast_floats(tree, compute_dtype))
      return (collectives.BucketPlan.create(tree, num_shards, limit),
              collectives.BucketPlan.create(as_compute, num_shards, limit))

    self.layer_plan, layer_compute = plans(one_layer, _ONE_BUCKET)
    self.gather_layer = _gather_op(self.layer_plan, layer_compute, axis_name, impl, comm_dtype,
                                   gather_stages)
    # The other params are gathered one by one, so the head's gradient is reduce-scattered
    # as soon as the head's backward made it, not kept until the embedding's is ready.
    self.rest_plans, self._gather_rest = {}, {}
    for name, shape in rest.items():
      self.rest_plans[name], compute_plan = plans(shape, _ONE_BUCKET)
      self._gather_rest[name] = _gather_op(self.rest_plans[name], compute_plan, axis_name,
                                           impl, comm_dtype, gather_stages)

  def gather_rest(self, local: dict) -> dict:
    """Inside `shard_map`: the full non-layer params (compute dtype) of a device's local
    params (`layers` is left out); differentiable, see the module docstring."""
    return {k: gather(local[k]) for k, gather in self._gather_rest.items()}

  def _map(self, fn, tree):
    """`fn(leaf, lead, piece, logical shape)` on a params-structured tree."""
    leaves, treedef = jax.tree.flatten(tree["layers"])
    plan, lead = self.layer_plan, (self.num_layers,)
    out = {"layers": jax.tree.unflatten(treedef, [
        fn(x, lead, plan.piece_size(i), plan.shapes[i]) for i, x in enumerate(leaves)])}
    for name, plan in self.rest_plans.items():
      out[name] = fn(tree[name], (), plan.piece_size(0), plan.shapes[0])
    return out

  def to_pieces(self, tree) -> dict:
    """Logical arrays -> this layout (`[N, L, piece]` / `[N, piece]`); jit-able."""
    n = self.num_shards
    return self._map(lambda x, lead, piece, _: _cut(x, lead, piece, n), tree)

  def to_logical(self, tree) -> dict:
    """This layout -> logical arrays; jit-able."""
    return self._map(lambda x, lead, _, shape: _join(x, lead, shape), tree)

  def piece_shapes(self, dtype=None) -> dict:
    """ShapeDtypeStructs of the layout (leaves in `dtype`, default the params')."""
    def shape(x, lead, piece, _):
      return jax.ShapeDtypeStruct((self.num_shards,) + lead + (piece,), dtype or x.dtype)
    return self._map(shape, self.param_shapes)

  def local_shapes(self) -> dict:
    """ShapeDtypeStructs of one device's block (`[L, piece]` / `[piece]`)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                        self.piece_shapes())

  def local(self, tree) -> dict:
    """Inside `shard_map`: a device's `[1, ...]` block of the layout without its axis."""
    return jax.tree.map(lambda x: x[0], tree)


def logical_specs(shapes, n: int, axis_name: str = "data"):
  """How logical arrays (a tree of `shapes`) are kept under FSDP outside the step
  (checkpoints, HF loading, export): each split over the `n` devices of `axis_name` on
  its largest dimension they divide, or replicated when none does (small vectors)."""
  return jax.tree.map(lambda x: _logical_spec(x.shape, n, axis_name), shapes)


def _logical_spec(shape, n: int, axis_name: str) -> P:
  dims = sorted((d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n),
                key=lambda d: -shape[d])
  if not dims:
    return P()
  spec = [None] * len(shape)
  spec[dims[0]] = axis_name
  return P(*spec)
