"""Per-chip memory of a DPO step on a TPU slice (ahead of time) under ZeRO-1, FSDP and
FSDP + tensor parallelism, and CPU throughput of FSDP relative to ZeRO-1 on 8 simulated
devices.

    python benchmarks/sharding.py [--models tiny,125m,1b,7b] [--refs precomputed,bf16]
        [--layouts zero1,fsdp,fsdp+tp2] [--topology v5e-8] [--throughput_steps 7]
        [--out docs/results/memory_v5e-8.md]

Memory: each model's train step as the trainer plans it for 8 full pairs
(`aot.plan_for` without data: the flags' worst case, every row `--max_length=1024`
tokens after a 512-token prompt, prefix-shared rows, bf16 compute, `--remat=full`,
float32 master params, AdamW), the very plan `--compile_only` compiles for these flags,
compiled by the real TPU compiler for `--topology` from abstract inputs (needs libtpu;
nothing is allocated), per chip:
arguments, temporaries and the total (arguments + outputs not in donated buffers +
temporaries) against the chip's HBM, or the compiler's refusal. `--refs` picks the
reference: precomputed log-probs (an input), or the frozen reference params in the step
in bf16 or f32. `--layouts`: ZeRO-1, FSDP, and FSDP with `--model_parallel=K` ("fsdp+tpK",
skipped for a model whose heads or vocabulary K does not divide). Throughput: the tiny preset on 8 simulated CPU devices, median step time
of interleaved ZeRO-1 and FSDP steps on the same batches; CPU devices cannot overlap the
gathers with compute, so this bounds FSDP's extra cost from above.

The memory table is also written to `--out` (Markdown, stamped with the commit and the
jax and libtpu versions it was measured with), which the docs show as it is.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tunix_core import data as data_lib  # noqa: E402
from tunix_core.aot import compile as aot  # noqa: E402
from tunix_core.parallel import tensor_parallel  # noqa: E402
from tunix_core.training import config as config_lib  # noqa: E402
from tunix_core.training import plan as plan_lib  # noqa: E402
from tunix_core.training import step as step_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "data", "train.jsonl")
GiB = 1 << 30


def _layout(name):
  """`(fsdp, model_parallel)` of a `--layouts` entry."""
  if name in ("zero1", "fsdp"):
    return name == "fsdp", 1
  if name.startswith("fsdp+tp"):
    return True, int(name[len("fsdp+tp"):])
  raise ValueError(f"unknown layout {name!r}: zero1, fsdp or fsdp+tpK")


def _stamp() -> str:
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip() or "unknown"
  try:
    libtpu = importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    libtpu = "none"
  return f"measured at commit {commit} with jax {jax.__version__}, libtpu {libtpu}"


def memory_table(models, refs, layouts, topology, out_path):
  lines = []

  def emit(line):
    print(line, flush=True)
    if not line.startswith("  ("):
      lines.append(line)

  emit(f"Per-chip memory of one DPO step on {topology} ({_stamp()}); GiB. sum = arguments "
       "+ non-donated outputs + temporaries as analysed; peak = the compiler's "
       "peak_memory_in_bytes; allocated = what its buffer assignment places in HBM, what "
       "the fit is judged on. Each row is the plan `--compile_only` compiles for these "
       "flags without data (8 full pairs of 1024 tokens, 512 of prompt; "
       "`benchmarks/sharding.py`).")
  emit("")
  emit("| model | params | reference | layout | plan | arguments | temporaries | sum | peak | "
       "allocated | fits |")
  emit("|---|---|---|---|---|---|---|---|---|---|---|")
  for model in models:
    for ref in refs:
      for fsdp, k in map(_layout, layouts):
        try:
          tensor_parallel.check(config_lib.TrainConfig(output_dir="", train_data="",
                                                       model=model).model_config(), k)
        except ValueError as e:
          emit(f"| {model} | | {ref} | FSDP + TP {k} | skipped: {e} |")
          continue
        cfg = config_lib.TrainConfig(
            output_dir="/tmp/sharding_benchmark", compile_only=True, model=model, fsdp=fsdp,
            model_parallel=k,
            batch_size=8, max_length=1024, max_prompt_length=512, compute_dtype="bfloat16",
            remat="full", reference="precomputed" if ref == "precomputed" else "step",
            ref_dtype="auto" if ref == "precomputed" else {"f32": "float32",
                                                           "bf16": "bfloat16"}[ref])
        t0 = time.perf_counter()
        chip, devices = aot.target_devices(topology)
        plan = aot.plan_for(cfg, devices)
        s = aot.compile_stats(plan, chip, devices)
        r = plan.rows
        head = (f"| {model} | {s.get('num_params', 0) / 1e9:.2f}B | {ref} | {plan.layout} | "
                f"{r.layout} {r.rows} x {r.length}, {r.head} head slots |")
        if s["error"] is not None:
          emit(f"{head} - | - | - | - | - | no: {s['error'][:120]} |")
        else:
          fits = "yes" if s["need"] <= s["chip"].hbm_bytes else "no"
          peak, hbm = (f"{s[k] / GiB:.2f}" if s[k] else "-" for k in ("peak", "hbm"))
          emit(f"{head} {s['argument'] / GiB:.2f} | {s['temp'] / GiB:.2f} | "
               f"{s['total'] / GiB:.2f} | {peak} | {hbm} | {fits} |")
        emit(f"  (compiled in {time.perf_counter() - t0:.0f} s)")
  if out_path:
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
      f.write("\n".join(lines) + "\n")


def throughput(num_steps):
  ds = data_lib.load_dataset(TRAIN, data_lib.ByteTokenizer(), 64, 32)
  runs = {}
  for fsdp in (False, True):
    cfg = config_lib.TrainConfig(output_dir="/tmp/sharding_benchmark", train_data=TRAIN,
                                 fsdp=fsdp, batch_size=8, max_length=64, max_prompt_length=32)
    plan = plan_lib.make_plan(cfg, jax.devices(), plan_lib.data_sizes(cfg, [ds]))
    steps = step_lib.make_steps(plan, jax.devices())
    state = steps.init_state(jax.random.PRNGKey(0))
    ref = jax.tree.map(lambda x: jnp.array(x, copy=True), state["params"])
    runs["FSDP" if fsdp else "ZeRO-1"] = [steps, state, ref, []]
  batches = [data_lib.take_pairs(ds, np.arange(8 * i, 8 * i + 8)) for i in range(num_steps + 1)]
  tokens = [int(b["attention_mask"].sum()) for b in batches]
  for i, batch in enumerate(batches):  # interleaved; step 0 compiles
    for run in runs.values():
      steps, state, ref, times = run
      placed = steps.put_batch(batch)
      t0 = time.perf_counter()
      state, metrics = steps.train_step(state, ref, placed)
      jax.block_until_ready(metrics)
      run[1] = state
      if i:
        times.append(tokens[i] / (time.perf_counter() - t0))
  rate = {name: statistics.median(run[3]) for name, run in runs.items()}
  print(f"tiny preset, 8 simulated CPU devices, 8 pairs of 64 tokens, in-step reference, "
        f"median of {num_steps} steps: ZeRO-1 {rate['ZeRO-1']:.0f} tokens/s, FSDP "
        f"{rate['FSDP']:.0f} tokens/s: FSDP / ZeRO-1 = {rate['FSDP'] / rate['ZeRO-1']:.2f}x")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--models", default="tiny,125m,1b,7b")
  p.add_argument("--refs", default="precomputed",
                 help="comma-separated: precomputed, bf16 and/or f32")
  p.add_argument("--layouts", default="zero1,fsdp,fsdp+tp2",
                 help="comma-separated: zero1, fsdp, fsdp+tpK (--model_parallel=K)")
  p.add_argument("--topology", default="v5e-8", help="a Cloud TPU slice name (tunix_kernels.aot_tpu.parse_topology)")
  p.add_argument("--throughput_steps", type=int, default=7, help="0: skip the CPU timing")
  p.add_argument("--out", default=None, help="where to write the memory table (default: "
                 "docs/results/memory_<topology>.md; empty: nowhere)")
  args = p.parse_args()
  if args.throughput_steps:
    throughput(args.throughput_steps)
  if args.models:
    out = (os.path.join(REPO, "docs", "results", f"memory_{args.topology}.md")
           if args.out is None else args.out)
    memory_table(args.models.split(","), args.refs.split(","), args.layouts.split(","),
                 args.topology, out)


if __name__ == "__main__":
  main()
