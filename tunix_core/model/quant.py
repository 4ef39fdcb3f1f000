"""Quantized frozen weights (QLoRA's base, `--quantize_base`): int8, int4 and nf4.

Only the decoder layers' seven projections are quantized (`PROJECTIONS`); the embedding,
the LM head (which the fused log-prob kernel reads), the norms and the biases keep
their dtype. A quantized projection `W [..., in, out]` becomes a dict in its place,
named by its kind, so the tree says how to read it and no config travels with it. Every
kind works on groups of `GROUP` = 32 input rows of one output column, with float32
scales `[..., in/32, out]`:

- `{"int8": int8 [..., in, out], "scale", "zero"}`: affine (min-max) 8-bit codes,
  `w = zero + scale * (code + 128)`;
- `{"int4": int8 [..., in/2, out], "scale", "zero"}`: affine 4-bit codes 0..15, two to
  a byte;
- `{"nf4": int8 [..., in/2, out], "scale"}`: QLoRA's NormalFloat4 levels (`NF4`) times
  the group's absmax, the index of the nearest level stored, two to a byte.

Why these: on SmolLM2-135M-Instruct (the recipe's model) the mean per-token log-prob
change from the bfloat16 weights was 0.024 for per-channel symmetric int8, 0.019 for
symmetric int8 in groups of 64, 0.42 for symmetric int4 in groups of 64, and 0.003 for
affine int8 or int4 in groups of 32 with float32 scales (docs/training.md#qlora): a
group of 32 is llama.cpp's block, so a model that came through a GGUF file keeps its
grid. The scales cost 1/4 byte a weight (int4: 0.75 bytes a weight in all).

4-bit values are packed within their group: row `j` of a group's 16 packed rows holds
input row `j` in its low nibble and row `16 + j` in its high one, so any cut of the
packed rows at group boundaries (FSDP's, a split of `in`) is a cut of the weight's rows.
Leading axes (the layer stack `[L]`) pass through, so a layer sliced by the scan, or
gathered by FSDP in this form, dequantizes as it is, in its matmul (`matmul`, which
`model.decoder.project` calls: the float weight exists one matmul at a time).
"""

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("int8", "int4", "nf4")
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
GROUP = 32
# NormalFloat4 (Dettmers et al. 2023, QLoRA, appendix E): the quantiles of N(0, 1)
# normalised to [-1, 1], with an exact zero.
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)
_SCALES = ("scale", "zero")


def is_quantized(x) -> bool:
  return isinstance(x, dict) and "scale" in x


def keeps_dtype(path) -> bool:
  """Whether the leaf at `path` (a `jax.tree_util` key path) is a quantized weight's
  scale or zero point: float32 wherever the base is cast (to --ref_dtype, to the
  compute dtype for FSDP's gather), as the codes keep theirs."""
  return bool(path) and getattr(path[-1], "key", None) in _SCALES


def cast_floats(tree, dtype):
  """`tree` with its floating leaves in `dtype`, but quantized weights' codes, scales
  and zero points as they are."""
  keep = lambda path, x: keeps_dtype(path) or not jnp.issubdtype(x.dtype, jnp.floating)

  def cast(x):  # arrays, or the ShapeDtypeStructs of abstract trees
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return x.astype(dtype)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if keep(path, x) else cast(x), tree)


def kind_of(x) -> str:
  return next(k for k in x if k not in _SCALES)


def check_shape(shape, kind: str) -> str | None:
  """Why a `[..., in, out]` weight cannot be quantized as `kind`, or None."""
  if kind not in KINDS:
    return f"unknown quantization {kind!r}; choose one of {KINDS}"
  if shape[-2] % GROUP:
    return f"{kind} needs input dimensions divisible by {GROUP}, got {shape[-2]}"
  return None


