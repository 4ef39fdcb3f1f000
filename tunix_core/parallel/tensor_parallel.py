"""Megatron-style tensor parallelism over a "model" mesh axis, inside `shard_map`.

With `model.param_specs(cfg, "model")` each of the K devices of the axis holds a slice of
the heads (`wq wk wv` column-parallel, `wo` row-parallel), of the MLP columns (`w_gate
w_up` column-, `w_down` row-parallel) and of the vocabulary (`embed` rows, `lm_head`
columns); norms are replicated. Activations between the blocks are replicated. Two
conjugate ops keep gradients exact whatever `check_vma` says:

- `enter(x)`: identity forward, `psum` backward (a replicated activation feeding sharded
  heads gets the sum of every slice's gradient);
- `leave(y)`: `psum` forward, identity backward (the row-parallel partial sums).

`forward` wires them around attention and the MLP (`model.decoder`) with the
per-device `local_config`; the LM head is `tunix_kernels.fused_logprobs(..., vocab_axis=)`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tunix_core import model as model_lib


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def enter(x, axis: str):
  return x


enter.defvjp(lambda x, axis: (x, None), lambda axis, _, g: (jax.lax.psum(g, axis),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def leave(x, axis: str):
  return jax.lax.psum(x, axis)


leave.defvjp(lambda x, axis: (jax.lax.psum(x, axis), None), lambda axis, _, g: (g,))


def check(cfg: model_lib.ModelConfig, k: int) -> None:
  """ValueError naming the first size that the `k` devices of the model axis do not
  divide (heads, kv-heads, MLP width, vocabulary)."""
  for name in ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
    if getattr(cfg, name) % k:
      raise ValueError(f"--model_parallel={k} does not divide {name}={getattr(cfg, name)}")


def local_config(cfg: model_lib.ModelConfig, k: int) -> model_lib.ModelConfig:
  """The shapes one device of a `k`-way model axis computes with."""
  check(cfg, k)
  return dataclasses.replace(cfg, num_heads=cfg.num_heads // k,
                             num_kv_heads=cfg.num_kv_heads // k, mlp_dim=cfg.mlp_dim // k,
                             vocab_size=cfg.vocab_size // k)


def embed(params, tokens_BxT, cfg, axis: str):
  """Vocabulary-parallel embedding: each device looks up the ids it owns (zeros for the
  others) and the rows are summed over the axis."""
  local_vocab = params["embed"].shape[0]
  first = jax.lax.axis_index(axis) * local_vocab
  owned = (tokens_BxT >= first) & (tokens_BxT < first + local_vocab)
  x = model_lib.embed(params, jnp.where(owned, tokens_BxT - first, 0), cfg)
  return leave(jnp.where(owned[..., None], x, 0), axis)


def forward(params, tokens_BxT, mask_BxT, cfg, axis: str, gather_layer=None, **rows):
  """`model.forward` on a device's slices (`params` placed by `param_specs(cfg, axis)`):
  replicated `[B, T, D]` hidden states; `cfg` is the global config. `gather_layer` and
  the packed-row keywords (`rows`) as in `model.forward` (FSDP over another axis of this
  device's slices)."""
  return model_lib.decoder(
      params, embed(params, tokens_BxT, cfg, axis), mask_BxT, cfg, gather_layer,
      layer_cfg=local_config(cfg, jax.lax.axis_size(axis)),
      enter=lambda h: enter(h, axis), leave=lambda h: leave(h, axis), **rows)


def sync_replicated_grads(grads, axis: str):
  """Sums over the model axis the gradients of the replicated params used inside the
  sharded heads (Qwen3/Gemma 3 `q_norm`, `k_norm`): each device saw only its heads.
  Every other replicated param acts on replicated activations: its gradient is whole."""
  layers = dict(grads["layers"])
  for name in ("q_norm", "k_norm"):
    if name in layers:
      layers[name] = jax.lax.psum(layers[name], axis)
  return dict(grads, layers=layers)


def split_dims(specs: dict, axis: str = "model") -> dict:
  """Per leaf of a tree of PartitionSpecs (`model.param_specs(cfg, "model")`, or the
  adapters' `model.lora.param_specs`): the dimension split over `axis`, or None for a
  replicated leaf."""
  return jax.tree.map(lambda spec: spec.index(axis) if axis in spec else None, specs,
                      is_leaf=lambda x: isinstance(x, P))


class Stacked:
  """A one-slice layout (`zero.Zero1Layout` or `fsdp.FsdpLayout` over one slice's shapes, e.g.
  of `local_config(cfg, k)`, cut over the data axis) applied to each of the `k` slices of
  the model axis, which `specs` (PartitionSpecs over "model" of the logical params) say. Its pieces have rows `i k + j` = data piece i of model slice j, the block
  device (i, j) of a `("data", "model")` mesh holds under `P(("data", "model"))`; inside
  `shard_map` each device sees the inner layout's local block. Same interface as the
  inner layout for `zero.relayout_opt_state`."""

  def __init__(self, inner, specs: dict, k: int):
    self.inner, self.k = inner, k
    self.num_shards = inner.num_shards * k
    self.treedef = inner.treedef
    self.dims = jax.tree.leaves(split_dims(specs), is_leaf=lambda x: x is None)

  def _split(self, tree):
    """Logical leaves -> `[k, *slice]` (replicated leaves repeated k times)."""
    leaves = jax.tree.leaves(tree)
    out = [jnp.broadcast_to(x, (self.k,) + x.shape) if d is None
           else jnp.stack(jnp.split(x, self.k, axis=d)) for x, d in zip(leaves, self.dims)]
    return jax.tree.unflatten(self.treedef, out)

  def _join(self, tree):
    leaves = jax.tree.leaves(tree)
    out = [x[0] if d is None else jnp.concatenate(list(x), axis=d)
           for x, d in zip(leaves, self.dims)]
    return jax.tree.unflatten(self.treedef, out)

  def to_pieces(self, tree):
    """Logical arrays -> `[n k, ...]` rows; jit-able."""
    per_slice = jax.vmap(self.inner.to_pieces)(self._split(tree))  # [k, n, ...]
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:]),
                        per_slice)

  def to_logical(self, tree):
    """Inverse of `to_pieces`; jit-able."""
    per_slice = jax.tree.map(
        lambda x: jnp.swapaxes(x.reshape((-1, self.k) + x.shape[1:]), 0, 1), tree)
    return self._join(jax.vmap(self.inner.to_logical)(per_slice))

  def local_shapes(self):
    return self.inner.local_shapes()
