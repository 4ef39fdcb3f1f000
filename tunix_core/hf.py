"""Hugging Face checkpoints in and out: `config.json` to `ModelConfig`, safetensors to the
params pytree and back.

This round covers `model_type` "llama" (Llama 2, 3 and 3.x with explicit `head_dim`,
`llama3` rope scaling and tied embeddings), "mistral" (sliding-window attention), "qwen2"
(q/k/v biases) and "qwen3" (per-head q/k norms). Anything else in a config is a named `HFError`, never a silent
approximation. `safetensors` is imported lazily (the `hf` extra).

Layouts: HF `Linear` weights are `[out, in]`; ours are `[in, out]` with layers stacked on
a leading `[L]` axis, so every projection is transposed on the way in and out.
"""

import json
import os

import numpy as np

from tunix_core import hf_tokenizer
from tunix_core import model as model_lib

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "llama3")
PREFIX = "model."
# Our per-layer leaf -> (HF name under `model.layers.{i}.`, transposed).
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
# Present only when the config asks for them.
BIAS_TENSORS = {"bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
                "bv": ("self_attn.v_proj.bias", False)}
QK_NORM_TENSORS = {"q_norm": ("self_attn.q_norm.weight", False),
                   "k_norm": ("self_attn.k_norm.weight", False)}
SHARD_BYTES = 5 << 30  # `save_params` splits files above this, as `transformers` does


class HFError(ValueError):
  """A Hugging Face directory or config this module cannot read exactly."""


