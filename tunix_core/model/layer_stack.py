"""The decoder's layer loop: one `lax.scan` over the stacked layers, rematerialised as
`--remat` says, and under FSDP with `--remat=full_prefetch` a scan whose backward is
written by hand, so that each backward trip's transfers run under that trip's compute.

Differentiating `jax.checkpoint(layer) + lax.scan` (the general path of `model.decoder`)
gives a backward trip for layer i that gathers layer i's weights, recomputes the layer,
differentiates it and reduce-scatters layer i's gradient: the gather has to finish before
the trip's first matmul and the reduce-scatter starts after its last, so both are
exposed (the TPU compiler pipelines only the forward loop's gathers). Here the backward
trip of layer i computes with weights gathered by the trip before, and starts two
transfers that nothing in the trip waits for: the gather of layer i - 1 and the
reduce-scatter of layer i + 1's gradient, made by the trip before. The scheduler runs both
under the trip's matmuls.

Costs: one more layer of gathered weights and one of unreduced gradients alive at once;
the first backward trip reduce-scatters nothing useful (layer L's gradient is zeros) and
the last gathers a layer nobody uses (layer -1, i.e. L - 1): 2 / L of the backward's
transfers. The forward saves each layer's input, as `--remat=full` does, and the backward
recomputes each layer from it. Only the leaves of the layer params being differentiated
get gradients (LoRA's frozen base gets none: no dots, no reduce-scatter). Whether the
compiler then runs the transfers asynchronously is its choice: docs/tpu.md has the
compiled figures (the gathers are hidden on a v5e-16; gradient syncs that the compiler
makes all-reduces stay synchronous), hence opt-in.
"""

import jax
import jax.numpy as jnp
from jax import custom_derivatives as cd

from tunix_core.model.config import REMAT_POLICIES


@jax.named_scope("layers")  # the scan's own work in benchmarks/step_profile.py
def scan(body, x, pieces, settings, rows, *, gather=None, remat: str = "none"):
  """`x_{i+1} = body(x_i, layer_i, settings_i, rows)` over the L layers; returns `x_L`.

  `layer_i` is `pieces`' slice i, or under FSDP `gather(slice i)`. Each layer is
  rematerialised by `REMAT_POLICIES[remat]`; under FSDP a layer never keeps its gathered
  weights for the backward (`--remat=none` saves the matmul outputs instead), and with
  `remat="full_prefetch"` the backward is `remat_scan`'s. Arguments as in `remat_scan`.
  """
  if gather is not None and remat == "full_prefetch":
    return remat_scan(body, gather, x, pieces, settings, rows)

  def trip(x, layer_and_setting):
    layer, setting = layer_and_setting
    return body(x, layer if gather is None else gather(layer), setting, rows), None

  policy = REMAT_POLICIES[remat]
  if gather is not None and policy is None:
    policy = REMAT_POLICIES["dots"]  # no gathered weight is a dot output
  if policy is not None:
    trip = jax.checkpoint(trip, policy=policy)
  return jax.lax.scan(trip, x, (pieces, settings))[0]


