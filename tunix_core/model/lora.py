"""LoRA adapters on the decoder's projections, named and initialised as PEFT does.

An adapter on a projection `W [in, out]` is `A [in, r]` and `B [r, out]`; the adapted
projection computes `x @ W + scale * ((x @ A) @ B)` with `scale = alpha / r` (rsLoRA:
`alpha / sqrt(r)`), unmerged as PEFT computes it. Adapters live in the params tree next
to what they adapt, `params["layers"]["lora"][name] = {"a": [L, in, r], "b": [L, r, out]}`,
so the layer scan slices them with their layer and `decoder.project` is the one place
they enter the forward. The same tree without "lora" is the frozen base: with LoRA,
DPO's reference is the base with the adapters off (`detach`), and no second copy of the
weights exists.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tunix_core.model.config import ModelConfig

# PEFT's target names (Llama-family module names) -> our layer leaves.
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
# PEFT's module path of each target inside a decoder layer.
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Adapters of one run (hashable).

  Attributes:
    rank: r, the adapters' inner dimension (> 0).
    alpha: the scaling numerator (PEFT's `lora_alpha`).
    targets: PEFT names of the adapted projections, a subset of `TARGETS`.
    rslora: scale by `alpha / sqrt(r)` (rank-stabilised LoRA) instead of `alpha / r`.
  """

  rank: int
  alpha: float
  targets: tuple = tuple(TARGETS)
  rslora: bool = False

  def __post_init__(self):
    if not isinstance(self.rank, int) or self.rank <= 0:
      raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
    if not self.alpha > 0:
      raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or not self.targets:
      raise ValueError(f"unknown LoRA targets {unknown or list(self.targets)}; choose from "
                       f"{list(TARGETS)}")

  @property
  def scale(self) -> float:
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def adapter_shapes(cfg: ModelConfig, lcfg: LoraConfig) -> dict:
  """`{leaf: ((L, in, r), (L, r, out))}` of every adapted projection."""
  D, F, L, r = cfg.d_model, cfg.mlp_dim, cfg.num_layers, lcfg.rank
  q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  dims = {"wq": (D, q_dim), "wk": (D, kv_dim), "wv": (D, kv_dim), "wo": (q_dim, D),
          "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}
  return {TARGETS[t]: ((L, dims[TARGETS[t]][0], r), (L, r, dims[TARGETS[t]][1]))
          for t in lcfg.targets}


def param_specs(lcfg: LoraConfig, model_axis: str | None = None) -> dict:
  """PartitionSpecs with the structure of `init_adapters`: with a tensor-parallel axis,
  each adapter is split the way its projection is (Megatron-style, `decoder.param_specs`):
  B's output columns for a column-parallel projection, A's input rows for a row-parallel
  one (`wo`, `w_down`); the other factor is replicated."""
  row = {"wo", "w_down"}
  return {TARGETS[t]: {"a": P(None, model_axis, None) if TARGETS[t] in row else P(),
                       "b": P() if TARGETS[t] in row else P(None, None, model_axis)}
          for t in lcfg.targets}


def init_adapters(key: jax.Array, cfg: ModelConfig, lcfg: LoraConfig,
                  dtype=jnp.float32) -> dict:
  """Fresh adapters as PEFT initialises them: A from Kaiming-uniform with `a = sqrt(5)`
  (uniform in `+-1/sqrt(in)`), B zero, so the adapted model equals the base exactly."""
  shapes = adapter_shapes(cfg, lcfg)
  keys = jax.random.split(key, len(shapes))
  out = {}
  for k, (name, (a_shape, b_shape)) in zip(keys, sorted(shapes.items())):
    bound = 1.0 / math.sqrt(a_shape[1])
    out[name] = {"a": jax.random.uniform(k, a_shape, jnp.float32, -bound, bound).astype(dtype),
                 "b": jnp.zeros(b_shape, dtype)}
  return out


def attach(base: dict, adapters: dict) -> dict:
  """The adapted params: `base` with `adapters` under `["layers"]["lora"]` (no copy)."""
  return {**base, "layers": {**base["layers"], "lora": adapters}}


def detach(params: dict) -> tuple[dict, dict | None]:
  """`(base, adapters or None)` of adapted params: the inverse of `attach`."""
  layers = dict(params["layers"])
  adapters = layers.pop("lora", None)
  return {**params, "layers": layers}, adapters


def merge(base: dict, adapters: dict, lcfg: LoraConfig) -> dict:
  """Base params with each adapter folded in, `W + scale * A @ B` (float32 product,
  cast back to W's dtype): a plain model for export."""
  layers = dict(base["layers"])
  for name, ab in adapters.items():
    delta = jnp.einsum("lir,lro->lio", ab["a"].astype(jnp.float32),
                       ab["b"].astype(jnp.float32)) * lcfg.scale
    layers[name] = (layers[name].astype(jnp.float32) + delta).astype(layers[name].dtype)
  return {**base, "layers": layers}
