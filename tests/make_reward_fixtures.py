"""Writes tiny random Hugging Face reward models (`*ForSequenceClassification`, one
label) under `tests/fixtures/reward/` and the scores `transformers` gives them, so CI
checks `--reward_model` against it without torch.

    pip install torch==2.13.0 transformers safetensors   # CPU-only torch on Python 3.11
    python tests/make_reward_fixtures.py

Each directory holds what `save_pretrained` writes (float32), the fixture tokenizer of
`tests/fixtures/hf/tokenizer/` (its 320 ids are the vocabulary), `tokens.npy` (int32
`[3, T]`, right-padded with the pad id), `lengths.npy` and `scores.npy` (float32 `[3]`:
`model(tokens, attention_mask).logits[:, 0]`, which pools at each row's last non-pad id)
and `versions.json`. The init is large (std 0.3) so that every weight matters.
"""

import json
import os
import shutil

import numpy as np
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "fixtures", "reward")
TOKENIZER = os.path.join(HERE, "fixtures", "hf", "tokenizer")
LENGTHS = (11, 7, 16)

FIXTURES = {
    "llama": dict(model_type="llama", hidden_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, rms_norm_eps=1e-5, rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False),
}


def record(name: str, fields: dict) -> None:
  d = os.path.join(ROOT, name)
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(TOKENIZER, "tokenizer_config.json")) as f:
    pad = json.load(f).get("pad_token")
  with open(os.path.join(TOKENIZER, "tokenizer.json")) as f:
    vocab = json.load(f)
  pad_id = next(t["id"] for t in vocab["added_tokens"] if t["content"] == pad)
  config = transformers.AutoConfig.for_model(
      **fields, vocab_size=320, num_labels=1, pad_token_id=pad_id, initializer_range=0.3,
      tie_word_embeddings=False)
  torch.manual_seed(0)
  model = transformers.AutoModelForSequenceClassification.from_config(
      config, attn_implementation="eager", torch_dtype=torch.float32).eval()
  with torch.no_grad():  # random biases too, so that they matter
    for n, p in model.named_parameters():
      if n.endswith("bias"):
        p.normal_(0, 0.3)
  model.save_pretrained(d, safe_serialization=True)
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(TOKENIZER, f), d)
  rng = np.random.default_rng(1)
  tokens = np.full((len(LENGTHS), max(LENGTHS)), pad_id, np.int64)
  for row, n in enumerate(LENGTHS):
    tokens[row, :n] = rng.choice([i for i in range(320) if i != pad_id], n)
  mask = (tokens != pad_id).astype(np.int64)
  with torch.no_grad():
    scores = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits
  np.save(os.path.join(d, "tokens.npy"), tokens.astype(np.int32))
  np.save(os.path.join(d, "lengths.npy"), np.array(LENGTHS, np.int32))
  np.save(os.path.join(d, "scores.npy"), scores[:, 0].numpy().astype(np.float32))
  with open(os.path.join(d, "versions.json"), "w") as f:
    json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f)


if __name__ == "__main__":
  for fixture_name, fixture_fields in FIXTURES.items():
    record(fixture_name, fixture_fields)
