"""A decoder-only, Llama-style transformer as pure functions over a params pytree.

Token embedding, RMSNorm, rotary position embeddings (optionally llama3-scaled),
grouped-query attention (optionally with q/k/v biases, Qwen2, or per-head q/k norms,
Qwen3) and a SwiGLU MLP; layers are stacked along a leading axis and run with
`lax.scan`. The forward pass stops at the final norm: it returns hidden states
`[B, T, D]` and the LM head is applied by `kernels.fused_logprobs`, so no `[B, T, V]`
logits exist here (`logits` builds them, for evaluation and tests only).
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

RematPolicy = Literal["none", "full", "dots", "dots_no_batch"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

ROPE_TYPES = ("default", "llama3")

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of the model. Hashable, so it can be a jit static argument."""

  vocab_size: int = 259
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 384
  rope_theta: float = 10_000.0
  # Rotary frequency scaling: "default" (none) or "llama3" (Llama 3.1+): wavelengths
  # longer than original_max_positions / low_freq_factor are divided by rope_factor,
  # shorter than original_max_positions / high_freq_factor kept, smoothly in between.
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  norm_eps: float = 1e-5
  qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
  qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3)
  # Each query attends to at most this many keys, itself included (Mistral); 0: all.
  # Counted in real tokens (positions), so padding never shrinks the window.
  sliding_window: int = 0
  tie_embeddings: bool = False
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: RematPolicy = "none"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"ModelConfig.{name} must be one of {sorted(DTYPES)}, "
                         f"got {getattr(self, name)!r}")
    if self.sliding_window < 0:
      raise ValueError(f"ModelConfig.sliding_window must be >= 0, got {self.sliding_window}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"ModelConfig.rope_type must be one of {ROPE_TYPES}, "
                       f"got {self.rope_type!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ModelConfig.remat must be one of {sorted(REMAT_POLICIES)}, "
                       f"got {self.remat!r}")


PRESETS = {
    # CPU-sized: trains on the shipped data in minutes on two cores.
    "tiny": ModelConfig(),
    # GPT-3 "small" / Pythia-160m-like shapes with a Llama vocabulary of 32k.
    "125m": ModelConfig(vocab_size=32_000, d_model=768, num_layers=12, num_heads=12,
                        num_kv_heads=12, head_dim=64, mlp_dim=2048, tie_embeddings=True),
    # TinyLlama-1.1B shapes.
    "1b": ModelConfig(vocab_size=32_000, d_model=2048, num_layers=22, num_heads=32,
                      num_kv_heads=4, head_dim=64, mlp_dim=5632),
}


