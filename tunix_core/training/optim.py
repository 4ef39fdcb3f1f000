"""The optimizer factory: the learning-rate schedule and the elementwise optax transform.

Clipping is not in here: `zero.ShardedOptimizer` clips by the global norm of the whole
model, which a transformation applied to one device's shard could not see.

Params narrower than float32 (`--param_dtype=bfloat16`) train through `compensated`: an
AdamW step at DPO's learning rates (1e-6 of a weight of 1) is far below half a bfloat16
ulp (2**-9 of it), so `param + update` rounds back to `param` and the step is lost. The
optimizer keeps what each rounding drops: an int16 error term per param holds the 16 low
bits of the float32 value the param was rounded from (`split`/`join`), so param + error
is a float32 master weight, updated as float32 training updates it (Kahan's compensated
summation, with an error term that is itself exact). It is deterministic (a resume is
exact with nothing but the state) and costs 2 bytes a param; stochastic rounding would
save those bytes but track float32 only in expectation, and a bfloat16 error term (8
significant bits) loses up to a tenth of each step at these learning rates.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

OPTIMIZERS = ("adamw", "rmsprop", "sgd")
ROUNDINGS = ("kahan", "stochastic")  # `--param_rounding` of bfloat16 params


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer of a step (`--optimizer`, `--learning_rate`, `--warmup_steps`,
  `--weight_decay`)."""
  optimizer: str = "adamw"
  learning_rate: float = 1e-6
  warmup_steps: int = 0
  weight_decay: float = 0.0
  param_dtype: str = "float32"      # the trained params' (`--param_dtype`)
  optimizer_dtype: str = "auto"     # the moments' (`--optimizer_dtype`; auto: param_dtype)
  param_rounding: str = "kahan"     # bfloat16 params' (`--param_rounding`, `compensated`)

  @property
  def state_dtype(self) -> str:
    return self.param_dtype if self.optimizer_dtype == "auto" else self.optimizer_dtype


class CompensatedState(NamedTuple):
  """`compensated`'s state: the inner transformation's (its moments in the optimizer
  dtype), per param the int16 low bits rounding it dropped (`split`; None for float32
  params), and the updates applied (int32, the seed of the moments' rounding)."""
  inner: optax.OptState
  error: optax.Params | None
  count: jax.Array


class _Split(NamedTuple):
  param: jax.Array
  error: jax.Array


def split(master):
  """float32 `master` -> `(param, error)`: bfloat16 `param` nearest to it (ties away
  from zero) and int16 `error`, its 16 low bits relative to `param` (sign-magnitude
  float bits are ordered within a sign, so the bits between two neighbouring bfloat16
  values count float32 steps between them). `join` inverts it exactly."""
  bits = jax.lax.bitcast_convert_type(master.astype(jnp.float32), jnp.uint32)
  param_bits = (bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000)
  error = jax.lax.bitcast_convert_type(bits - param_bits, jnp.int32).astype(jnp.int16)
  param = jax.lax.bitcast_convert_type(param_bits, jnp.float32).astype(jnp.bfloat16)
  return param, error


def join(param, error):
  """The float32 master weight of bfloat16 `param` and its int16 `error` (`split`)."""
  bits = jax.lax.bitcast_convert_type(param.astype(jnp.float32), jnp.uint32)
  low = jax.lax.bitcast_convert_type(error.astype(jnp.int32), jnp.uint32)
  return jax.lax.bitcast_convert_type(bits + low, jnp.float32)


def _hash_u32(x):
  """A 32-bit integer mix (murmur3's finaliser) of uint32 `x`, elementwise."""
  for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
    x = (x ^ (x >> shift)) * jnp.uint32(mul)
  return x ^ (x >> 16)


def stochastic_round(x, dtype, seed):
  """float32 `x` rounded to the 16-bit float `dtype` up or down with the probabilities
  that make it unbiased, from a hash of `seed` (uint32 scalar) and each element's index:
  deterministic, so a resume rounds as the run did. float32 `dtype`: `x` itself."""
  if jnp.dtype(dtype) == jnp.float32:
    return x
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  index = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
  noise = _hash_u32(index * jnp.uint32(0x9E3779B1) + seed) & jnp.uint32(0xFFFF)
  kept = (bits + noise) & jnp.uint32(0xFFFF0000)  # the low 16 bits are bfloat16's cut
  return jax.lax.bitcast_convert_type(kept, jnp.float32).astype(dtype)


