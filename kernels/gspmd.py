"""Partitioning rules of the Pallas ops under plain `jax.jit` (GSPMD and Shardy).

A `pallas_call` is opaque to XLA's partitioner: under `jax.jit` with sharded inputs a
Mosaic kernel does not compile ("Mosaic kernels cannot be automatically partitioned"),
and in interpret mode it runs on gathered inputs. An op describes its per-device body
with einsum-like factors per operand and result dimension (`"n d"`, `"d v"`, a compound
`"(v g)"` whose minor factor is never split) and names the factors that may stay split
(`split`: factor -> a role of `Axes`). Each such factor keeps the mesh axes its first
operand dimension arrives split over; every other factor is gathered. The body gets
those axes for the collectives its math needs and runs on the local pieces.

`partitioned` applies the rule in one of two ways, chosen by the mesh's axis types:
a `jax.shard_map` derived from the operands' types (Explicit axes), or
`jax.experimental.custom_partitioning` (Auto axes; see `partitioned`). On one device
the body runs once on the whole arrays with empty `Axes`. Inside a `jax.shard_map` the
ops call their kernels directly (`in_manual_context`): there the values already are
per-device pieces and the caller names the axes.
"""

from typing import Callable, NamedTuple

import jax
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class Axes(NamedTuple):
  """Mesh axes each split factor role arrived over (tuples of names, () when whole)."""
  batch: tuple = ()
  heads: tuple = ()
  vocab: tuple = ()


def in_manual_context() -> bool:
  """True inside a `jax.shard_map` body: its values are already per-device pieces."""
  mesh = jax.sharding.get_abstract_mesh()
  return bool(getattr(mesh, "manual_axes", ()))


def _dims(spec: str) -> list[tuple[str, ...]]:
  """`"b (v g) t"` -> `[("b",), ("v", "g"), ("t",)]`: the factors of each dimension."""
  dims, i, words = [], 0, spec.replace("(", " ( ").replace(")", " ) ").split()
  while i < len(words):
    if words[i] == "(":
      j = words.index(")", i)
      dims.append(tuple(words[i + 1:j]))
      i = j + 1
    else:
      dims.append((words[i],))
      i += 1
  return dims


def _entry_axes(sharding, dim: int) -> tuple:
  """Mesh axes that dimension `dim` of an operand is split over."""
  spec = getattr(sharding, "spec", None)
  if spec is None or dim >= len(spec) or spec[dim] is None:
    return ()
  entry = spec[dim]
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