def _rope(config: dict) -> dict:
  """Rope fields of `ModelConfig` from either dialect: `rope_theta` + `rope_scaling`
  (transformers 4) or `rope_parameters` (transformers 5)."""
  params = config.get("rope_parameters")
  if params is None:
    params = dict(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10_000.0))
  if "full_attention" in params:  # transformers 5, nested per layer type
    params = params["full_attention"]
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise HFError(f"rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
  fields = dict(rope_theta=float(params.get("rope_theta", 10_000.0)), rope_type=rope_type)
  if rope_type == "llama3":
    fields.update(rope_factor=float(params["factor"]),
                  rope_low_freq_factor=float(params["low_freq_factor"]),
                  rope_high_freq_factor=float(params["high_freq_factor"]),
                  rope_original_max_positions=int(params["original_max_position_embeddings"]))
  return fields


def read_config(model_dir: str, **overrides) -> model_lib.ModelConfig:
  """The `ModelConfig` of an HF model directory (its `config.json`); `overrides` replace
  fields (e.g. `param_dtype`, `compute_dtype`, `remat`). Raises `HFError` naming what it
  cannot represent exactly."""
  path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(path):
    raise HFError(f"{model_dir} is not a Hugging Face model directory: no config.json")
  with open(path) as f:
    config = json.load(f)
  family = config.get("model_type")
  if family not in FAMILIES:
    raise HFError(f"model_type {family!r} is not supported; supported: {FAMILIES}")
  checks = [("hidden_act", "silu"), ("mlp_bias", False)]
  # Qwen configs carry a sliding_window that only applies with use_sliding_window (to
  # some layers); Mistral's applies to every layer, Llama has none.
  if family.startswith("qwen"):
    checks.append(("use_sliding_window", False))
  elif family == "llama":
    checks.append(("sliding_window", None))
  if family != "qwen2":  # Qwen2 always has q/k/v biases and no attention_bias key
    checks.append(("attention_bias", False))
  for key, want in checks:
    if config.get(key, want) != want:
      raise HFError(f"{family} config has {key}={config[key]!r}; only {want!r} is supported")
  heads = config["num_attention_heads"]
  fields = dict(
      vocab_size=config["vocab_size"], d_model=config["hidden_size"],
      num_layers=config["num_hidden_layers"], num_heads=heads,
      num_kv_heads=config.get("num_key_value_heads") or heads,
      head_dim=config.get("head_dim") or config["hidden_size"] // heads,
      mlp_dim=config["intermediate_size"], norm_eps=float(config.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(config.get("tie_word_embeddings", False)),
      qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
      sliding_window=(config.get("sliding_window") or 0) if family == "mistral" else 0,
      **_rope(config))
  fields.update(overrides)
  return model_lib.ModelConfig(**fields)


def _canonical(name: str) -> str:
  """A tensor name with the prefixes checkpoints vary in reduced to `model.`."""
  for prefix in ("model.language_model.", "language_model.model.", "model."):
    if name.startswith(prefix):
      return PREFIX + name[len(prefix):]
  return name if name.startswith("lm_head.") else PREFIX + name


def _tensor_files(model_dir: str) -> dict:
  """`{canonical name: (file path, stored name)}` of a single-file or index-sharded
  safetensors checkpoint."""
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {_canonical(name): (os.path.join(model_dir, file), name)
            for name, file in weight_map.items()}
  single = os.path.join(model_dir, "model.safetensors")
  if not os.path.isfile(single):
    raise HFError(f"{model_dir} has neither model.safetensors nor "
                  "model.safetensors.index.json")
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  with safe_open(single, framework="numpy") as f:
    return {_canonical(name): (single, name) for name in f.keys()}


def expected_tensors(cfg: model_lib.ModelConfig) -> dict:
  """`{HF tensor name: (our leaf path, layer index or None, transposed, HF shape)}`."""
  shapes = {k: v.shape for k, v in _leaf_shapes(cfg).items()}
  out = {PREFIX + "embed_tokens.weight": (("embed",), None, False, shapes[("embed",)]),
         PREFIX + "norm.weight": (("final_norm",), None, False, shapes[("final_norm",)])}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = (("lm_head",), None, True, shapes[("lm_head",)][::-1])
  layer_tensors = {**LAYER_TENSORS, **(BIAS_TENSORS if cfg.qkv_bias else {}),
                   **(QK_NORM_TENSORS if cfg.qk_norm else {})}
  for leaf, (name, transposed) in layer_tensors.items():
    per_layer = shapes[("layers", leaf)][1:]
    for i in range(cfg.num_layers):
      out[f"{PREFIX}layers.{i}.{name}"] = (("layers", leaf), i, transposed,
                                          per_layer[::-1] if transposed else per_layer)
  return out


def _leaf_shapes(cfg) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  shapes = jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0), cfg))
  return {tuple(k.key for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def load_params(model_dir: str, cfg: model_lib.ModelConfig, *, dtype=None,
                shardings=None) -> dict:
  """The params pytree of `cfg` from an HF directory's safetensors.

  Args:
    model_dir: directory with `model.safetensors` or `model.safetensors.index.json`.
    cfg: its `ModelConfig` (`read_config`).
    dtype: dtype of the returned leaves (default `cfg.param_dtype`).
    shardings: optional pytree of `jax.sharding.Sharding`s with the params' structure;
      each leaf is then placed with `jax.make_array_from_callback`.

  Tensors are read from the memory-mapped files one stacked leaf at a time, so the host
  holds at most one leaf beyond the files' page cache. A missing, unexpected or
  mis-shaped tensor is an `HFError` naming it (a tied checkpoint that also stores
  `lm_head.weight` is accepted, the copy ignored).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  files = _tensor_files(model_dir)
  wanted = expected_tensors(cfg)
  extra = sorted(set(files) - set(wanted) - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
  missing = sorted(set(wanted) - set(files))
  if missing or extra:
    raise HFError(f"{model_dir} does not match its config: missing {missing[:5]}, "
                  f"unexpected {extra[:5]}")
  dtype = np.dtype(model_lib.DTYPES[cfg.param_dtype] if dtype is None else dtype)
  shapes = _leaf_shapes(cfg)
  by_leaf = {}
  for name, (leaf, layer, transposed, shape) in wanted.items():
    by_leaf.setdefault(leaf, []).append((name, layer, transposed, shape))
  handles = {}
  params = {}
  for leaf, tensors in by_leaf.items():
    array = np.empty(shapes[leaf].shape, dtype)
    for name, layer, transposed, shape in tensors:
      path, stored = files[name]
      if path not in handles:
        handles[path] = safe_open(path, framework="numpy")
      value = handles[path].get_tensor(stored)
      if value.shape != tuple(shape):
        raise HFError(f"tensor {name} has shape {value.shape}, expected {tuple(shape)}")
      value = value.T if transposed else value
      if layer is None:
        array[...] = value
      else:
        array[layer] = value
    node = params
    for key in leaf[:-1]:
      node = node.setdefault(key, {})
    if shardings is None:
      node[leaf[-1]] = jax.numpy.asarray(array)
    else:
      sharding = shardings
      for key in leaf:
        sharding = sharding[key]
      node[leaf[-1]] = jax.make_array_from_callback(array.shape, sharding,
                                                    lambda index, a=array: a[index])
    del array
  return params


def _hf_config(cfg: model_lib.ModelConfig, dtype: str) -> dict:
  rope = None
  if cfg.rope_type == "llama3":
    rope = dict(rope_type="llama3", factor=cfg.rope_factor,
                low_freq_factor=cfg.rope_low_freq_factor,
                high_freq_factor=cfg.rope_high_freq_factor,
                original_max_position_embeddings=cfg.rope_original_max_positions)
  family, arch = (("qwen2", "Qwen2ForCausalLM") if cfg.qkv_bias else
                  ("qwen3", "Qwen3ForCausalLM") if cfg.qk_norm else
                  ("mistral", "MistralForCausalLM") if cfg.sliding_window else
                  ("llama", "LlamaForCausalLM"))
  config = dict(
      architectures=[arch], model_type=family, vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, intermediate_size=cfg.mlp_dim, hidden_act="silu",
      rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=rope,
      tie_word_embeddings=cfg.tie_embeddings, torch_dtype=dtype)
  if family != "qwen2":
    config.update(attention_bias=False, mlp_bias=False)
  if family == "mistral":
    config.update(sliding_window=cfg.sliding_window)
  return config


def _merged_config(src: dict, ours: dict) -> dict:
  """The source `config.json` with our fields, in the source's dialect (transformers 5
  writes `rope_parameters` and `dtype`; the rope settings themselves never change)."""
  ours = {k: v for k, v in ours.items() if k != "architectures"}
  if "rope_parameters" in src:
    ours = {k: v for k, v in ours.items() if k not in ("rope_theta", "rope_scaling")}
  if "dtype" in src:
    ours["dtype"] = ours.pop("torch_dtype")
  return {**src, **ours}


def save_params(params: dict, cfg: model_lib.ModelConfig, out_dir: str, *, src_dir=None,
                dtype="bfloat16", shard_bytes=SHARD_BYTES) -> None:
  """Writes `params` as an HF directory: safetensors with HF names and `[out, in]`
  layouts (`metadata={"format": "pt"}`), split with an index above `shard_bytes`;
  `config.json` (the source's, updated, when `src_dir` has one); and whichever tokenizer
  and generation files `src_dir` has. `dtype` is the stored dtype ("bfloat16",
  "float32")."""
  import jax  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  np_dtype = np.dtype(model_lib.DTYPES[dtype])
  os.makedirs(out_dir, exist_ok=True)
  shards, current, size = [], {}, 0
  for name, (leaf, layer, transposed, _) in expected_tensors(cfg).items():
    value = params
    for key in leaf:
      value = value[key]
    value = np.asarray(jax.device_get(value[layer] if layer is not None else value))
    value = np.ascontiguousarray((value.T if transposed else value).astype(np_dtype))
    if current and size + value.nbytes > shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = value
    size += value.nbytes
  shards.append(current)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for file, tensors in zip(names, shards):
    save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
  if len(shards) > 1:
    index = dict(metadata=dict(total_size=sum(v.nbytes for t in shards for v in t.values())),
                 weight_map={name: file for file, t in zip(names, shards) for name in t})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
  config = _hf_config(cfg, dtype)
  if src_dir and os.path.isfile(os.path.join(src_dir, "config.json")):
    with open(os.path.join(src_dir, "config.json")) as f:
      config = _merged_config(json.load(f), config)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  for file in TOKENIZER_FILES:
    if src_dir and os.path.isfile(os.path.join(src_dir, file)):
      shutil.copy(os.path.join(src_dir, file), os.path.join(out_dir, file))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "tokenizer.model")


HFTokenizer = hf_tokenizer.HFTokenizer
