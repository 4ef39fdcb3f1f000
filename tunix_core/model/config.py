"""`ModelConfig`: the shapes and numerics of every model family `tunix_core.model` runs.

The defaults are a Llama-style model; each family's differences are fields with
defaults that leave the others unchanged (`tunix_core.hf` reads them from `config.json`):

| family      | fields                                                                  |
|-------------|-------------------------------------------------------------------------|
| Llama 3.x   | `rope_type="llama3"` + `rope_*`, `head_dim`, `tie_embeddings`            |
| Mistral     | `sliding_window` (every layer)                                          |
| Qwen2       | `qkv_bias`                                                              |
| Qwen3       | `qk_norm`                                                               |
| Gemma       | `norm_offset=1`, `embed_scale`, `mlp_activation="gelu_tanh"`             |
| Gemma 2     | + `post_norms`, `query_pre_attn_scalar`, `attn_softcap`, `final_softcap`, |
|             | `layer_types` (which layers slide over `sliding_window`)                  |
| Gemma 3     | + `qk_norm`, `rope_local_theta`, `rope_type="linear"` on global layers    |
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

import tunix_kernels
from tunix_kernels import attention as attention_lib

RematPolicy = Literal["none", "full", "full_prefetch", "dots", "dots_no_batch", "attention",
                      "offload"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

ROPE_TYPES = ("default", "linear", "llama3")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")

# Names (`jax.ad_checkpoint.checkpoint_name`) of the attention block's q/k/v projections
# (with their biases) and its output projection, which `--remat=attention` keeps.
ATTENTION_PROJECTIONS, ATTENTION_OUTPUT = "attention_projections", "attention_output"
_ATTENTION = jax.checkpoint_policies.save_only_these_names(attention_lib.RESIDUALS,
                                                          attention_lib.INPUTS)
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # "full", and under FSDP the backward gathers the layer before and reduce-scatters the
    # layer after while it computes (`tunix_core.model.layer_stack.remat_scan`): its
    # transfers hidden for one more layer of gathered weights and gradients in memory.
    "full_prefetch": jax.checkpoint_policies.nothing_saveable,
    # The matmul outputs and attention's out and log-sum-exp (not dots: the kernels' own
    # outputs), so the backward does not run attention's forward again, and the kernels'
    # q, k and v, so it does not run the rope and the layouts before them again.
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots, _ATTENTION),
    "dots_no_batch": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims, _ATTENTION),
    # What attention's backward needs (the kernels' q, k and v as they take them, else the
    # projections they come from; the kernels' out and log-sum-exp) and the block's
    # output; the norms and the MLP run again: its [T, F] activations, the largest of a
    # layer, are not kept. Between dots and full in memory and time.
    "attention": jax.checkpoint_policies.save_only_these_names(
        attention_lib.RESIDUALS, attention_lib.INPUTS, ATTENTION_PROJECTIONS,
        ATTENTION_OUTPUT),
    # The layer's matmul outputs (our projections are 2-D dots) go to pinned host memory
    # in the forward and come back for the backward: neither held in HBM nor recomputed.
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device",
                                                                     "pinned_host"),
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
  # Rotary frequency scaling (of the global layers): "default" (none), "linear"
  # (frequencies divided by rope_factor) or "llama3" (Llama 3.1+): wavelengths longer
  # than original_max_positions / low_freq_factor are divided by rope_factor, shorter
  # than original_max_positions / high_freq_factor kept, smoothly in between.
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  # Unscaled rope theta of the sliding-window layers when `layer_types` names them
  # (Gemma 3's local layers); 0: rope_theta and rope_type as the global layers.
  rope_local_theta: float = 0.0
  norm_eps: float = 1e-5
  # RMSNorm scales by (norm_offset + weight): Gemma stores weights centred on 0 (offset 1).
  norm_offset: float = 0.0
  embed_scale: bool = False  # embeddings times sqrt(d_model), rounded to param_dtype (Gemma)
  mlp_activation: str = "silu"  # of the gated MLP: SwiGLU (silu) or GeGLU (gelu_tanh, Gemma)
  post_norms: bool = False  # RMSNorm of the attention and MLP outputs too (Gemma 2, 3)
  # Scores are scaled by query_pre_attn_scalar ** -0.5; 0: head_dim (Gemma 2, 3 set it).
  query_pre_attn_scalar: float = 0.0
  attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before masking; 0: none
  final_softcap: float = 0.0  # the same on the output logits (Gemma 2)
  qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
  qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3)
  # Each query attends to at most this many keys, itself included; 0: all. Counted in
  # real tokens (positions), so padding never shrinks the window.
  sliding_window: int = 0
  # Per layer, "full_attention" or "sliding_attention"; empty: every layer slides when
  # sliding_window is set (Mistral).
  layer_types: tuple[str, ...] = ()
  tie_embeddings: bool = False
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  remat: RematPolicy = "none"
  # `tunix_kernels.attention.attention`'s impl: "auto" runs the Pallas kernels when compiled
  # for TPU and "xla" (scores materialised) elsewhere.
  attention_impl: str = "auto"
  # The scale of LoRA adapters the params may carry (`tunix_core.model.lora`): alpha / r.
  lora_scale: float = 1.0

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
    for name, choices in (("param_dtype", tuple(DTYPES)), ("compute_dtype", tuple(DTYPES)),
                          ("rope_type", ROPE_TYPES), ("mlp_activation", MLP_ACTIVATIONS),
                          ("remat", tuple(REMAT_POLICIES)),
                          ("attention_impl", tunix_kernels.IMPLS)):
      if getattr(self, name) not in choices:
        raise ValueError(f"ModelConfig.{name} must be one of {choices}, "
                         f"got {getattr(self, name)!r}")
    for name in ("sliding_window", "attn_softcap", "final_softcap", "query_pre_attn_scalar",
                 "rope_local_theta"):
      if getattr(self, name) < 0:
        raise ValueError(f"ModelConfig.{name} must be >= 0, got {getattr(self, name)}")
    if self.layer_types:
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                         f"{self.num_layers} layers")
      if set(self.layer_types) - set(LAYER_TYPES):
        raise ValueError(f"ModelConfig.layer_types must hold only {LAYER_TYPES}")
    if isinstance(self.layer_types, list):  # keep the config hashable
      object.__setattr__(self, "layer_types", tuple(self.layer_types))

  def sliding_layers(self) -> tuple[bool, ...]:
    """Per layer, whether it attends within `sliding_window` only."""
    if not self.sliding_window:
      return (False,) * self.num_layers
    if not self.layer_types:
      return (True,) * self.num_layers
    return tuple(t == "sliding_attention" for t in self.layer_types)


PRESETS = {
    # CPU-sized: trains on the shipped data in minutes on two cores.
    "tiny": ModelConfig(),
    # The tiny model with a vocabulary that splits 2 and 4 ways (--model_parallel tests).
    "tiny_tp": ModelConfig(vocab_size=260),
    # GPT-3 "small" / Pythia-160m-like shapes with a Llama vocabulary of 32k.
    "125m": ModelConfig(vocab_size=32_000, d_model=768, num_layers=12, num_heads=12,
                        num_kv_heads=12, head_dim=64, mlp_dim=2048, tie_embeddings=True),
    # TinyLlama-1.1B shapes.
    "1b": ModelConfig(vocab_size=32_000, d_model=2048, num_layers=22, num_heads=32,
                      num_kv_heads=4, head_dim=64, mlp_dim=5632),
    # Llama-2-7B shapes.
    "7b": ModelConfig(vocab_size=32_000, d_model=4096, num_layers=32, num_heads=32,
                      num_kv_heads=32, head_dim=128, mlp_dim=11_008),
    # Llama-3-8B shapes (GQA, 128k vocabulary, Llama 3.1 rope scaling).
    "8b": ModelConfig(vocab_size=128_256, d_model=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, mlp_dim=14_336, rope_theta=500_000.0,
                      rope_type="llama3", rope_factor=8.0),
    # Llama-3-70B shapes (the same family at 80 layers of width 8192).
    "70b": ModelConfig(vocab_size=128_256, d_model=8192, num_layers=80, num_heads=64,
                       num_kv_heads=8, head_dim=128, mlp_dim=28_672, rope_theta=500_000.0,
                       rope_type="llama3", rope_factor=8.0),
}


def preset(name: str, **overrides) -> ModelConfig:
  """Returns the named preset, with any fields replaced by `overrides`."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)
