"""Records `transformers`' greedy `generate` on the tiny checkpoints of
`tests/fixtures/hf/` (written by `make_hf_fixtures.py`), so CI checks our KV-cache
generation against it without torch.

    pip install torch==2.13.0 transformers   # CPU-only torch on Python 3.11
    python tests/make_generate_fixtures.py

Each fixture directory gets `generate.npz`: `prompt` (int32 `[2, P]`, the second row
left-padded), `prompt_mask` and `greedy` (int32 `[2, N]`, the new tokens of greedy
decoding in eager attention, EOS disabled so that every row runs N tokens) and the
`versions` of torch and transformers that recorded it.
"""

import json
import os

import numpy as np
import torch
import transformers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
PROMPT, PAD, NEW = 8, 3, 12


def record(name: str) -> None:
  d = os.path.join(ROOT, name)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      d, attn_implementation="eager", torch_dtype=torch.float32).eval()
  tokens = np.load(os.path.join(d, "tokens.npy"))[:, :PROMPT].astype(np.int64)
  mask = np.ones_like(tokens)
  mask[1, :PAD] = 0
  tokens[1, :PAD] = 0
  with torch.no_grad():
    out = model.generate(torch.tensor(tokens), attention_mask=torch.tensor(mask),
                         max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
  greedy = out[:, PROMPT:].numpy().astype(np.int32)
  versions = json.dumps({"torch": torch.__version__, "transformers": transformers.__version__})
  np.savez(os.path.join(d, "generate.npz"), prompt=tokens.astype(np.int32),
           prompt_mask=mask.astype(np.int32), greedy=greedy, versions=np.array(versions))
  print(name, greedy.tolist())


if __name__ == "__main__":
  for fixture in sorted(os.listdir(ROOT)):
    if fixture != "tokenizer":
      record(fixture)