def preset(name: str, **overrides) -> ModelConfig:
  """Returns the named preset, with any fields replaced by `overrides`."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)


def init_params(key: jax.Array, cfg: ModelConfig) -> dict:
  """Random params: normal(0, 1/sqrt(fan_in)) matrices, unit norm scales.

  Layer weights carry a leading `[L]` axis so the forward can scan over layers.
  """
  dtype = DTYPES[cfg.param_dtype]
  L, D, F = cfg.num_layers, cfg.d_model, cfg.mlp_dim
  q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  keys = iter(jax.random.split(key, 9))

  def dense(shape, fan_in):
    return (jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)

  params = {
      "embed": dense((cfg.vocab_size, D), 1.0),
      "layers": {
          "attn_norm": jnp.ones((L, D), dtype),
          "wq": dense((L, D, q_dim), D),
          "wk": dense((L, D, kv_dim), D),
          "wv": dense((L, D, kv_dim), D),
          "wo": dense((L, q_dim, D), q_dim),
          "mlp_norm": jnp.ones((L, D), dtype),
          "w_gate": dense((L, D, F), D),
          "w_up": dense((L, D, F), D),
          "w_down": dense((L, F, D), F),
      },
      "final_norm": jnp.ones((D,), dtype),
  }
  if cfg.qkv_bias:
    params["layers"].update(bq=jnp.zeros((L, q_dim), dtype), bk=jnp.zeros((L, kv_dim), dtype),
                            bv=jnp.zeros((L, kv_dim), dtype))
  if cfg.qk_norm:
    params["layers"].update(q_norm=jnp.ones((L, cfg.head_dim), dtype),
                            k_norm=jnp.ones((L, cfg.head_dim), dtype))
  if not cfg.tie_embeddings:
    params["lm_head"] = dense((D, cfg.vocab_size), D)
  return params


def param_specs(cfg: ModelConfig, model_axis: str | None = None) -> dict:
  """`PartitionSpec`s with the structure of `init_params(key, cfg)`.

  With `model_axis=None` every param is replicated (pure data parallelism). With a
  mesh axis name, attention heads, MLP columns and the vocabulary are split over it
  Megatron-style; norm scales stay replicated.
  """
  m = model_axis
  specs = {
      "embed": P(m, None),
      "layers": {
          "attn_norm": P(None, None),
          "wq": P(None, None, m),
          "wk": P(None, None, m),
          "wv": P(None, None, m),
          "wo": P(None, m, None),
          "mlp_norm": P(None, None),
          "w_gate": P(None, None, m),
          "w_up": P(None, None, m),
          "w_down": P(None, m, None),
      },
      "final_norm": P(None),
  }
  if cfg.qkv_bias:
    specs["layers"].update(bq=P(None, m), bk=P(None, m), bv=P(None, m))
  if cfg.qk_norm:
    specs["layers"].update(q_norm=P(None, None), k_norm=P(None, None))
  if not cfg.tie_embeddings:
    specs["lm_head"] = P(None, m)
  return specs


def lm_head(params: dict, cfg: ModelConfig) -> jax.Array:
  """The `[D, V]` output projection (the transposed embedding when tied)."""
  return params["embed"].T if cfg.tie_embeddings else params["lm_head"]


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  x = x_BxTxD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return (x * scale_D.astype(jnp.float32)).astype(x_BxTxD.dtype)


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
  """Float32 `[head_dim / 2]` rotary frequencies, with `cfg.rope_type`'s scaling."""
  half = cfg.head_dim // 2
  freqs_K = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if cfg.rope_type == "llama3":
    wavelen_K = 2 * jnp.pi / freqs_K
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    orig = cfg.rope_original_max_positions
    smooth_K = (orig / wavelen_K - low) / (high - low)
    blended_K = (1 - smooth_K) * freqs_K / cfg.rope_factor + smooth_K * freqs_K
    freqs_K = jnp.where(wavelen_K > orig / low, freqs_K / cfg.rope_factor,
                        jnp.where(wavelen_K < orig / high, freqs_K, blended_K))
  return freqs_K


def apply_rope(x_BxTxHxK: jax.Array, positions_BxT: jax.Array, freqs_K: jax.Array
               ) -> jax.Array:
  """Rotary embedding on the last axis, rotating its two halves against each other."""
  angles_BxTxK = positions_BxT[..., None].astype(jnp.float32) * freqs_K
  sin, cos = jnp.sin(angles_BxTxK)[:, :, None, :], jnp.cos(angles_BxTxK)[:, :, None, :]
  x1, x2 = jnp.split(x_BxTxHxK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxK.dtype)


