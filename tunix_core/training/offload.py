"""The optimizer state in host memory between steps (`--offload_optimizer`).

Its leaves live in the host's pinned memory (JAX's `pinned_host` memory kind, as
MaxText's optimizer offload); the train step brings them to the devices for the update
and puts the new state back, and the compiler schedules the copies. The step's jit then
spells out its out shardings: a state in host memory must come back there.
"""

import jax


def host(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
  """`sharding` in host memory."""
  return sharding.with_memory_kind("pinned_host")


def on_host(x) -> bool:
  """Whether array (or ShapeDtypeStruct) `x` is placed in host memory."""
  return getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host"


def offloaded(train, rows, state_shardings: dict, metrics_sharding):
  """`(step, jit keywords)`: `train(state, frozen, batch) -> (state, metrics)` whose
  `state["opt_state"]` comes from host memory, moved to `rows` for `train` and back to
  `state_shardings["opt_state"]` after it. Only for an offloaded state: a `device_put`
  of a state already on the devices would copy it."""
  def step(state, frozen, batch):
    new, metrics = train(dict(state, opt_state=jax.device_put(state["opt_state"], rows)),
                         frozen, batch)
    return dict(new, opt_state=jax.device_put(new["opt_state"],
                                              state_shardings["opt_state"])), metrics

  return step, {"out_shardings": (state_shardings, metrics_sharding)}
