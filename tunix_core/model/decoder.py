"""A decoder-only transformer as pure functions over a params pytree.

Token embedding, RMSNorm, rotary position embeddings, grouped-query attention and a
gated MLP, with the per-family options of `ModelConfig` (Llama, Mistral, Qwen2, Qwen3,
Gemma 1/2/3; see `tunix_core.model.config`). Layers are stacked along a leading axis and
run with `lax.scan`; what differs between layers (sliding window or not, Gemma 3's local
rope) travels through the scan as arrays built from the config, not as Python branches.
The forward pass stops at the final norm: it returns hidden states `[B, T, D]` and the LM
head is applied by `tunix_kernels.fused_logprobs`, so no `[B, T, V]` logits exist here (`logits`
builds them, for evaluation and tests only).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from tunix_kernels import attention as attention_lib
from tunix_core.model import config as model_config
from tunix_core.model import layer_stack
from tunix_core.model import quant
from tunix_core.model.rope import apply_rope
from tunix_core.model.rope import layer_settings
from tunix_core.model.rope import rope_frequencies  # noqa: F401 (this module's API)

# The config lives in its own module; these names are part of this module's API.
ModelConfig = model_config.ModelConfig
RematPolicy = model_config.RematPolicy
DTYPES = model_config.DTYPES
ROPE_TYPES = model_config.ROPE_TYPES
MLP_ACTIVATIONS = model_config.MLP_ACTIVATIONS
LAYER_TYPES = model_config.LAYER_TYPES
REMAT_POLICIES = model_config.REMAT_POLICIES
PRESETS = model_config.PRESETS
preset = model_config.preset


def _layer_leaves(cfg: ModelConfig) -> dict:
  """`{per-layer leaf: (shape without [L], PartitionSpec without L given model axis m)}`."""
  D, F = cfg.d_model, cfg.mlp_dim
  q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  leaves = {"attn_norm": ((D,), "norm"), "wq": ((D, q_dim), "col"),
            "wk": ((D, kv_dim), "col"), "wv": ((D, kv_dim), "col"),
            "wo": ((q_dim, D), "row"), "mlp_norm": ((D,), "norm"),
            "w_gate": ((D, F), "col"), "w_up": ((D, F), "col"), "w_down": ((F, D), "row")}
  if cfg.qkv_bias:
    leaves.update(bq=((q_dim,), "bias"), bk=((kv_dim,), "bias"), bv=((kv_dim,), "bias"))
  if cfg.qk_norm:
    leaves.update(q_norm=((cfg.head_dim,), "norm"), k_norm=((cfg.head_dim,), "norm"))
  if cfg.post_norms:
    leaves.update(post_attn_norm=((D,), "norm"), post_mlp_norm=((D,), "norm"))
  return leaves


def init_params(key: jax.Array, cfg: ModelConfig, quantize: str = "") -> dict:
  """Random params: normal(0, 1/sqrt(fan_in)) matrices, zero biases, norm scales that
  multiply by one (1, or 0 under Gemma's `norm_offset=1`).

  Layer weights carry a leading `[L]` axis so the forward can scan over layers. With
  `quantize` (`quant.KINDS`) the layers' projections are drawn and quantized one layer at
  a time (other random values than without), so their float form never exists whole.
  """
  dtype = DTYPES[cfg.param_dtype]
  L, D = cfg.num_layers, cfg.d_model
  leaves = _layer_leaves(cfg)
  keys = iter(jax.random.split(key, len(leaves) + 2))

  def dense(shape, fan_in):
    return (jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)

  def leaf(shape, kind):
    if kind == "norm":
      return jnp.full((L,) + shape, 1.0 - cfg.norm_offset, dtype)
    if kind == "bias":
      return jnp.zeros((L,) + shape, dtype)
    return dense((L,) + shape, shape[0])

  def quantized(shape):
    draw = lambda k: jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(shape[0])
    return jax.lax.map(lambda k: quant.quantize(draw(k), quantize),
                       jax.random.split(next(keys), L))

  params = {"embed": dense((cfg.vocab_size, D), 1.0),
            "layers": {name: quantized(spec[0]) if quantize and name in quant.PROJECTIONS
                       else leaf(*spec) for name, spec in leaves.items()},
            "final_norm": jnp.full((D,), 1.0 - cfg.norm_offset, dtype)}
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
  by_kind = {"norm": P(None, None), "bias": P(None, m), "col": P(None, None, m),
             "row": P(None, m, None)}
  specs = {"embed": P(m, None),
           "layers": {name: by_kind[kind] for name, (_, kind) in _layer_leaves(cfg).items()},
           "final_norm": P(None)}
  if not cfg.tie_embeddings:
    specs["lm_head"] = P(None, m)
  return specs


def lm_head(params: dict, cfg: ModelConfig) -> jax.Array:
  """The `[D, V]` output projection (the transposed embedding when tied)."""
  return params["embed"].T if cfg.tie_embeddings else params["lm_head"]


@jax.named_scope("norm")  # a part of the step profile (benchmarks/step_profile.py)
def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float, offset: float = 0.0
             ) -> jax.Array:
  """RMSNorm in float32, scaled by `offset + scale_D` before the cast back (as Gemma
  and Llama both do in float32)."""
  x = x_BxTxD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return (x * (offset + scale_D.astype(jnp.float32))).astype(x_BxTxD.dtype)


def softcap(x: jax.Array, cap: float) -> jax.Array:
  """`cap * tanh(x / cap)`; the identity for `cap == 0`."""
  return cap * jnp.tanh(x / cap) if cap else x


def project(x_NxI, layer, name: str, cfg: ModelConfig):
  """`x @ layer[name]`, plus `cfg.lora_scale * (x @ A) @ B` when the layer carries a LoRA
  adapter for it (`layer["lora"][name]`, `tunix_core.model.lora`): the one place
  adapters and a quantized base's weights (`quant.matmul`) enter the forward."""
  w = layer[name]
  y_NxO = quant.matmul(x_NxI, w) if quant.is_quantized(w) else x_NxI @ w
  adapter = layer.get("lora", {}).get(name)
  if adapter is None:
    return y_NxO
  a, b = adapter["a"].astype(x_NxI.dtype), adapter["b"].astype(x_NxI.dtype)
  return y_NxO + ((x_NxI @ a) @ b) * jnp.asarray(cfg.lora_scale, y_NxO.dtype)


@jax.named_scope("attention")
def self_attention(x_BxTxD, layer, setting, positions_BxT, mask_BxT, cfg: ModelConfig,
                   segments_BxT=None, branches_BxT=None, band: int | None = None):
  """Causal grouped-query attention; keys where `mask_BxT` is 0 are never attended, nor
  keys `setting["window"]` or more positions back (when it is not 0), nor keys of another
  segment or response branch (`tunix_kernels.attention.Visibility`). On TPU the Pallas kernels
  run it (`cfg.attention_impl`, `tunix_kernels.attention.attention`)."""
  B, T, _ = x_BxTxD.shape
  q_BxTxHxK, k_BxTxVxK, v_BxTxVxK = qkv(x_BxTxD, layer, setting, positions_BxT, cfg)
  vis = attention_lib.Visibility(positions_BxT, mask_BxT, segments_BxT, branches_BxT, band)
  out_BxTxHxK = attention_lib.attention(
      q_BxTxHxK, k_BxTxVxK, v_BxTxVxK, vis, scale=attention_scale(cfg),
      softcap=cfg.attn_softcap, window=setting["window"] if cfg.sliding_window else 0,
      impl=cfg.attention_impl)
  out_NxD = project(out_BxTxHxK.reshape(B * T, -1), layer, "wo", cfg)
  return checkpoint_name(out_NxD, model_config.ATTENTION_OUTPUT).reshape(B, T, -1)


def attention_scale(cfg: ModelConfig) -> float:
  return (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5


def qkv(x_BxTxD, layer, setting, positions_BxT, cfg: ModelConfig):
  """The attention inputs of `x`: queries `[B, T, H, K]`, keys and values `[B, T, KV, K]`,
  with biases, QK norms and rotary embedding applied (shared with the KV cache of
  `tunix_core.model.generate`)."""
  B, T, D = x_BxTxD.shape
  H, KV, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  # Matmuls on `[B * T, D]`: XLA:CPU runs the weight gradients of 3-D dots (two
  # contracting dims) at half the speed of the 2-D ones.
  x_NxD = x_BxTxD.reshape(B * T, D)
  q, k, v = (project(x_NxD, layer, name, cfg) for name in ("wq", "wk", "wv"))
  if cfg.qkv_bias:
    q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
  q, k, v = (checkpoint_name(x, model_config.ATTENTION_PROJECTIONS) for x in (q, k, v))
  q_BxTxHxK, k_BxTxVxK = q.reshape(B, T, H, K), k.reshape(B, T, KV, K)
  v_BxTxVxK = v.reshape(B, T, KV, K)
  if cfg.qk_norm:
    q_BxTxHxK = rms_norm(q_BxTxHxK, layer["q_norm"], cfg.norm_eps, cfg.norm_offset)
    k_BxTxVxK = rms_norm(k_BxTxVxK, layer["k_norm"], cfg.norm_eps, cfg.norm_offset)
  q_BxTxHxK = apply_rope(q_BxTxHxK, positions_BxT, setting["freqs"])
  k_BxTxVxK = apply_rope(k_BxTxVxK, positions_BxT, setting["freqs"])
  return q_BxTxHxK, k_BxTxVxK, v_BxTxVxK


@jax.named_scope("mlp")
def mlp(x_BxTxD, layer, cfg: ModelConfig):
  """The gated MLP, its matmuls on `[B * T, D]` (as in `attention`)."""
  x_NxD = x_BxTxD.reshape(-1, x_BxTxD.shape[-1])
  gate = project(x_NxD, layer, "w_gate", cfg)
  gate = (jax.nn.silu(gate) if cfg.mlp_activation == "silu"
          else jax.nn.gelu(gate, approximate=True))
  out_NxD = project(gate * project(x_NxD, layer, "w_up", cfg), layer, "w_down", cfg)
  return out_NxD.reshape(x_BxTxD.shape[:-1] + (-1,))


@jax.named_scope("embedding")
def embed(params: dict, tokens_BxT: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Token embeddings `[B, T, D]` in the compute dtype; Gemma's sqrt(d_model) factor is
  rounded to the param dtype and applied in it, as `transformers` does."""
  x_BxTxD = params["embed"][tokens_BxT]
  if cfg.embed_scale:
    x_BxTxD = x_BxTxD * jnp.asarray(np.sqrt(np.float32(cfg.d_model)), x_BxTxD.dtype)
  return x_BxTxD.astype(DTYPES[cfg.compute_dtype])


def default_positions(mask_BxT: jax.Array) -> jax.Array:
  """Rope positions of padded rows: the count of real tokens before each position."""
  return jnp.maximum(jnp.cumsum(mask_BxT, axis=-1) - 1, 0)


def forward(params: dict, tokens_BxT: jax.Array, mask_BxT: jax.Array | None,
            cfg: ModelConfig, gather_layer=None, *, positions_BxT=None, segments_BxT=None,
            branches_BxT=None, band: int | None = None) -> jax.Array:
  """Final hidden states `[B, T, D]` in the compute dtype.

  Args:
    params: pytree from `init_params`; differentiable.
    tokens_BxT: int32 token ids.
    mask_BxT: 1 for real tokens, 0 for padding (left or right); None means all real.
      Padding keys are never attended to and positions count real tokens only, so the
      hidden states of real tokens do not depend on how much padding surrounds them.
    cfg: the model config.
    gather_layer: FSDP (`tunix_core.parallel.fsdp`): maps the scanned slice of
      `params["layers"]` (a device's pieces of one layer) to that layer's full params.
      The layer is then rematerialised with a policy that never saves the gathered
      weights (`--remat=none` saves every matmul output instead of everything), so the
      backward gathers it again rather than keeping every layer alive.
    positions_BxT, segments_BxT, branches_BxT, band: packed rows (`tunix_core.data.packing`):
      explicit rope positions (default: counting real tokens), segment ids and response
      branch ids of `tunix_kernels.attention.Visibility`, and its static band.
  """
  return decoder(params, embed(params, tokens_BxT, cfg), mask_BxT, cfg, gather_layer,
                 positions_BxT=positions_BxT, segments_BxT=segments_BxT,
                 branches_BxT=branches_BxT, band=band)


def block(x_BxTxD, layer, attend, cfg: ModelConfig, layer_cfg: ModelConfig | None = None,
          enter=lambda h: h, leave=lambda h: h):
  """One decoder layer around `attend(h) -> (attention output, aux)`: the norms, the
  residuals and the MLP; returns `(x, aux)` (the KV cache's `aux` is its new keys)."""
  eps, offset = cfg.norm_eps, cfg.norm_offset
  h, aux = attend(enter(rms_norm(x_BxTxD, layer["attn_norm"], eps, offset)))
  h = leave(h)
  if cfg.post_norms:
    h = rms_norm(h, layer["post_attn_norm"], eps, offset)
  x_BxTxD = x_BxTxD + h
  h = leave(mlp(enter(rms_norm(x_BxTxD, layer["mlp_norm"], eps, offset)), layer,
                layer_cfg or cfg))
  if cfg.post_norms:
    h = rms_norm(h, layer["post_mlp_norm"], eps, offset)
  return x_BxTxD + h, aux


def decoder(params: dict, x_BxTxD: jax.Array, mask_BxT: jax.Array | None, cfg: ModelConfig,
            gather_layer=None, *, positions_BxT=None, segments_BxT=None, branches_BxT=None,
            band: int | None = None, layer_cfg: ModelConfig | None = None,
            enter=lambda h: h, leave=lambda h: h) -> jax.Array:
  """`forward` after the embedding `x_BxTxD`: the layer scan and the final norm. Tensor
  parallelism (`tunix_core.parallel.tensor_parallel`) passes the shapes of one device's slices as
  `layer_cfg` and the ops around each attention and MLP block: `enter` on its input,
  `leave` on its output; `cfg` stays the global config."""
  if mask_BxT is None:
    mask_BxT = jnp.ones(x_BxTxD.shape[:2], jnp.int32)
  if positions_BxT is None:
    positions_BxT = default_positions(mask_BxT)
  compute, lcfg = DTYPES[cfg.compute_dtype], layer_cfg or cfg
  eps, offset = cfg.norm_eps, cfg.norm_offset

  rows = (positions_BxT, mask_BxT, segments_BxT, branches_BxT)

  def body(x_BxTxD, layer, setting, rows):
    positions_BxT, mask_BxT, segments_BxT, branches_BxT = rows
    layer = quant.cast_floats(layer, compute)  # a quantized base's weights: in `project`
    attend = lambda h: (self_attention(h, layer, setting, positions_BxT, mask_BxT, lcfg,
                                       segments_BxT=segments_BxT, branches_BxT=branches_BxT,
                                       band=band), None)
    return block(x_BxTxD, layer, attend, cfg, lcfg, enter, leave)[0]

  x_BxTxD = layer_stack.scan(body, x_BxTxD, params["layers"], layer_settings(cfg), rows,
                             gather=gather_layer, remat=cfg.remat)
  return rms_norm(x_BxTxD, params["final_norm"], eps, offset)


def logits(params: dict, tokens_BxT: jax.Array, mask_BxT: jax.Array | None,
           cfg: ModelConfig) -> jax.Array:
  """Float32 `[B, T, V]` logits with `final_softcap` applied, for evaluation and tests
  only: training never builds them (`tunix_kernels.fused_logprobs` applies the head and the cap
  per tile). Same arguments as `forward`; differentiable in `params`."""
  hidden_BxTxD = forward(params, tokens_BxT, mask_BxT, cfg)
  head_DxV = lm_head(params, cfg).astype(hidden_BxTxD.dtype)
  return softcap(jnp.einsum("btd,dv->btv", hidden_BxTxD, head_DxV,
                            preferred_element_type=jnp.float32), cfg.final_softcap)
