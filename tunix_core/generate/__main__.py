"""`python -m tunix_core.generate (--hf_model_dir=DIR | --output_dir=RUN [--step=N])
--prompt=TEXT [--max_new_tokens=N] [--chat_template=auto|none] [--temperature --top_k
--top_p --seed]`: a completion of TEXT by an HF directory or a run's saved step (its
tokenizer and chat template as the run had them); the last stdout line is one JSON
object with `prompt_ids`, `completion_ids` (ending with the EOS that stopped it, if one
did) and `text`. Greedy by default; exit status 1 with one `error:` line."""

import argparse
import json
import sys

from tunix_core import generate
from tunix_core import hf
from tunix_core.checkpoints import export
from tunix_core.checkpoints import store as checkpoint
from tunix_core.model import generate as generate_lib
from tunix_core.run import source as source_lib


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tunix_core.generate",
                              description=__doc__.splitlines()[0])
  # The trainer's (absl) spelling of help works here too.
  p.add_argument("--helpfull", action="help", help="same as --help")
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--hf_model_dir", help="an HF model directory (local or gs://)")
  source.add_argument("--output_dir", help="a run's --output_dir: generate from a saved step")
  p.add_argument("--step", type=int, default=None, help="with --output_dir: the step "
                 "(default: the newest)")
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
    if a.hf_model_dir:
      cfg, tok = hf.read_config(a.hf_model_dir), hf.HFTokenizer(a.hf_model_dir)
      params = generate.load_sharded(a.hf_model_dir, cfg)
      eos = generate.eos_ids(a.hf_model_dir, tok)
    else:
      saved = export.restore_step(a.output_dir, a.step)
      if saved.steps.plan.lora is not None:
        raise ValueError(f"step {saved.step} of {a.output_dir} holds LoRA adapters: export "
                         "it merged (--export_merged) and generate from that directory")
      cfg, tok, params = saved.model, source_lib.tokenizer(saved.cfg), saved.params()
      eos = generate.eos_ids(saved.cfg.hf_model_dir, tok)
    sampling = generate_lib.Sampling(a.max_new_tokens, a.temperature, a.top_k, a.top_p, eos)
    chat = a.chat_template == "auto" and getattr(tok, "chat_template", None) is not None
    (result,) = generate.complete(params, cfg, tok, [a.prompt], sampling, chat=chat,
                                  seed=a.seed)
  except (OSError, ValueError, checkpoint.CheckpointError) as e:  # HFError,
    # TokenizerError, StorageError, a missing or damaged step, bad flags
    print(f"generate: error: {e}", file=sys.stderr)
    return 1
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())