def compensated(inner: optax.GradientTransformation, state_dtype,
                rounding: str | None) -> optax.GradientTransformation:
  """`inner` run in float32 whatever the params' and its state's dtypes.

  Its state is kept in `state_dtype`, rounded stochastically (`stochastic_round`): an
  EMA step such as Adam's `(1 - b2) * (g**2 - nu)`, 1e-3 of `nu`, is below half a
  bfloat16 ulp, and rounding to nearest would drop every decrease (nu would only
  ratchet up). With `rounding="kahan"` (bfloat16 params), the update it returns takes
  each param to the bfloat16 rounding of its float32 master weight (`join(param,
  error)`) plus `inner`'s update, and the new error is what that rounding dropped
  (`split`); with "stochastic", to `param + update` rounded stochastically (no error
  term: 2 bytes a param less, float32's trajectory in expectation); with None, it is
  `inner`'s float32 update. Elementwise, so it runs on ZeRO-1 / FSDP pieces as on whole
  leaves (stochastic rounding draws per piece: another device count rounds otherwise).
  """
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)

  def init(params):
    state = inner.init(jax.tree.map(lambda x: x.astype(state_dtype), params))
    error = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.int16), params)
    return CompensatedState(state, error if rounding == "kahan" else None,
                            jnp.zeros((), jnp.int32))

  def update(grads, state, params=None):
    # The moments in float32 too: `b2 * nu` of a bfloat16 `nu` would round in bfloat16.
    widen = lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
    updates, new_inner = inner.update(f32(grads), jax.tree.map(widen, state.inner),
                                      f32(params))
    leaves, treedef = jax.tree.flatten(new_inner)
    seed = state.count.astype(jnp.uint32) * jnp.uint32(0x632BE5AB)
    new_inner = jax.tree.unflatten(treedef, [
        stochastic_round(new, old.dtype, seed + jnp.uint32(i))
        if jnp.issubdtype(old.dtype, jnp.floating) else new.astype(old.dtype)
        for i, (new, old) in enumerate(zip(leaves, jax.tree.leaves(state.inner)))])
    count = state.count + 1
    if rounding is None:
      return updates, CompensatedState(new_inner, None, count)
    wide = lambda x: x.astype(jnp.float32)
    if rounding == "stochastic":
      seeds = iter(range(len(leaves), len(leaves) + len(jax.tree.leaves(params))))
      deltas = jax.tree.map(lambda p, u: wide(stochastic_round(
          wide(p) + u, p.dtype, seed + jnp.uint32(next(seeds)))) - wide(p), params, updates)
      return deltas, CompensatedState(new_inner, None, count)

    new = jax.tree.map(lambda p, u, e: _Split(*split(join(p, e) + u)), params, updates,
                       state.error)
    is_pair = lambda x: isinstance(x, _Split)
    # The delta between two nearby bfloat16 values is exact in float32, so
    # `optax.apply_updates` (param + delta, rounded) lands on the new param itself.
    deltas = jax.tree.map(lambda n, p: n.param.astype(jnp.float32) - p.astype(jnp.float32),
                          new, params, is_leaf=is_pair)
    error = jax.tree.map(lambda n: n.error, new, is_leaf=is_pair)
    return deltas, CompensatedState(new_inner, error, count)

  return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimizerConfig) -> tuple[optax.GradientTransformation,
                                                  optax.Schedule]:
  """`(tx, schedule)` of an `OptimizerConfig`.

  The schedule warms up linearly from 0 to `learning_rate`, then stays constant.
  AdamW's weight decay skips the norm scales (params whose name ends in `norm`). Params
  or moments in a dtype other than float32 go through `compensated` (compensating the
  params' rounding when they are narrower than float32).
  """
  if cfg.optimizer not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of {OPTIMIZERS}")
  if cfg.warmup_steps > 0:
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  else:
    schedule = optax.constant_schedule(cfg.learning_rate)
  if cfg.optimizer == "adamw":
    def decay_mask(params):
      return jax.tree_util.tree_map_with_path(
          lambda path, _: not str(path[-1].key).endswith("norm"), params)
    tx = optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask)
  elif cfg.optimizer == "rmsprop":
    tx = optax.rmsprop(schedule)
  else:
    tx = optax.sgd(schedule)
  if cfg.param_dtype != "float32" or cfg.state_dtype != "float32":
    tx = compensated(tx, jnp.dtype(cfg.state_dtype),
                     cfg.param_rounding if cfg.param_dtype != "float32" else None)
  return tx, schedule
