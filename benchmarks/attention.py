"""Attention on the trainer's shared rows: the Pallas kernels against the XLA path, per
layer and in the whole train step, compiled ahead of time by the real TPU compiler
(needs libtpu; nothing is allocated).

    python benchmarks/attention.py [--parts layer,grid,step] [--chip v5e]
        [--lengths 1024,2048,4096,8192] [--grid_lengths 1024,4096,8192]
        [--step_models 7b] [--step_lengths 1024,4096] [--search] [--topology v5e-8]
        [--out docs/results/attention_v5e-8.md]

Per layer: one shared row of T tokens whose prompt is half of each pair's sequence (a
T/3 prompt, then a T/3 chosen and a T/3 rejected response: the rows
`--prefix_sharing` builds), Llama-3-8B's heads (32 query heads, 8 key/value heads,
head dim 128), bf16; forward and backward of `tunix_kernels.attention.attention` with
impl="pallas" and impl="xla", one chip of `--chip`. Printed: the compiler's flops and
bytes accessed (cost analysis; for the kernels those are their `cost_estimate`s, which
count the causal tiles, so skipped tiles are not subtracted) and the temporaries and
peak (memory analysis).

Grid: the kernels' forward and backward compiled for every generation (v4, v5e, v5p,
v6e), T in `--grid_lengths` and head dims 64, 128 and 256: the compiled peak.

Per step: the issue's command, `trainer.py --model=M --fsdp --batch_size=8
--max_length=L --max_prompt_length=L/2 --compute_dtype=bfloat16 --remat=full
--reference=precomputed --prefix_sharing=true --compile_only --target_topology=T`,
planned as `--compile_only` plans it, with `--attention_impl=xla` (before the kernels)
and `pallas`; with `--search`, the longest L (to 1,024 tokens, by doubling then
bisecting) whose step fits with the kernels.
Written to `--out` as Markdown, stamped with the commit and versions.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib.metadata  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tunix_kernels import attention  # noqa: E402
from tunix_kernels import tpu  # noqa: E402
from tunix_kernels import aot_tpu  # noqa: E402
from tunix_core.aot import compile as aot  # noqa: E402
from tunix_core.training import config as config_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB, GiB = 1 << 20, 1 << 30
H, KV, K = 32, 8, 128


def shared_row(T):
  """`Visibility` of one shared row of T tokens: a T/3 prompt, then two T/3 branches
  whose rope positions both continue from the prompt."""
  third = T // 3
  branches = np.zeros(T, np.int32)
  branches[third:2 * third], branches[2 * third:] = 1, 2
  positions = np.concatenate([np.arange(2 * third), third + np.arange(T - 2 * third)])
  as_row = lambda x: jnp.asarray(x, jnp.int32)[None]
  return (as_row(positions), as_row(np.ones(T)), as_row(np.ones(T)), as_row(branches))


def layer_stats(chip, T, impl, head_dim=K):
  """Compiled flops, bytes, temporaries and peak of one layer's attention, fwd + bwd."""
  vis = shared_row(T)

  def grads(q, k, v, g):
    f = lambda q, k, v: attention.attention(q, k, v, attention.Visibility(*vis),
                                            scale=head_dim ** -0.5, impl=impl)
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(g)

  S = jax.ShapeDtypeStruct
  q = S((1, T, H, head_dim), jnp.bfloat16)
  kv = S((1, T, KV, head_dim), jnp.bfloat16)
  try:
    stats = aot_tpu.compiled_stats(aot_tpu.compile_for(chip, grads, q, kv, kv, q))
  except Exception as e:  # noqa: BLE001 - the compiler's refusal is the answer
    return {"error": str(e).splitlines()[0][:120]}
  return stats


@functools.cache  # the search revisits the lengths of the before/after table
def step_stats(model, L, impl, topology):
  """`aot.compile_stats` of the issue's command at pair length L with `impl`."""
  cfg = config_lib.TrainConfig(
      model=model, fsdp=True, batch_size=8, max_length=L, max_prompt_length=L // 2,
      compute_dtype="bfloat16", remat="full", reference="precomputed", prefix_sharing=True,
      compile_only=True, output_dir="/tmp/attention_benchmark", attention_impl=impl)
  chip, devices = aot.target_devices(topology)
  plan = aot.plan_for(cfg, devices)
  stats = aot.compile_stats(plan, chip, devices)
  stats["plan"] = plan
  stats["fits"] = stats["error"] is None and stats["need"] <= chip.hbm_bytes
  return stats


def search(model, topology, cap=32768):
  """The longest pair length L (a multiple of 1,024) whose step fits with the kernels:
  doubling from 1,024 until a length does not fit (or `cap`), then bisecting."""
  fits = {}

  def fit(L):
    s = step_stats(model, L, "pallas", topology)
    print(_fmt_step(model, L, "pallas", s), flush=True)
    fits[L] = s["fits"]
    return fits[L]

  L = 1024
  while L < cap and fit(L):
    L *= 2
  if L >= cap and fit(cap):
    return f"{model} on {topology}: every tried pair length fits, up to {cap}."
  lo, hi = L // 2, L
  if lo < 1024 or not fits.get(lo, False):
    return f"{model} on {topology}: not even 1,024 tokens per pair fits."
  while hi - lo > 1024:
    mid = (lo + hi) // 2 // 1024 * 1024
    lo, hi = (mid, hi) if fit(mid) else (lo, mid)
  return (f"Longest pair length whose {model} step fits {topology} with the kernels (to "
          f"1,024 tokens): {lo}; {hi} does not fit.")


