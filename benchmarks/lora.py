"""Per-chip memory of the LoRA DPO step next to full fine-tuning, compiled ahead of time
by the real TPU compiler for TPU slices (needs libtpu; nothing is allocated).

    python benchmarks/lora.py [--models 7b,8b] [--topologies v5e-8,v5e-4]
        [--lengths 1024,4096] [--rank 16] [--out docs/results/lora_memory.md]

Each row is the plan `--compile_only` compiles without data for
`--model=M --batch_size=8 --max_length=L --max_prompt_length=L/2 --compute_dtype=bfloat16
--remat=full --reference=step --prefix_sharing=true --fsdp`: full fine-tuning (float32
params, AdamW, the in-step reference in bfloat16) against LoRA of rank `--rank` on every
projection (the frozen base in bfloat16, `--ref_dtype=bfloat16`, is also the
reference). GiB per chip: arguments, temporaries, and what the fit is judged on (the
compiler's buffer assignment).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402

from tunix_kernels import aot_tpu  # noqa: E402
from tunix_core.aot import compile as aot  # noqa: E402
from tunix_core.training import config as config_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def row(model, topology, L, rank):
  cfg = config_lib.TrainConfig(
      model=model, fsdp=True, batch_size=8, max_length=L, max_prompt_length=L // 2,
      compute_dtype="bfloat16", remat="full", reference="step", ref_dtype="bfloat16",
      prefix_sharing=True, compile_only=True, output_dir="/tmp/lora_benchmark",
      lora_rank=rank)
  chip, devices = aot.target_devices(topology)
  s = aot.compile_stats(aot.plan_for(cfg, devices), chip, devices)
  what = f"LoRA r={rank}" if rank else "full"
  if s["error"] is not None:
    return f"| {model} | {topology} | {L} | {what} | - | - | - | no: {s['error'][:100]} |"
  fits = "yes" if s["need"] <= chip.hbm_bytes else "no"
  return (f"| {model} | {topology} | {L} | {what} | {s['argument'] / GiB:.2f} | "
          f"{s['temp'] / GiB:.2f} | {s['need'] / GiB:.2f} | {fits} |")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="7b,8b")
  p.add_argument("--topologies", default="v5e-8,v5e-4")
  p.add_argument("--lengths", default="1024,4096")
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--out", default=None)
  a = p.parse_args()
  if not aot_tpu.has_libtpu():
    raise SystemExit("needs libtpu (the `tpu` extra)")
  lines = ["| model | slice | L | training | arguments | temporaries | needed | fits |",
           "|---|---|---|---|---|---|---|---|"]
  for model in a.models.split(","):
    for topology in a.topologies.split(","):
      for L in map(int, a.lengths.split(",")):
        for rank in (0, a.rank):
          lines.append(row(model, topology, L, rank))
          print(lines[-1], flush=True)
  if a.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    with open(a.out, "w") as f:
      f.write(f"The DPO step, full fine-tuning and LoRA, per chip (`benchmarks/lora.py "
              f"--models {a.models} --topologies {a.topologies} --lengths {a.lengths}`, "
              f"measured at commit {commit} with jax {jax.__version__}, libtpu "
              f"{importlib.metadata.version('libtpu')}). GiB.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
