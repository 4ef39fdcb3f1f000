"""The optimizer factory: the learning-rate schedule and the elementwise optax transform.

Clipping is not in here: `zero.ShardedOptimizer` clips by the global norm of the whole
model, which a transformation applied to one device's shard could not see.

Params narrower than float32 (`--param_dtype=bfloat16`) train through `compensated`: an
AdamW step at DPO's learning rates (1e-6 of a weight of 1) is far below half a bfloat16
ulp (2**-9 of it), so `param + update` rounds back to `param` and the step is lost. The
optimizer keeps what each rounding drops in an int16 error term per param: param +
error is a float32 master weight (`split`/`join`), updated as float32 training updates
it. Rounded to nearest, a weight the forward sees stays put until its master moved half
an ulp (the SmolLM2 recipe at 2e-6 barely trained so); by default (`--param_rounding=
kahan`) the param is the master rounded up or down at random, unbiased, drawn afresh at
every step from a hash of the step and the index, so the forward follows the master in
expectation and a resume is exact with nothing but the state. 2 bytes a param; without
them (`stochastic`) only the updates are rounded at random.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from tunix_core.training import moments8

OPTIMIZERS = ("adamw", "rmsprop", "sgd")
# `--lr_schedule`: after the warmup, transformers' `get_scheduler` shapes of the same
# names (linear is TRL's default; constant is its constant_with_warmup).
SCHEDULES = ("linear", "cosine", "constant")
# `--param_rounding` of bfloat16 params (`compensated`).
ROUNDINGS = ("kahan", "kahan_nearest", "stochastic")
# `--optimizer_dtype`: the moments' storage (auto: the params' dtype); float8 is
# `moments8`'s 8 bits with a scale per row.
MOMENT_DTYPES = ("auto", "float32", "bfloat16", "float8")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer of a step (`--optimizer`, `--learning_rate`, `--lr_schedule`,
  `--warmup_steps` or `--warmup_ratio`, `--weight_decay`); `steps` is the schedule's
  horizon (`--steps`)."""
  optimizer: str = "adamw"
  learning_rate: float = 1e-6
  lr_schedule: str = "constant"     # the trainer's default is TRL's, linear
  warmup_steps: int = 0
  warmup_ratio: float = 0.0
  steps: int = 1
  weight_decay: float = 0.0
  param_dtype: str = "float32"      # the trained params' (`--param_dtype`)
  optimizer_dtype: str = "auto"     # the moments' (`--optimizer_dtype`; auto: param_dtype)
  param_rounding: str = "kahan"     # bfloat16 params' (`--param_rounding`, `compensated`)

  @property
  def warmup(self) -> int:
    """Warmup steps: `warmup_steps`, else `warmup_ratio` of `steps` rounded up (as
    transformers' `TrainingArguments.get_warmup_steps`)."""
    return self.warmup_steps or math.ceil(self.warmup_ratio * self.steps)

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


def _hash_u32(x):
  """A 32-bit integer mix (murmur3's finaliser) of uint32 `x`, elementwise."""
  for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
    x = (x ^ (x >> shift)) * jnp.uint32(mul)
  return x ^ (x >> 16)


def _noise(shape, seed):
  """32 random bits per element of `shape`, a hash of `seed` and the element's index."""
  index = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
  return _hash_u32(index * jnp.uint32(0x9E3779B1) + seed)


def split(master, seed=None):
  """float32 `master` -> `(param, error)`: a bfloat16 `param` and an int16 `error` from
  which `join` recovers `master` (sign-magnitude float bits are ordered within a sign,
  so bit patterns count float32 steps).

  Without `seed`: `param` is the nearest (ties away from zero) and `error` the 16 low
  bits relative to it, exactly. With `seed` (uint32): `param` is rounded up or down at
  random with the probabilities that make it unbiased (a hash of `seed` and the index),
  and `error` holds that choice and the 15 upper of the 16 low bits; the lowest bit is
  rounded away at random too, so the master keeps 23 bits, unbiased."""
  bits = jax.lax.bitcast_convert_type(master.astype(jnp.float32), jnp.uint32)
  if seed is None:
    param_bits = (bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000)
    error = jax.lax.bitcast_convert_type(bits - param_bits, jnp.int32).astype(jnp.int16)
  else:
    noise = _noise(bits.shape, seed)
    odd = bits & 1  # to an even neighbour: up or down by one step, at random
    bits = bits - odd + ((odd & (noise >> 16)) << 1)
    low = bits & jnp.uint32(0xFFFF)
    up = (low + (noise & jnp.uint32(0xFFFF))) >> 16  # 1 with probability low / 2**16
    param_bits = (bits & jnp.uint32(0xFFFF0000)) + (up << 16)
    error = jax.lax.bitcast_convert_type(((up << 15) | (low >> 1)).astype(jnp.uint16),
                                         jnp.int16)
  param = jax.lax.bitcast_convert_type(param_bits, jnp.float32).astype(jnp.bfloat16)
  return param, error


