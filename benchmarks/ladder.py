"""The scale ladder: the default DPO step compiled ahead of time for 8B and 70B models on
TPU slices from v5p-8 to two v5e-256 (needs libtpu; nothing is allocated).

    python benchmarks/ladder.py [--rows 0,3,...] [--out docs/results/ladder.md]

Each row is the plan the trainer would compile for these flags (`aot.plan_for`, the
flags' worst case: prompts of L/2 tokens in rows of L): `--fsdp`, bf16 compute,
`--remat=full` (or `offload`), `--ref_dtype=bfloat16`, the reference in the step, one pair
per chip (8 pairs on v5p-8's 4 chips), several slices as a "slice" axis in front of
"data" (`--num_slices` auto), LoRA rows with rank 16 on every projection. Per row:
whether it fits (per-chip HBM as the compiler's buffer assignment allocates it, and
pinned host memory under offload), the compile time, model FLOPs per chip
(`training.flops`), the bytes a chip sends per step over ICI and across slices (read
from the compiled HLO, `aot.comms`), the roofline step time with nothing overlapped
(FLOPs at the bf16 peak plus every collective at its link's bandwidth), tokens per
second per chip (2 L tokens per pair), the communication share with nothing overlapped
and the exposed share of the compiled schedule (`aot.overlap`). Each row compiles in
its own subprocess (the compiler's memory is returned between rows); the table is
printed and, with `--out`, written as Markdown stamped with the commit and versions.
`--split_backward` compiles the LM head's log-probs with the split backward kernels
wherever they fit (`tunix_kernels.LogprobsBlockSizes` with a `block_d`; 10 N D V flops,
no float32 `d_hidden` partial), to compare the step's memory with the fused backward's.
"""

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time

if __name__ == "__main__":  # before JAX starts
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from tunix_kernels import aot_tpu  # noqa: E402
from tunix_kernels.logprobs import blocks as logprobs_blocks  # noqa: E402
from tunix_core.aot import comms  # noqa: E402
from tunix_core.aot import compile as aot  # noqa: E402
from tunix_core.training import config as config_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30

# (model, target topology, tokens per pair row L, variant: full, lora or offload)
ROWS = [(m, t, L, v) for m, t, v in (
    ("8b", "v5e-16", "full"), ("8b", "v5p-8", "full"), ("8b", "v5e-8", "lora"),
    ("70b", "v5p-128", "full"), ("70b", "v5p-128", "lora"), ("70b", "v5e-256", "full"),
    ("70b", "2xv5e-256", "full")) for L in (1024, 4096)] + [
    ("70b", "2xv5e-256", 4096, "offload")]


def row_config(model: str, chips: int, L: int, variant: str) -> config_lib.TrainConfig:
  """The trainer's flags of one ladder row."""
  return config_lib.TrainConfig(
      model=model, compile_only=True, fsdp=True, batch_size=max(8, chips), max_length=L,
      max_prompt_length=L // 2, compute_dtype="bfloat16", ref_dtype="bfloat16",
      remat="offload" if variant == "offload" else "full",
      lora_rank=16 if variant == "lora" else 0, output_dir="/tmp/tunix-ladder")


def measure(index: int) -> dict:
  """Compiles row `index` and returns its figures."""
  model, topology, L, variant = ROWS[index]
  chip, devices = aot.target_devices(topology)
  cfg = row_config(model, len(devices), L, variant)
  plan = aot.plan_for(cfg, devices)
  start = time.perf_counter()
  stats = aot.compile_stats(plan, chip, devices)
  out = dict(model=model, topology=topology, L=L, variant=variant, chips=len(devices),
             compile_s=time.perf_counter() - start, hbm=chip.hbm_bytes, layout=plan.layout,
             error=stats["error"])
  if stats["error"] is not None:
    return out
  roof = comms.share(stats["collectives"], stats["model_flops"], chip.name)
  by_link = lambda dcn: sum(b for a, b in stats["collectives"].items()
                            if ("slice" in a) == dcn)
  pairs = plan.pairs_per_device
  out.update(need=stats["need"], host=stats["host"], flops=stats["model_flops"],
             ici_bytes=by_link(False), dcn_bytes=by_link(True), step_s=roof["step_s"],
             tokens_per_s=pairs * 2 * L / roof["step_s"], share=roof["share"],
             exposed=(None if stats["overlap"]["unknown"] else stats["overlap"]["share"]),
             fits=stats["need"] <= chip.hbm_bytes)
  return out


