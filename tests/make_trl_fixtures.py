"""Writes `tests/fixtures/trl/expected.json`: preference pairs and the token ids TRL's
`DPOTrainer` builds for them with the committed ChatML tokenizer
(`tests/fixtures/hf/tokenizer`), computed here with `transformers` alone, so CI can
check `tunix_core.data` without it.

    pip install transformers tokenizers jinja2
    python tests/make_trl_fixtures.py

TRL's construction, restated (not TRL's code): a conversational pair's prompt ids are
the chat template rendered with `add_generation_prompt=True` and tokenized without
special tokens; a response's ids are the rendering of `prompt + response` (no
generation prompt) tokenized the same way, minus the first `len(prompt ids)` ids. A
plain pair's prompt ids are `tokenizer(prompt)` (the tokenizer's own special tokens);
each response gets the EOS text appended unless it already ends with it, and its ids
are `tokenizer(prompt + response)` minus the first `len(prompt ids)`. `prefix_match`
says whether the joint ids start with the prompt ids (TRL only warns when they do not);
`alone_ids` are the response tokenized by itself (with the EOS text for plain pairs).
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "fixtures", "hf", "tokenizer")
OUT = os.path.join(HERE, "fixtures", "trl", "expected.json")


def _msg(role, content):
  return {"role": role, "content": content}


PAIRS = [
    {"prompt": [_msg("system", "Be brief."), _msg("user", "Hi?")],
     "chosen": [_msg("assistant", "Hello, world!")],
     "rejected": [_msg("assistant", "the quick brown fox")]},
    {"prompt": [_msg("user", "2 + 2 = ?"), _msg("assistant", "4"), _msg("user", "and 3 + 3?")],
     "chosen": [_msg("assistant", "6")],
     "rejected": [_msg("assistant", "naïve café — ünïcode ✓")]},
    # Plain pairs: the seam falls between pre-tokens ...
    {"prompt": "Hello", "chosen": " world", "rejected": " doubles<|im_end|>"},
    # ... or inside one: "Hello " + "quick" is the pre-token " quick" ("Ġqu" "ick").
    {"prompt": "Hello ", "chosen": "world", "rejected": "quick"},
    {"prompt": "the ", "chosen": "lazy dog", "rejected": "dog<|im_end|>"},
]


def reference(hf_tok, pair: dict) -> dict:
  """TRL's ids for one pair (see the module docstring), from a `transformers` tokenizer."""
  if isinstance(pair["prompt"], list):
    def ids(messages, generation):
      text = hf_tok.apply_chat_template(messages, tokenize=False,
                                        add_generation_prompt=generation)
      got = hf_tok.encode(text, add_special_tokens=False)
      direct = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          add_generation_prompt=generation)["input_ids"]
      assert got == direct, (got, direct)
      return got
    prompt_ids = ids(pair["prompt"], True)
    joint = {k: ids(pair["prompt"] + pair[k], False) for k in ("chosen", "rejected")}
    alone = {k: None for k in joint}
  else:
    eos = hf_tok.eos_token
    texts = {k: pair[k] if pair[k].endswith(eos) else pair[k] + eos
             for k in ("chosen", "rejected")}
    prompt_ids = hf_tok(pair["prompt"])["input_ids"]
    joint = {k: hf_tok(pair["prompt"] + t)["input_ids"] for k, t in texts.items()}
    alone = {k: hf_tok(t, add_special_tokens=False)["input_ids"] for k, t in texts.items()}
  out = {"prompt_ids": prompt_ids}
  for k, ids in joint.items():
    out[f"{k}_ids"] = ids[len(prompt_ids):]
    out[f"{k}_prefix_match"] = ids[:len(prompt_ids)] == prompt_ids
    out[f"{k}_alone_ids"] = alone[k]
  return out


def main():
  import tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  hf_tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
  expected = {
      "versions": {"transformers": transformers.__version__,
                   "tokenizers": tokenizers.__version__},
      "tokenizer": os.path.relpath(TOKENIZER, os.path.dirname(HERE)),
      "pairs": PAIRS,
      "expected": [reference(hf_tok, p) for p in PAIRS],
  }
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  with open(OUT, "w", encoding="utf-8") as f:
    json.dump(expected, f, indent=1, ensure_ascii=False)
    f.write("\n")
  print("wrote", OUT)


if __name__ == "__main__":
  main()
