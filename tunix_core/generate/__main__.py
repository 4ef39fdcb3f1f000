"""`python -m tunix_core.generate --hf_model_dir=DIR --prompt=TEXT [--max_new_tokens=N]
[--chat_template=auto|none] [--temperature --top_k --top_p --seed]`: a completion of
TEXT; the last stdout line is one JSON object with `prompt_ids`, `completion_ids` (ending
with the EOS that stopped it, if one did) and `text`. Greedy by default."""

import argparse
import json
import sys

from tunix_core import generate
from tunix_core import hf
from tunix_core.model import generate as generate_lib


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tunix_core.generate",
                              description=__doc__.splitlines()[0])
  p.add_argument("--hf_model_dir", required=True, help="an HF model directory (local or gs://)")
  p.add_argument("--prompt", required=True, help="the user's text")
  p.add_argument("--max_new_tokens", type=int, default=64)
  p.add_argument("--chat_template", choices=("auto", "none"), default="auto",
                 help="auto: through the tokenizer's chat template when it has one")
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  p.add_argument("--top_k", type=int, default=0, help="0: no top-k filter")
  p.add_argument("--top_p", type=float, default=1.0, help="1: no nucleus filter")
  p.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
  a = p.parse_args(argv)
  try:
    cfg = hf.read_config(a.hf_model_dir)
    tok = hf.HFTokenizer(a.hf_model_dir)
    sampling = generate_lib.Sampling(a.max_new_tokens, a.temperature, a.top_k, a.top_p,
                                      generate.eos_ids(a.hf_model_dir, tok))
    params = hf.load_params(a.hf_model_dir, cfg)
    chat = a.chat_template == "auto" and tok.chat_template is not None
    (result,) = generate.complete(params, cfg, tok, [a.prompt], sampling, chat=chat,
                                  seed=a.seed)
  except (OSError, ValueError) as e:  # HFError, TokenizerError, StorageError, bad flags
    print(f"generate: error: {e}", file=sys.stderr)
    return 1
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