def remat_scan(body, gather, x, pieces, settings, rows):
  """`x_{i+1} = body(x_i, gather(pieces_i), settings_i, rows)` for i < L; returns `x_L`.

  Args:
    body: `(x, layer, setting, rows) -> x`: one layer on its gathered weights.
    gather: a device's pieces of one layer -> that layer's weights, leaf for leaf (the
      same tree structure); differentiable, its VJP the gradient's reduce-scatter
      (`parallel.fsdp.FsdpLayout.gather_layer`, or LoRA's wrapper around it).
    x: the stack's input, e.g. `[B, T, D]`; differentiable.
    pieces: a tree of `[L, ...]` leaves, a device's pieces of every layer; differentiable.
    settings: a tree of `[L, ...]` per-layer constants; not differentiated.
    rows: arrays every layer reads (positions, masks); not differentiated.
  """
  trained = []  # the forward rule's record of which leaves of `pieces` are differentiated

  @jax.custom_vjp
  def stack(x, pieces, settings, rows):
    return _forward(body, gather, x, pieces, settings, rows)[0]

  def fwd(x, pieces, settings, rows):
    trained[:] = [p.perturbed for p in jax.tree.leaves(
        pieces, is_leaf=lambda p: isinstance(p, cd.CustomVJPPrimal))]
    x, pieces, settings, rows = cd.custom_vjp_primal_tree_values((x, pieces, settings, rows))
    out, xs = _forward(body, gather, x, pieces, settings, rows)
    return out, (xs, pieces, settings, rows)

  def bwd(res, g):
    xs, pieces, settings, rows = res
    if isinstance(g, cd.SymbolicZero):
      g = jnp.zeros(g.shape, g.dtype)
    g, d_pieces = _backward(body, gather, trained, xs, pieces, settings, rows, g)
    return g, d_pieces, None, None

  stack.defvjp(fwd, bwd, symbolic_zeros=True)
  return stack(x, pieces, settings, rows)


def _forward(body, gather, x, pieces, settings, rows):
  """The plain scan; also returns each layer's input `[L, *x.shape]`."""
  def trip(x, layer_and_setting):
    layer, setting = layer_and_setting
    return body(x, gather(layer), setting, rows), x
  return jax.lax.scan(trip, x, (pieces, settings))


def _backward(body, gather, trained, xs, pieces, settings, rows, g):
  """The reverse scan with the next gather and the last reduce-scatter in each trip."""
  leaves, treedef = jax.tree.flatten(pieces)
  num_layers = xs.shape[0]
  tree = lambda leaves_: jax.tree.unflatten(treedef, leaves_)
  pick = lambda leaves_, keep: [v for v, t in zip(leaves_, trained) if t == keep]

  def merge(trained_leaves, frozen_leaves):
    it_t, it_f = iter(trained_leaves), iter(frozen_leaves)
    return [next(it_t) if t else next(it_f) for t in trained]

  def layer(i):
    return [jax.lax.dynamic_index_in_dim(v, i % num_layers, keepdims=False) for v in leaves]

  def scatter(i, d_trained):
    """Layer i's trained weight cotangents -> its trained pieces' gradients (the
    reduce-scatter; the gather `jax.vjp` traces on the way is dead and compiled away)."""
    own = layer(i)
    frozen = pick(own, False)
    _, pull = jax.vjp(lambda t: pick(jax.tree.leaves(gather(tree(merge(t, frozen)))), True),
                      pick(own, True))
    return pull(d_trained)[0]

  def trip(carry, inp):
    (g, weights, d_after, grads), (i, x, setting) = carry, inp
    before = jax.tree.leaves(gather(tree(layer(i - 1))))   # for the next trip
    d_pieces = scatter(i + 1, d_after)                     # made by the trip before
    grads = [jax.lax.dynamic_update_index_in_dim(acc, d, (i + 1) % num_layers, 0)
             for acc, d in zip(grads, d_pieces)]
    frozen = pick(weights, False)
    run = lambda x, t: body(x, tree(merge(t, frozen)), setting, rows)
    _, pull = jax.vjp(run, x, pick(weights, True))
    g, d_layer = pull(g)
    return (g, before, d_layer, grads), None

  weights = jax.tree.leaves(gather(tree(layer(num_layers - 1))))
  grads = [jnp.zeros_like(v) for v in pick(leaves, True)]
  carry = (g, weights, [jnp.zeros_like(w) for w in pick(weights, True)], grads)
  trips = (jnp.arange(num_layers), xs, settings)
  (g, _, d_first, grads), _ = jax.lax.scan(trip, carry, trips, reverse=True)
  grads = [jax.lax.dynamic_update_index_in_dim(acc, d, 0, 0)
           for acc, d in zip(grads, scatter(0, d_first))]
  return g, tree(merge(grads, [None] * len(leaves)))