def _fmt_step(model, L, impl, s):
  r = s["plan"].rows
  if s["error"] is not None:
    return (f"| {model} | {L} | {r.rows} x {r.length} | {impl} | - | - | no: "
            f"{s['error'][:110]} |")
  return (f"| {model} | {L} | {r.rows} x {r.length} | {impl} | {s['temp'] / GiB:.2f} | "
          f"{s['need'] / GiB:.2f} | {'yes' if s['fits'] else 'no'} |")


def layer_table(chip, lengths):
  lines = [f"One layer's attention, forward + backward, one TPU {chip} chip (shared row: "
           f"T/3 prompt, T/3 chosen, T/3 rejected; {H} heads, {KV} KV heads, head dim {K}, "
           "bf16). Flops and bytes from the compiler's cost analysis (the kernels': their "
           "cost_estimate, causal tiles), MiB from its memory analysis.", "",
           "| T | impl | GFLOP | bytes accessed (MiB) | temporaries (MiB) | peak (MiB) |",
           "|---|---|---|---|---|---|"]
  for T in lengths:
    for impl in ("pallas", "xla"):
      s = layer_stats(chip, T, impl)
      row = (f"| {T} | {impl} | - | - | - | no: {s['error']} |" if "error" in s else
             f"| {T} | {impl} | {s['flops'] / 1e9:.1f} | {s['bytes_accessed'] / MiB:.0f} | "
             f"{s['temp'] / MiB:.0f} | {(s['peak'] or 0) / MiB:.0f} |")
      print(row, flush=True)
      lines.append(row)
  return lines


def grid_table(lengths, head_dims=(64, 128, 256)):
  """The kernels' forward + backward (impl="pallas", a shared row, bf16) compiled for
  every generation, T and head dim: the compiled peak, MiB."""
  lines = ["The kernels' forward + backward compiled for every generation (one chip, a "
           f"shared row of T tokens, {H} heads, {KV} KV heads, bf16): the compiler's peak, "
           "MiB (or its refusal).", "",
           "| chip | T | " + " | ".join(f"head dim {k}" for k in head_dims) + " |",
           "|---|---|" + "---|" * len(head_dims)]
  for chip in tpu.CHIPS:
    for T in lengths:
      cells = []
      for head_dim in head_dims:
        s = layer_stats(chip, T, "pallas", head_dim)
        cells.append(f"no: {s['error'][:60]}" if "error" in s else
                     f"{(s['peak'] or 0) / MiB:.0f}")
      lines.append(f"| {chip} | {T} | " + " | ".join(cells) + " |")
      print(lines[-1], flush=True)
  return lines


def step_table(models, step_lengths, topology, search_too):
  lines = [f"The DPO step on {topology} (FSDP, bf16 compute, `--remat=full`, "
           "precomputed reference, one pair per chip, prefix-shared rows of the flags' "
           "worst case: every pair L tokens, half of them prompt). GiB per chip; "
           "`needed` is what the fit is judged on (the compiler's buffer assignment).", "",
           "| model | L | rows | attention | temporaries | needed | fits |",
           "|---|---|---|---|---|---|---|"]
  for model in models:
    for L in step_lengths:
      for impl in ("xla", "pallas"):
        row = _fmt_step(model, L, impl, step_stats(model, L, impl, topology))
        print(row, flush=True)
        lines.append(row)
  for model in models if search_too else ():
    lines.append("\n" + search(model, topology))
    print(lines[-1].strip(), flush=True)
  return lines


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--parts", default="layer,step", help="any of layer, grid, step")
  p.add_argument("--chip", default="v5e")
  p.add_argument("--lengths", default="1024,2048,4096,8192")
  p.add_argument("--grid_lengths", default="1024,4096,8192")
  p.add_argument("--step_models", default="7b")
  p.add_argument("--step_lengths", default="1024,4096")
  p.add_argument("--search", action="store_true")
  p.add_argument("--topology", default="v5e-8")
  p.add_argument("--out", default=None)
  a = p.parse_args()
  if not aot_tpu.has_libtpu():
    raise SystemExit("needs libtpu (the `tpu` extra)")
  ints = lambda text: [int(x) for x in text.split(",")]
  parts = {
      "layer": lambda: layer_table(a.chip, ints(a.lengths)),
      "grid": lambda: grid_table(ints(a.grid_lengths)),
      "step": lambda: step_table(a.step_models.split(","), ints(a.step_lengths),
                                 a.topology, a.search)}
  lines = []
  for part in a.parts.split(","):
    lines += parts[part]() + [""]
  if a.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    versions = (f"jax {jax.__version__}, libtpu "
                f"{importlib.metadata.version('libtpu')}")
    with open(a.out, "w") as f:
      f.write(f"Attention on shared rows: the Pallas kernels against the XLA path "
              f"(`benchmarks/attention.py --parts {a.parts}`, measured at commit {commit} "
              f"with {versions}).\n\n")
      f.write("\n".join(lines).rstrip() + "\n")


if __name__ == "__main__":
  main()
