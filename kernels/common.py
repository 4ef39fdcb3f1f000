"""Helpers shared by the kernels: tile arithmetic and `BlockSizes` checks, shard_map axis
types and TPU interpret mode.

Inside `jax.shard_map(check_vma=True)` every value records the mesh axes it varies
over. Kernels built from `pallas_call`, `lax.scan` carries and `custom_vjp` have to
state those types themselves; these helpers derive them from the inputs.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

# The masked score of the kernels' online softmaxes: a large finite negative instead of
# -inf keeps `m_old - m_new` free of inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def round_up(x: int, m: int) -> int:
  """`x` rounded up to a multiple of `m` (tile arithmetic)."""
  return -(-x // m) * m


def check_block(name: str, value, multiple: int) -> None:
  """A `BlockSizes` tile: a positive multiple of `multiple`, else a ValueError naming it."""
  if not isinstance(value, int) or value <= 0 or value % multiple:
    raise ValueError(f"BlockSizes.{name}={value!r} must be a positive multiple of {multiple}")


def check_vmem_limit(value) -> None:
  """A `BlockSizes.vmem_limit_bytes`: a positive int or None, else a ValueError."""
  if value is not None and (not isinstance(value, int) or value <= 0):
    raise ValueError(f"BlockSizes.vmem_limit_bytes={value!r} must be a positive int or None")


def _varying(x) -> frozenset:
  return jax.typeof(x).manual_axis_type.varying


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """Output type of a `pallas_call` that varies over every axis any input varies over."""
  mat = jax.typeof(inputs[0]).manual_axis_type
  varying = frozenset().union(*map(_varying, inputs))
  mat = type(mat)(varying=varying, unreduced=frozenset(), reduced=frozenset())
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def vary_like(x, *inputs):
  """`x` marked as varying over every axis any of `inputs` varies over (a scan init)."""
  axes = frozenset().union(*map(_varying, inputs)) - _varying(x)
  return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def cotangent_for(ct, primal):
  """Sums a cotangent over the axes it varies over but its primal does not: the
  transpose of the implicit broadcast of a replicated input (e.g. the LM head)."""
  axes = _varying(ct) - _varying(primal)
  return jax.lax.psum(ct, tuple(sorted(axes))) if axes else ct


def call_interpret(fn):
  """Returns `fn(interpret_params)`, resetting the interpreter's global state if it raises.

  The interpreter keeps simulated TPU memory and semaphores in process-wide state; a
  failed call must not poison the next one.
  """
  try:
    return fn(pltpu.InterpretParams())
  except Exception:
    pltpu.reset_tpu_interpret_mode_state()
    raise