class _Rule(NamedTuple):
  in_dims: tuple
  out_dims: tuple
  split: dict          # factor -> Axes field ("batch", "heads", "vocab")
  minor_sizes: dict    # sizes of the minor factors of compound dimensions

  def factor_sizes(self, shapes) -> dict:
    sizes = {}
    for dims, shape in zip(self.in_dims, shapes):
      for factors, size in zip(dims, shape):
        minor = int(np.prod([self.minor_sizes[f] for f in factors[1:]]))
        sizes.setdefault(factors[0], size // minor)
    return sizes

  def axes(self, mesh, arg_shapes) -> tuple[Axes, dict]:
    """(Axes, factor -> axes): each split factor keeps the axes of the first operand
    dimension where it is the major factor, unless an earlier factor took one of them or
    they do not divide it; then it is whole."""
    sizes = self.factor_sizes([a.shape for a in arg_shapes])
    taken, of_factor = set(), {}
    for factor, _ in sorted(self.split.items(), key=lambda kv: Axes._fields.index(kv[1])):
      lead = next(((a, d) for a, dims in zip(arg_shapes, self.in_dims)
                   for d, factors in enumerate(dims) if factors[0] == factor), None)
      axes = _entry_axes(lead[0].sharding, lead[1]) if lead else ()
      count = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
      if taken.intersection(axes) or sizes[factor] % count:
        axes = ()
      taken.update(axes)
      of_factor[factor] = axes
    roles = {role: () for role in Axes._fields}
    for factor, role in self.split.items():
      roles[role] = of_factor[factor]
    return Axes(**roles), of_factor

  def shardings(self, mesh, of_factor, dims_list):
    def spec(dims):
      entries = [of_factor.get(factors[0], ()) for factors in dims]
      return P(*[(e[0] if len(e) == 1 else e) if e else None for e in entries])
    return [NamedSharding(mesh, spec(dims)) for dims in dims_list]

  def sdy(self) -> tuple[str, tuple]:
    """The Shardy rule string and its need-replication factors (all but the split)."""
    text = lambda dims: " ".join(f[0] if len(f) == 1 else "(" + " ".join(f) + ")"
                                 for f in dims)
    rule = ", ".join(map(text, self.in_dims)) + " -> " + ", ".join(map(text, self.out_dims))
    # In order of first appearance: Shardy wants special factors sorted by index.
    factors = dict.fromkeys(f for dims in self.in_dims + self.out_dims for fs in dims
                            for f in fs)
    return rule, tuple(f for f in factors if f not in self.split)


def _explicit_mesh(args):
  """The mesh of the first operand whose type carries an Explicit-axes sharding, else None."""
  for a in args:
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
      return mesh
  return None


def partitioned(body: Callable, ins: tuple[str, ...], outs: tuple[str, ...], split: dict,
                **minor_sizes) -> Callable:
  """`f(*arrays) -> tuple` that partitions `body(axes, *arrays) -> tuple of arrays`.

  With Explicit mesh axes (sharding in types, `jax.make_mesh`'s default) the operands'
  shardings are known while tracing: `f` reshards each operand to the rule's layout (a
  no-op unless a gathered factor arrived split) and runs `body` in a `jax.shard_map`.
  With Auto axes they are only known to the compiler: `f` is a `custom_partitioning`
  whose partition callback applies the same rule (XLA's partitioner runs it on CPU and
  GPU; libtpu does not yet, jax-ml/jax#38196, so on TPU use Explicit axes).

  Args:
    body: the per-shard computation; gets an `Axes` and the local pieces, returns the
      local pieces of every result. It must be correct for every `Axes` the rule can
      give it (collectives over `axes.vocab`, `axes.batch`, ...).
    ins, outs: one factor string per operand and result, e.g. `("n d", "d v", "n")`.
    split: factor -> role (an `Axes` field) for the factors that may stay split.
    **minor_sizes: the sizes of the minor factors of compound dimensions (`g=4`).
  """
  rule = _Rule(tuple(map(_dims, ins)), tuple(map(_dims, outs)), dict(split), minor_sizes)

  @custom_partitioning
  def op(*args):
    return tuple(body(Axes(), *args))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    axes, of_factor = rule.axes(mesh, arg_shapes)
    arg_shardings = rule.shardings(mesh, of_factor, rule.in_dims)
    out_shardings = rule.shardings(mesh, of_factor, rule.out_dims)
    return mesh, lambda *local: tuple(body(axes, *local)), tuple(out_shardings), tuple(
        arg_shardings)

  def infer(mesh, arg_shapes, result_shape):  # GSPMD's propagation (Shardy off)
    del result_shape
    return tuple(rule.shardings(mesh, rule.axes(mesh, arg_shapes)[1], rule.out_dims))

  sdy_rule, replicated = rule.sdy()
  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=sdy_rule, need_replication_factors=replicated,
                   **minor_sizes)

  def call(*args):
    mesh = _explicit_mesh(args)
    if mesh is None:
      return op(*args)
    axes, of_factor = rule.axes(mesh, [jax.typeof(a) for a in args])
    in_shardings = rule.shardings(mesh, of_factor, rule.in_dims)
    out_specs = tuple(s.spec for s in rule.shardings(mesh, of_factor, rule.out_dims))
    args = [jax.reshard(a, s) for a, s in zip(args, in_shardings)]
    # Unchecked: the body states its collectives itself and is never differentiated
    # inside (the ops' custom_vjp calls a forward and a backward `partitioned`).
    return jax.shard_map(lambda *local: tuple(body(axes, *local)), mesh=mesh,
                         in_specs=tuple(s.spec for s in in_shardings),
                         out_specs=out_specs, check_vma=False)(*args)
  return call