def _pack(codes, shape):
  """Codes 0..15 `[..., in, out]` -> int8 `[..., in/2, out]`, two to a byte per group."""
  *lead, n_in, n_out = shape
  g = codes.reshape(*lead, n_in // GROUP, 2, GROUP // 2, n_out)
  return (g[..., 0, :, :] | (g[..., 1, :, :] << 4)).astype(jnp.uint8).astype(
      jnp.int8).reshape(*lead, n_in // 2, n_out)


def _unpack(packed):
  """Inverse of `_pack`: `[..., in/2, out]` -> `[..., in/32, 32, out]` int32 codes."""
  *lead, half, n_out = packed.shape
  g = packed.reshape(*lead, half // (GROUP // 2), GROUP // 2, n_out).astype(jnp.int32)
  return jnp.concatenate([g & 0xF, (g >> 4) & 0xF], axis=-2)


def quantize(w, kind: str) -> dict:
  """`w [..., in, out]` (any float dtype) -> the quantized dict of `kind` (module
  docstring), computed in float32."""
  why = check_shape(w.shape, kind)
  if why:
    raise ValueError(why)
  *lead, n_in, n_out = w.shape
  g = w.astype(jnp.float32).reshape(*lead, n_in // GROUP, GROUP, n_out)
  if kind == "nf4":
    scale = jnp.max(jnp.abs(g), axis=-2)
    unit = g / jnp.where(scale == 0, 1, scale)[..., None, :]
    mids = jnp.asarray((NF4[1:] + NF4[:-1]) / 2)  # the nearest level: midpoints below
    codes = jnp.sum(unit[..., None] > mids, axis=-1).astype(jnp.int8).reshape(w.shape)
    return {kind: _pack(codes, w.shape), "scale": scale}
  top = 255 if kind == "int8" else 15
  zero, high = jnp.min(g, axis=-2), jnp.max(g, axis=-2)
  scale = (high - zero) / top
  codes = jnp.clip(jnp.round((g - zero[..., None, :]) /
                             jnp.where(scale == 0, 1, scale)[..., None, :]), 0, top)
  codes = codes.astype(jnp.int32).reshape(w.shape)
  packed = (codes - 128).astype(jnp.int8) if kind == "int8" else _pack(codes, w.shape)
  return {kind: packed, "scale": scale, "zero": zero}


def dequantize(q: dict, dtype=jnp.float32):
  """The `[..., in, out]` weight of a quantized dict, in `dtype` (computed in float32)."""
  kind = kind_of(q)
  if kind == "int8":
    *lead, n_in, n_out = q[kind].shape
    codes = q[kind].reshape(*lead, n_in // GROUP, GROUP, n_out).astype(jnp.float32) + 128
  else:
    codes = _unpack(q[kind])
  if kind == "nf4":
    w = jnp.take(jnp.asarray(NF4), codes.astype(jnp.int32)) * q["scale"][..., None, :]
  else:
    w = q["zero"][..., None, :] + codes.astype(jnp.float32) * q["scale"][..., None, :]
  *lead, groups, group, n_out = w.shape
  return w.reshape(*lead, groups * group, n_out).astype(dtype)


def quantize_layers(params: dict, kind: str) -> dict:
  """A params tree with its layers' projections quantized as `kind` (the rest as it
  is); jit-able, one leaf's float32 copy at a time."""
  layers = {k: quantize(v, kind) if k in PROJECTIONS else v
            for k, v in params["layers"].items()}
  return {**params, "layers": layers}


@jax.checkpoint
def matmul(x_NxI, q: dict):
  """`x @ W` of a quantized `W`, dequantized to `x`'s dtype inside a checkpoint: the
  backward keeps `x` and the codes and dequantizes again, so no float copy of any
  layer's weights outlives its matmul (a remat policy that saves matmul inputs would
  otherwise keep every layer's)."""
  return x_NxI @ dequantize(q, x_NxI.dtype)


def dequantize_params(params: dict, dtype=jnp.bfloat16) -> dict:
  """A params tree with its quantized weights dequantized to `dtype`: the merged
  export, the base as a plain model."""
  return jax.tree.map(lambda x: dequantize(x, dtype) if is_quantized(x) else x,
                      params, is_leaf=is_quantized)


def quantized_shapes(param_shapes: dict, kind: str) -> dict:
  """ShapeDtypeStructs of `quantize_layers` of a params tree of `param_shapes`."""
  return jax.eval_shape(lambda p: quantize_layers(p, kind), param_shapes)


def quantized_specs(specs: dict, kind: str) -> dict:
  """PartitionSpecs of the quantized tree from the float tree's: the codes and the
  scales keep their weight's (the scales' `in` axis is the groups)."""
  spec = lambda s: {kind: s, **{name: s for name in _SCALES[:1 if kind == "nf4" else 2]}}
  layers = {k: spec(v) if k in PROJECTIONS else v for k, v in specs["layers"].items()}
  return {**specs, "layers": layers}
