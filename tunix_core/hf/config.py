"""Hugging Face `config.json` <-> `ModelConfig`, in both dialects.

transformers 4 writes `rope_theta` + `rope_scaling` + `torch_dtype`; transformers 5 writes
`rope_parameters` (for Gemma 3 nested per layer type) + `dtype`. Both read to the same
`ModelConfig`; anything a `ModelConfig` cannot represent exactly (an unknown
`model_type`, rope type, activation or flag) is a named `HFError`.
"""

import json

from tunix_core.model import config as mc
from tunix_core.storage import paths

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gemma3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
GEMMA = ("gemma", "gemma2", "gemma3_text")
# What transformers assumes when a Gemma 2 / 3 config leaves a key out.
DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                        rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, sliding_window_pattern=6),
}
GELU_TANH = ("gelu_pytorch_tanh", "gelu")  # Gemma 1's "gelu" means the tanh form


class HFError(ValueError):
  """A Hugging Face directory or config this module cannot read exactly."""


def _rope_type(params: dict, what: str) -> dict:
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in mc.ROPE_TYPES:
    raise HFError(f"{what}rope type {rope_type!r} is not supported; "
                  f"supported: {mc.ROPE_TYPES}")
  fields = dict(rope_type=rope_type)
  if rope_type == "linear":
    fields.update(rope_factor=float(params["factor"]))
  elif rope_type == "llama3":
    fields.update(rope_factor=float(params["factor"]),
                  rope_low_freq_factor=float(params["low_freq_factor"]),
                  rope_high_freq_factor=float(params["high_freq_factor"]),
                  rope_original_max_positions=int(params["original_max_position_embeddings"]))
  return fields


def _rope(config: dict, default_theta: float) -> dict:
  """Rope fields of `ModelConfig` from either dialect."""
  params = config.get("rope_parameters")
  local = None
  if params is None:
    params = dict(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", default_theta))
    local = config.get("rope_local_base_freq")
  if "full_attention" in params or "sliding_attention" in params:  # per layer type
    sliding = params.get("sliding_attention") or {}
    params = params.get("full_attention") or {}
    if sliding:
      if sliding.get("rope_type", "default") != "default":
        raise HFError("a scaled rope on sliding-window layers is not supported")
      local = sliding.get("rope_theta")
  fields = dict(rope_theta=float(params.get("rope_theta", default_theta)),
                **_rope_type(params, ""))
  if local is not None:
    fields["rope_local_theta"] = float(local)
  return fields


def _layer_types(config: dict, family: str, n: int) -> tuple:
  if config.get("layer_types"):
    return tuple(config["layer_types"])
  if family == "gemma2":  # transformers' default: even layers slide, odd are global
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n))
  pattern = config["sliding_window_pattern"]
  return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
               for i in range(n))


def _checks(config: dict, family: str) -> list:
  checks = [("mlp_bias", False)]
  if family.startswith("qwen"):
    # Qwen configs carry a sliding_window that only applies with use_sliding_window.
    checks.append(("use_sliding_window", False))
  elif family == "llama":
    checks.append(("sliding_window", None))
  if family != "qwen2":  # Qwen2 always has q/k/v biases and no attention_bias key
    checks.append(("attention_bias", False))
  if family in ("gemma2", "gemma3_text"):
    checks.append(("use_bidirectional_attention", False))
  return checks