def attention(x_BxTxD, layer, positions_BxT, mask_BxT, cfg: ModelConfig):
  """Causal grouped-query attention; keys where `mask_BxT` is 0 are never attended."""
  B, T, _ = x_BxTxD.shape
  H, KV, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  G = H // KV
  q, k, v = x_BxTxD @ layer["wq"], x_BxTxD @ layer["wk"], x_BxTxD @ layer["wv"]
  if cfg.qkv_bias:
    q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
  q_BxTxHxK, k_BxTxVxK = q.reshape(B, T, H, K), k.reshape(B, T, KV, K)
  v_BxTxVxK = v.reshape(B, T, KV, K)
  if cfg.qk_norm:
    q_BxTxHxK = rms_norm(q_BxTxHxK, layer["q_norm"], cfg.norm_eps)
    k_BxTxVxK = rms_norm(k_BxTxVxK, layer["k_norm"], cfg.norm_eps)
  q_BxTxHxK = apply_rope(q_BxTxHxK, positions_BxT, rope_frequencies(cfg))
  k_BxTxVxK = apply_rope(k_BxTxVxK, positions_BxT, rope_frequencies(cfg))
  q_BxTxVxGxK = q_BxTxHxK.reshape(B, T, KV, G, K)
  scores_BxVxGxTxS = jnp.einsum("btvgk,bsvk->bvgts", q_BxTxVxGxK, k_BxTxVxK,
                                preferred_element_type=jnp.float32) / jnp.sqrt(K)
  causal_TxS = jnp.tril(jnp.ones((T, T), dtype=bool))
  allowed_BxTxS = causal_TxS[None] & (mask_BxT[:, None, :] > 0)
  if cfg.sliding_window:
    distance_BxTxS = positions_BxT[:, :, None] - positions_BxT[:, None, :]
    allowed_BxTxS &= distance_BxTxS < cfg.sliding_window
  # A finite fill keeps fully masked rows (padding queries) free of NaN.
  scores_BxVxGxTxS = jnp.where(allowed_BxTxS[:, None, None], scores_BxVxGxTxS, -1e30)
  probs = jax.nn.softmax(scores_BxVxGxTxS, axis=-1).astype(x_BxTxD.dtype)
  out_BxTxVxGxK = jnp.einsum("bvgts,bsvk->btvgk", probs, v_BxTxVxK)
  return out_BxTxVxGxK.reshape(B, T, H * K) @ layer["wo"]


def mlp(x_BxTxD, layer):
  return (jax.nn.silu(x_BxTxD @ layer["w_gate"]) * (x_BxTxD @ layer["w_up"])) @ layer["w_down"]


def forward(params: dict, tokens_BxT: jax.Array, mask_BxT: jax.Array | None,
            cfg: ModelConfig) -> jax.Array:
  """Final hidden states `[B, T, D]` in the compute dtype.

  Args:
    params: pytree from `init_params`; differentiable.
    tokens_BxT: int32 token ids.
    mask_BxT: 1 for real tokens, 0 for padding (left or right); None means all real.
      Padding keys are never attended to and positions count real tokens only, so the
      hidden states of real tokens do not depend on how much padding surrounds them.
    cfg: the model config.
  """
  if mask_BxT is None:
    mask_BxT = jnp.ones(tokens_BxT.shape, jnp.int32)
  compute = DTYPES[cfg.compute_dtype]
  positions_BxT = jnp.maximum(jnp.cumsum(mask_BxT, axis=-1) - 1, 0)
  x_BxTxD = params["embed"].astype(compute)[tokens_BxT]

  def layer_fn(x_BxTxD, layer):
    layer = jax.tree.map(lambda w: w.astype(compute), layer)
    h = rms_norm(x_BxTxD, layer["attn_norm"], cfg.norm_eps)
    x_BxTxD = x_BxTxD + attention(h, layer, positions_BxT, mask_BxT, cfg)
    h = rms_norm(x_BxTxD, layer["mlp_norm"], cfg.norm_eps)
    return x_BxTxD + mlp(h, layer), None

  if cfg.remat != "none":
    layer_fn = jax.checkpoint(layer_fn, policy=REMAT_POLICIES[cfg.remat])
  x_BxTxD, _ = jax.lax.scan(layer_fn, x_BxTxD, params["layers"])
  return rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps)


def logits(params: dict, tokens_BxT: jax.Array, mask_BxT: jax.Array | None,
           cfg: ModelConfig) -> jax.Array:
  """Float32 `[B, T, V]` logits, for evaluation and tests only: training never builds
  them (`kernels.fused_logprobs` applies the head per tile). Same arguments as
  `forward`; differentiable in `params`."""
  hidden_BxTxD = forward(params, tokens_BxT, mask_BxT, cfg)
  head_DxV = lm_head(params, cfg).astype(hidden_BxTxD.dtype)
  return jnp.einsum("btd,dv->btv", hidden_BxTxD, head_DxV, preferred_element_type=jnp.float32)
