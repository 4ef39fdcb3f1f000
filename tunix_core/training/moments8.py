"""8-bit optimizer moments (`--optimizer_dtype=float8`): 1 byte a moment instead of 2 or 4.

A moment is stored as float8 e4m3 codes of `moment / scale`, with a float32 scale per
row of its last axis (a 1-D array, such as a ZeRO-1 piece, in rows of `BLOCK`): the
row's absmax maps to e4m3's largest value, 448, so each row keeps float8's 2**17 range
under its own largest entry and 3 mantissa bits. Rows, not blocks cut across them: a
pad or relayout of a whole moment is a copy of it in the update, which cost more
memory than the 8 bits saved (Llama-3-8B's FSDP step on a v5e-8 ahead of time: 15.8
GiB with blocks of 128 over the flattened moment, 13.2 GiB with rows, 13.7 GiB with
bfloat16 moments; docs/results/bigger_models.md).

A second moment (optax's `nu`, never negative) is stored as its square root: the root
halves its range in octaves, and the update divides by that root anyway. A positive
root below its row's least step is kept at that step, not flushed to zero, so a
gradient far smaller than its row's largest is never divided by zero.

Codes are rounded *stochastically* (up or down with the probabilities that make the
rounding unbiased; `noise` is 32 random bits per element): Adam's `nu` decays by 1e-3 a
step, far below half of e4m3's relative step of 2**-3, so rounding to nearest would keep
every moment as it was. The codes are held as `uint8` bits (`Float8Moment`), which every
store and fingerprint handles as plain bytes.

The rows follow the array a device holds (a ZeRO-1 piece, an FSDP shard), so another
device count quantizes in other rows; a resume re-cut for another layout
decodes to float32 first (`checkpoints.resume`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

BLOCK = 128
E4M3_MAX = 448.0     # the largest finite float8_e4m3fn
_MANTISSA = 3        # e4m3's stored mantissa bits
_MIN_EXPONENT = -6   # e4m3's smallest normal exponent; below it the step is 2**-9
_LEAST = 2.0 ** -9   # e4m3's least positive value
_SMALLEST_SCALED = E4M3_MAX * 2.0 ** -126  # a row scale stays a normal float32


class Float8Moment(NamedTuple):
  """One moment leaf: `codes` uint8 (float8_e4m3fn bits of `moment / scale`, the leaf's
  shape) and `scales` float32, one per row (`_rows`)."""
  codes: jax.Array
  scales: jax.Array


def is_moment(x) -> bool:
  return isinstance(x, Float8Moment)


def _rows(x):
  """`x` as rows whose last axis is a scale's block: the array itself (one scale per
  row of its last axis), or a 1-D array (a ZeRO-1 piece) in rows of `BLOCK` where its
  size allows. No pad and no transpose, so the moments' update stays one fusion."""
  if x.ndim == 1 and x.size % BLOCK == 0 and x.size > BLOCK:
    return x.reshape(-1, BLOCK)
  return x if x.ndim > 1 else x[None]


def _round_e4m3(y, noise):
  """float32 `y` (|y| <= 448) rounded stochastically onto e4m3's grid (float32 values):
  the grid step at `y` is 2**(exponent - 3), 2**-9 among the subnormals."""
  bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
  exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127
  step_exp = jnp.maximum(exponent, _MIN_EXPONENT) - _MANTISSA
  step = jax.lax.bitcast_convert_type(((step_exp + 127) << 23).astype(jnp.uint32),
                                      jnp.float32)
  uniform = (noise >> 8).astype(jnp.float32) * 2.0 ** -24  # [0, 1)
  magnitude = jnp.floor(jnp.abs(y) / step + uniform) * step
  return jnp.sign(y) * jnp.minimum(magnitude, E4M3_MAX)


def encode(x, noise, root: bool = False) -> Float8Moment:
  """float32 `x` as a `Float8Moment`; `noise` uint32 of `x`'s shape draws the rounding;
  `root`: `x` is never negative and its square root is stored."""
  x = x.astype(jnp.float32)
  if root:
    x = jnp.sqrt(jnp.maximum(x, 0.0))
  rows = _rows(x)
  absmax = jnp.max(jnp.abs(rows), axis=-1, keepdims=True)
  # A scale below float32's least normal would be flushed to zero on TPU (0/0 codes are
  # NaN): such a row keeps scale 1, its entries below e4m3's least step.
  scales = jnp.where(absmax > _SMALLEST_SCALED, absmax / E4M3_MAX, 1.0)
  y = (rows / scales).reshape(x.shape)
  if root:  # a positive root kept at least e4m3's least step, never 0: Adam divides by it
    y = jnp.where(y > 0, jnp.maximum(y, _LEAST), y)
  codes = _round_e4m3(y, noise).astype(jnp.float8_e4m3fn)
  return Float8Moment(jax.lax.bitcast_convert_type(codes, jnp.uint8), scales[..., 0])


def decode(m: Float8Moment, root: bool = False):
  """The float32 moment of `m` (`encode`'s inverse, up to its rounding)."""
  codes = jax.lax.bitcast_convert_type(m.codes, jnp.float8_e4m3fn).astype(jnp.float32)
  x = (_rows(codes) * m.scales[..., None]).reshape(codes.shape)
  return x * x if root else x