def model_config(config: dict, **overrides) -> mc.ModelConfig:
  """The `ModelConfig` of a parsed `config.json` (see `read_config`)."""
  family = config.get("model_type")
  if family == "gemma3":  # the multimodal wrapper: its text part
    config, family = {"model_type": "gemma3_text", **config.get("text_config", {})}, "gemma3_text"
  if family not in FAMILIES:
    raise HFError(f"model_type {family!r} is not supported; supported: {FAMILIES}")
  config = {**DEFAULTS.get(family, {}), **config}
  for key, want in _checks(config, family):
    if config.get(key) is not None and config[key] != want:
      raise HFError(f"{family} config has {key}={config[key]!r}; only {want!r} is supported")
  act_key = "hidden_activation" if config.get("hidden_activation") else "hidden_act"
  act, want = config.get(act_key, "silu"), GELU_TANH if family in GEMMA else ("silu",)
  if act not in want:
    raise HFError(f"{family} config has {act_key}={act!r}; only {want[0]!r} is supported")
  heads, n = config["num_attention_heads"], config["num_hidden_layers"]
  gemma = family in GEMMA
  fields = dict(
      vocab_size=config["vocab_size"], d_model=config["hidden_size"], num_layers=n,
      num_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
      head_dim=config.get("head_dim") or config["hidden_size"] // heads,
      mlp_dim=config["intermediate_size"], norm_eps=float(config.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(config.get("tie_word_embeddings", gemma)),
      qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "gemma3_text"),
      **_rope(config, 1_000_000.0 if family == "gemma3_text" else 10_000.0))
  if family == "mistral":
    fields.update(sliding_window=config.get("sliding_window") or 0)
  if gemma:
    fields.update(norm_offset=1.0, embed_scale=True, mlp_activation="gelu_tanh")
  if family in ("gemma2", "gemma3_text"):
    fields.update(post_norms=True, query_pre_attn_scalar=float(config["query_pre_attn_scalar"]),
                  final_softcap=float(config.get("final_logit_softcapping") or 0.0),
                  sliding_window=config.get("sliding_window") or 0,
                  layer_types=_layer_types(config, family, n))
  if family == "gemma2":  # Gemma 3's attention ignores attn_logit_softcapping
    fields.update(attn_softcap=float(config.get("attn_logit_softcapping") or 0.0))
  fields.update(overrides)
  try:
    return mc.ModelConfig(**fields)
  except ValueError as e:
    raise HFError(f"{family} config: {e}") from None


def read_config(model_dir: str, **overrides) -> mc.ModelConfig:
  """The `ModelConfig` of an HF model directory (its `config.json`); `overrides` replace
  fields (e.g. `param_dtype`, `compute_dtype`, `remat`). Raises `HFError` naming what it
  cannot represent exactly."""
  path = paths.join(model_dir, "config.json")
  if not paths.isfile(path):
    raise HFError(f"{model_dir} is not a Hugging Face model directory: no config.json")
  try:
    config = json.loads(paths.read_text(path))
  except json.JSONDecodeError as e:
    raise HFError(f"{path}: not JSON ({e.msg})") from None
  return model_config(config, **overrides)


def family_of(cfg: mc.ModelConfig) -> str:
  """The HF `model_type` that computes what `cfg` does."""
  if cfg.norm_offset:
    return ("gemma3_text" if cfg.qk_norm else "gemma2" if cfg.post_norms else "gemma")
  return ("qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else
          "mistral" if cfg.sliding_window else "llama")


def hf_config(cfg: mc.ModelConfig, dtype: str) -> dict:
  """A transformers-4-dialect `config.json` dict for `cfg`, stored as `dtype`."""
  family = family_of(cfg)
  rope = None
  if cfg.rope_type == "linear":
    rope = dict(rope_type="linear", factor=cfg.rope_factor)
  elif cfg.rope_type == "llama3":
    rope = dict(rope_type="llama3", factor=cfg.rope_factor,
                low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_positions)
  config = dict(
      architectures=[ARCHITECTURES[family]], model_type=family, vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim,
      rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=rope,
      tie_word_embeddings=cfg.tie_embeddings, torch_dtype=dtype)
  config["hidden_activation" if family in ("gemma2", "gemma3_text") else "hidden_act"] = (
      "gelu_pytorch_tanh" if family in GEMMA else "silu")
  if family != "qwen2":
    config.update(attention_bias=False, mlp_bias=False)
  if family == "mistral":
    config.update(sliding_window=cfg.sliding_window)
  if family in ("gemma2", "gemma3_text"):
    scalar = cfg.query_pre_attn_scalar  # transformers insists on an int where it is one
    config.update(query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar,
                  final_logit_softcapping=cfg.final_softcap or None,
                  sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types))
  if family == "gemma2":
    config.update(attn_logit_softcapping=cfg.attn_softcap or None)
  if family == "gemma3_text":
    config.update(rope_local_base_freq=cfg.rope_local_theta or cfg.rope_theta)
  return config


def merged_config(src: dict, ours: dict) -> dict:
  """The source `config.json` with our fields, in the source's dialect (transformers 5
  writes `rope_parameters` and `dtype`; the rope settings themselves never change). A
  multimodal Gemma 3 source exports as its text model."""
  if src.get("model_type") == "gemma3":
    return ours
  ours = {k: v for k, v in ours.items() if k != "architectures"}
  if "rope_parameters" in src:
    ours = {k: v for k, v in ours.items()
            if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq")}
  if "dtype" in src:
    ours["dtype"] = ours.pop("torch_dtype")
  return {**src, **ours}