def join(param, error, stochastic: bool = False):
  """The float32 master weight of bfloat16 `param` and its int16 `error` (`split`;
  `stochastic`: split with a seed)."""
  bits = jax.lax.bitcast_convert_type(param.astype(jnp.float32), jnp.uint32)
  if not stochastic:
    low = jax.lax.bitcast_convert_type(error.astype(jnp.int32), jnp.uint32)
    return jax.lax.bitcast_convert_type(bits + low, jnp.float32)
  e = jax.lax.bitcast_convert_type(error, jnp.uint16).astype(jnp.uint32)
  bits = bits - ((e >> 15) << 16) + ((e & jnp.uint32(0x7FFF)) << 1)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def stochastic_round(x, dtype, seed):
  """float32 `x` rounded to the 16-bit float `dtype` up or down with the probabilities
  that make it unbiased, from a hash of `seed` (uint32 scalar) and each element's index:
  deterministic, so a resume rounds as the run did. float32 `dtype`: `x` itself."""
  if jnp.dtype(dtype) == jnp.float32:
    return x
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  noise = _noise(x.shape, seed) & jnp.uint32(0xFFFF)
  kept = (bits + noise) & jnp.uint32(0xFFFF0000)  # the low 16 bits are bfloat16's cut
  return jax.lax.bitcast_convert_type(kept, jnp.float32).astype(dtype)


def compensated(inner: optax.GradientTransformation, state_dtype,
                rounding: str | None) -> optax.GradientTransformation:
  """`inner` run in float32 whatever the params' and its state's dtypes.

  Its state is kept in `state_dtype` (a dtype, or "float8": `moments8`'s 8 bits with
  a scale per row), rounded stochastically (`stochastic_round`, `store_moments`): an
  EMA step such as Adam's `(1 - b2) * (g**2 - nu)`, 1e-3 of `nu`, is below half a
  bfloat16 ulp, and rounding to nearest would drop every decrease (nu would only
  ratchet up). `rounding` (bfloat16 params) takes each param's float32 master weight,
  `join(param, error)`, plus `inner`'s update, and `split`s it again: "kahan" presents
  the param rounded stochastically from the master (its expectation is the master, so
  the forward follows updates far below an ulp), "kahan_nearest" rounds to nearest
  (exact, but a weight looks unchanged until its master moved half an ulp); the update
  returned lands each param on its new value. "stochastic" keeps no error term (2 bytes
  a param less) and rounds `param + update` stochastically: float32's trajectory in
  expectation, with a random walk around it. None: `inner`'s float32 update. Elementwise,
  so it runs on ZeRO-1 / FSDP pieces as on whole leaves (the random draws follow the
  element's index in its piece: another device count rounds otherwise).
  """
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  eight_bit = state_dtype == "float8"
  floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)

  def init(params):
    state = inner.init(jax.tree.map(
        lambda x: x.astype(jnp.float32 if eight_bit else state_dtype), params))
    if eight_bit:  # every floating leaf of the state is a moment (counts are integers)
      state = jax.tree_util.tree_map_with_path(
          lambda path, x: moments8.encode(x, jnp.zeros(x.shape, jnp.uint32),
                                          _is_second(path)) if floating(x) else x, state)
    error = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.int16), params)
    return CompensatedState(state, error if rounding in ("kahan", "kahan_nearest") else None,
                            jnp.zeros((), jnp.int32))

  def update(grads, state, params=None):
    # The moments in float32 too: `b2 * nu` of a bfloat16 `nu` would round in bfloat16.
    updates, new_inner = inner.update(f32(grads), widen_moments(state.inner), f32(params))
    leaves = jax.tree.leaves(new_inner)
    seed = state.count.astype(jnp.uint32) * jnp.uint32(0x632BE5AB)
    new_inner = store_moments(new_inner, state.inner, seed)
    count = state.count + 1
    if rounding is None:
      return updates, CompensatedState(new_inner, None, count)
    wide = lambda x: x.astype(jnp.float32)
    if rounding == "stochastic":
      seeds = iter(range(len(leaves), len(leaves) + len(jax.tree.leaves(params))))
      deltas = jax.tree.map(lambda p, u: wide(stochastic_round(
          wide(p) + u, p.dtype, seed + jnp.uint32(next(seeds)))) - wide(p), params, updates)
      return deltas, CompensatedState(new_inner, None, count)

    sr = rounding == "kahan"
    seeds = iter(range(len(leaves), len(leaves) + len(jax.tree.leaves(params))))
    new = jax.tree.map(lambda p, u, e: _Split(*split(
        join(p, e, sr) + u, seed + jnp.uint32(next(seeds)) if sr else None)),
        params, updates, state.error)
    is_pair = lambda x: isinstance(x, _Split)
    # The delta between two nearby bfloat16 values is exact in float32, so
    # `optax.apply_updates` (param + delta, rounded) lands on the new param itself.
    deltas = jax.tree.map(lambda n, p: n.param.astype(jnp.float32) - p.astype(jnp.float32),
                          new, params, is_leaf=is_pair)
    error = jax.tree.map(lambda n: n.error, new, is_leaf=is_pair)
    return deltas, CompensatedState(new_inner, error, count)

  return optax.GradientTransformation(init, update)


