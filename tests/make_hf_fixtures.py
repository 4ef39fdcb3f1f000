"""Writes the tiny random Hugging Face checkpoints under `tests/fixtures/hf/` and the
logits `transformers` gives for them, so CI can check parity without torch.

    pip install torch==2.13.0 transformers safetensors   # CPU-only torch on Python 3.11
    python tests/make_hf_fixtures.py [NAME ...]   # default: all of them

Each fixture directory holds what `save_pretrained` writes (`config.json`,
`model.safetensors`, float32), `tokens.npy` (int32 `[2, T]`), `logits.npy` (float32
`[2, T, V]` from the model in eager attention) and `versions.json`; `tokenizer/` holds a
small trained byte-level BPE with a ChatML template and, in `expected.json`, what
`transformers` encodes, decodes and renders with it. The init is large
(std 0.3) so that every config option moves the logits by far more than the 1e-5 the
tests allow.
"""

import json
import os

import numpy as np
import torch
import transformers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
TOKENS = 40

FIXTURES = {
    # Llama 3.x: llama3 rope scaling, explicit head_dim (16, not 48 / 4), GQA, untied.
    "llama3": dict(
        model_type="llama", vocab_size=160, hidden_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.3,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16),
        rope_theta=10000.0),
    # SmolLM2-like: tied embeddings, rope_theta 1e5, no scaling.
    "llama_tied": dict(
        model_type="llama", vocab_size=144, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.3,
        rope_theta=100000.0),
    # Mistral: every layer attends to a sliding window of 8 of the 40 tokens.
    "mistral": dict(
        model_type="mistral", vocab_size=128, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.3,
        rope_theta=10000.0, sliding_window=8),
    # Qwen2: q/k/v biases (random here, so they matter), GQA, untied.
    "qwen2": dict(
        model_type="qwen2", vocab_size=136, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.3,
        rope_theta=1000000.0, use_sliding_window=False),
    # Qwen3: per-head q/k RMSNorm before RoPE, explicit head_dim, tied.
    "qwen3": dict(
        model_type="qwen3", vocab_size=152, hidden_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, intermediate_size=80,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.3,
        rope_theta=1000000.0, use_sliding_window=False),
    # Gemma: (1 + w) norms, sqrt(d)-scaled tied embeddings, GeGLU, multi-query attention.
    "gemma": dict(
        model_type="gemma", vocab_size=128, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=96,
        hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, initializer_range=0.3,
        rope_theta=10000.0),
    # Gemma 2: pre and post norms, query_pre_attn_scalar != head_dim, both soft-caps small
    # enough to bite, layers alternating sliding (window 8) and global.
    "gemma2": dict(
        model_type="gemma2", vocab_size=120, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, initializer_range=0.3,
        query_pre_attn_scalar=40, sliding_window=8, attn_logit_softcapping=4.0,
        final_logit_softcapping=3.0, rope_theta=10000.0),
    # Gemma 3 text: q/k norms, 1 global layer per 2 here (5 : 1 in the real models), local
    # layers with their own unscaled rope theta, global ones linearly scaled.
    "gemma3_text": dict(
        model_type="gemma3_text", vocab_size=136, hidden_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=80,
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, initializer_range=0.3,
        query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=None,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=4.0,
                                                rope_theta=1000000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
}


def _randomize_norms_and_biases(model):
  """`transformers` starts norm scales at 1 and biases at 0: move them so a loader that
  dropped or swapped one would change the logits."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.3 * torch.randn_like(p))


# ChatML, as Qwen writes it (no BOS token); our own wording of the template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXTS = ["Hello, world!", "  leading spaces and  doubles", "naïve café — ünïcode ✓",
         "<|im_start|> is special"]
CHATS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
         [{"role": "user", "content": "2 + 2 = ?"}, {"role": "assistant", "content": "4"}]]


def make_tokenizer(out_dir):
  """A byte-level BPE trained on a few sentences, with ChatML special tokens, and what
  `transformers` makes of it (`expected.json`)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20,
                          trainer)
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=None,
                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                   chat_template=CHAT_TEMPLATE), f, indent=2)
  hf_tok = transformers.AutoTokenizer.from_pretrained(out_dir)
  expected = dict(
      encode=[hf_tok.encode(t, add_special_tokens=False) for t in TEXTS],
      decode=[hf_tok.decode(hf_tok.encode(t, add_special_tokens=False),
                            skip_special_tokens=True) for t in TEXTS],
      chat=[hf_tok.apply_chat_template(c, tokenize=False, add_generation_prompt=g)
            for c in CHATS for g in (False, True)],
      eos_id=hf_tok.eos_token_id, pad_id=hf_tok.pad_token_id, bos_id=hf_tok.bos_token_id,
      vocab_size=len(hf_tok), texts=TEXTS, chats=CHATS)
  with open(os.path.join(out_dir, "expected.json"), "w") as f:
    json.dump(expected, f, indent=2, ensure_ascii=False)
  print("tokenizer", len(hf_tok))


def main(names):
  if not names:
    make_tokenizer(os.path.join(ROOT, "tokenizer"))
  for name in names or FIXTURES:
    kwargs = FIXTURES[name]
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**kwargs)
    config._attn_implementation = "eager"  # pylint: disable=protected-access
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomize_norms_and_biases(model)
    out_dir = os.path.join(ROOT, name)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, TOKENS), np.int32)
    with torch.no_grad():
      logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    np.save(os.path.join(out_dir, "tokens.npy"), tokens)
    np.save(os.path.join(out_dir, "logits.npy"), logits)
    with open(os.path.join(out_dir, "versions.json"), "w") as f:
      json.dump(dict(torch=torch.__version__, transformers=transformers.__version__), f)
    for extra in ("generation_config.json",):
      path = os.path.join(out_dir, extra)
      if os.path.exists(path):
        os.remove(path)
    print(name, logits.shape, f"|logits| max {np.abs(logits).max():.2f}")


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  main(sys.argv[1:])  # fixture names; none: the tokenizer and every fixture
