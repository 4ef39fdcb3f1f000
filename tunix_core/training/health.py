"""Non-finite steps: which values a step checks, how the train state records them, and
what the loop does about them (`--on_nonfinite`); and the replicas' param checksum.

A state's `"nonfinite"` is int32 `[3]`: the count of non-finite steps so far, the first
such step, and a bit set of what was non-finite in it (bit i is `NONFINITE_KEYS[i]`).
"""

import jax
import jax.numpy as jnp

# The values a step checks for NaN/Inf; bit i of `state["nonfinite"][2]` is key i.
NONFINITE_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected",
                  "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


class NonFiniteStep(RuntimeError):
  """A step's loss, metrics or gradient norm was NaN/Inf; its update was not applied and
  nothing after it was checkpointed."""


def check_finite(health, action: str, log) -> None:
  """Acts on a state's `[count, first step, bits]`: raises `NonFiniteStep` under "stop",
  logs the running count under "skip"."""
  count, first, bits = (int(x) for x in health)
  if not count:
    return
  what = ", ".join(nonfinite_names(bits))
  if action == "stop":
    raise NonFiniteStep(f"step {first} produced non-finite {what}; its update was not "
                        "applied and it was not checkpointed (--on_nonfinite=skip skips "
                        "such steps instead)")
  log(f"non-finite steps skipped so far: {count} (first: step {first}, {what})")


def nonfinite_names(bits: int) -> list[str]:
  """The keys a `state["nonfinite"][2]` bit set names."""
  return [k for i, k in enumerate(NONFINITE_KEYS) if int(bits) >> i & 1]


def update(health_3, values: dict, step):
  """`(all finite, updated [count, first step, bits])` after a step's `values`."""
  bits = sum(jnp.where(jnp.isfinite(values[k]), 0, 1 << i)
             for i, k in enumerate(NONFINITE_KEYS)).astype(jnp.int32)
  ok = bits == 0
  count, first, first_bits = health_3[0], health_3[1], health_3[2]
  fresh = count == 0
  bad = jnp.stack([count + 1, jnp.where(fresh, step, first), jnp.where(fresh, bits, first_bits)])
  return ok, jnp.where(ok, health_3, bad)


def checksum(params):
  """This device's params as one uint32 `[1]`: the wrapping sum of their bit patterns
  (the replica check)."""
  total = jnp.zeros((), jnp.uint32)
  for x in jax.tree.leaves(params):
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    total = total + jnp.sum(bits, dtype=jnp.uint32)
  return total[None]