def _is_second(path) -> bool:
  """Whether a state leaf at `path` is a second moment (optax's `nu`, never negative)."""
  return any(getattr(k, "name", None) == "nu" for k in path)


def store_moments(wide, like, seed):
  """float32 optimizer state `wide` stored as `like` (a state, or its ShapeDtypeStructs)
  stores it: `moments8` codes, or rounded stochastically to a 16-bit float, the draws
  from uint32 `seed` and each leaf's index; integer leaves cast."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(wide)
  olds = jax.tree.leaves(like, is_leaf=moments8.is_moment)
  stored = []
  for i, ((path, new), old) in enumerate(zip(paths, olds)):
    s = seed + jnp.uint32(i)
    if moments8.is_moment(old):
      stored.append(moments8.encode(new, _noise(new.shape, s), root=_is_second(path)))
    elif jnp.issubdtype(old.dtype, jnp.floating):
      stored.append(stochastic_round(new, old.dtype, s))
    else:
      stored.append(new.astype(old.dtype))
  return jax.tree.unflatten(treedef, stored)


def widen_moments(opt_state):
  """`opt_state` with every stored moment (bfloat16, or `moments8`'s 8 bits) as float32;
  works on a whole state or on one device's pieces."""
  def wide(path, x):
    if moments8.is_moment(x):
      return moments8.decode(x, _is_second(path))
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree_util.tree_map_with_path(wide, opt_state, is_leaf=moments8.is_moment)


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """The learning rate at each optimizer step `count` (0-based, the count of updates
  already applied, as optax and transformers' `LambdaLR` count): `learning_rate * count
  / warmup` during the warmup, then, over the `steps - warmup` steps left, a linear
  decay to 0, a half cosine to 0, or constant. Equal to transformers' `get_scheduler`
  ("linear", "cosine", "constant_with_warmup") step for step."""
  if cfg.lr_schedule not in SCHEDULES:
    raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r}; choose one of {SCHEDULES}")
  peak, warmup = cfg.learning_rate, cfg.warmup
  left = max(cfg.steps - warmup, 1)
  after = {"linear": lambda: optax.linear_schedule(peak, 0.0, left),
           "cosine": lambda: optax.cosine_decay_schedule(peak, left),
           "constant": lambda: optax.constant_schedule(peak)}[cfg.lr_schedule]()
  if not warmup:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(cfg: OptimizerConfig) -> tuple[optax.GradientTransformation,
                                                  optax.Schedule]:
  """`(tx, schedule)` of an `OptimizerConfig`.

  The schedule is `make_schedule`'s. AdamW's weight decay skips the norm scales (params whose name ends in `norm`). Params
  or moments in a dtype other than float32 go through `compensated` (compensating the
  params' rounding when they are narrower than float32).
  """
  if cfg.optimizer not in OPTIMIZERS:
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of {OPTIMIZERS}")
  schedule = make_schedule(cfg)
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
    tx = compensated(tx, cfg.state_dtype if cfg.state_dtype == "float8"
                     else jnp.dtype(cfg.state_dtype),
                     cfg.param_rounding if cfg.param_dtype != "float32" else None)
  return tx, schedule