def table(results: list[dict]) -> list[str]:
  lines = ["| model | slice | L | layout | per chip (HBM) | host | fits | compile | "
           "TFLOP/chip | ICI GB/chip | DCN GB/chip | step (roofline) | tok/s/chip | "
           "comm share (no overlap) | exposed |", "|" + "---|" * 15]
  for r in results:
    name = r["model"].upper() + (" LoRA r=16" if r["variant"] == "lora" else "")
    remat = "offload" if r["variant"] == "offload" else "full"
    head = (f"| {name} | {r['topology']} | {r['L']:,} | "
            f"{r['layout'].replace('LoRA r=16 on 7 projection(s), base ', '')}, remat {remat} | ")
    if r.get("error") is not None or "need" not in r:
      reason = r.get("error") or "no result"
      used = re.search(r"temporaries \(([\d.]+[KMG])\) exceeds available HBM \(([\d.]+[KMG])\)",
                       reason)
      reason = (f"temporaries {used.group(1)} of {used.group(2)} free" if used
                else reason[:90].replace("|", "/"))
      lines.append(head + f"refused: {reason} | | no | {r.get('compile_s', 0):.0f} s |"
                   + " |" * 7)
      continue
    lines.append(
        head + f"{r['need'] / GiB:.1f} of {r['hbm'] / GiB:.0f} GiB | "
        f"{r['host'] / GiB:.1f} GiB | {'yes' if r['fits'] else 'no'} | "
        f"{r['compile_s']:.0f} s | {r['flops'] / 1e12:.0f} | {r['ici_bytes'] / 1e9:.0f} | "
        f"{r['dcn_bytes'] / 1e9:.2f} | {r['step_s']:.2f} s | {r['tokens_per_s']:,.0f} | "
        f"{r['share']:.0%} | "
        + ("unknown" if r.get("exposed") is None else f"{r['exposed']:.1%}") + " |")
  return lines


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", default=",".join(str(i) for i in range(len(ROWS))))
  p.add_argument("--row", type=int, default=None, help="(internal) measure one row")
  p.add_argument("--out", default=None)
  p.add_argument("--split_backward", action="store_true",
                 help="the log-prob kernels' split backward wherever it fits")
  a = p.parse_args()
  if not aot_tpu.has_libtpu():
    raise SystemExit("needs libtpu (the `tpu` extra)")
  if a.split_backward:
    # The default tiles take a measured table's (fused) tiles, else the faster backward
    # on the chip's roofline; rank the split pair first instead (the fused one stays
    # where only it fits).
    logprobs_blocks.tuned_tiles = lambda *_: None
    logprobs_blocks.roofline_seconds = lambda bs, *_: float(bs.fused)
  if a.row is not None:
    print("RESULT " + json.dumps(measure(a.row)))
    return
  results = []
  for i in (int(x) for x in a.rows.split(",")):
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--row={i}"]
                          + ["--split_backward"] * a.split_backward,
                          capture_output=True, text=True, cwd=REPO)
    found = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    model, topology, L, variant = ROWS[i]
    r = (json.loads(found[-1][7:]) if found else
         dict(model=model, topology=topology, L=L, variant=variant, layout="",
              error=(proc.stderr.strip().splitlines() or ["crashed"])[-1]))
    results.append(r)
    print(table([r])[-1], flush=True)
  lines = table(results)
  print("\n".join(lines))
  if a.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    versions = f"jax {jax.__version__}, libtpu {importlib.metadata.version('libtpu')}"
    with open(a.out, "w") as f:
      f.write(f"The scale ladder (`benchmarks/ladder.py`), compiled ahead of time at commit "
              f"{commit} with {versions}; the roofline and the communication share "
              f"assume no overlap of communication with compute, the exposed share is "
              f"the compiled schedule's (`aot.overlap`).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
