"""`fused_logprobs` forward+backward compiled ahead of time for TPU generations, on a host
without a TPU, against the 6 N D V roofline: ours (`impl="auto"`, default tiles), XLA's
logits (`impl="naive"`, which holds `[N, V]`) where they fit the chip, and Tokamax's
`linear_softmax_cross_entropy_loss` (`mosaic_tpu`) where it compiles.

    python benchmarks/logprobs_tpu.py [--chips v4,v5e,v5p,v6e] [--n 4096,16384]
        [--d 2048,4096,8192] [--v 32000,128256,256000] [--dtype bfloat16]
        [--compare naive,tokamax] [--json out.jsonl]

Needs `libtpu` (`pip install -e '.[tpu]'`); runs with `JAX_PLATFORMS=cpu`; Tokamax needs
Python >= 3.12 (`pip install tokamax`). Nothing is allocated or run: each case is lowered
with `jax.ShapeDtypeStruct` inputs under a mesh of one device of the chip and compiled by
the real TPU compiler. Columns: FLOPs over N D V and HBM bytes from the compiled cost
analysis (a Pallas kernel reports its `cost_estimate`); the roofline is
`max(flops / peak, bytes / HBM bandwidth)` over the compute bound `6 N D V / peak`
(`tpu.Chip`'s figures); temporaries from the memory analysis, per device.
"""

import argparse
import json
import os
import sys
import time

if __name__ == "__main__":  # before JAX starts; imported by tests, it leaves them alone
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import tunix_kernels  # noqa: E402
from tunix_kernels import tpu  # noqa: E402
from tunix_kernels import aot_tpu  # noqa: E402


def _fwd_bwd(impl, logit_softcap=None):
  def f(h, w, t):
    grad = lambda logp: jax.value_and_grad(lambda h, w: jnp.sum(logp(h, w)),
                                           argnums=(0, 1))(h, w)
    if impl == "tokamax":
      import tokamax  # pylint: disable=g-import-not-at-top
      # Its device check looks at this CPU host; cross-compiling is what it is for.
      with tokamax.config.cross_compile(True):
        return grad(lambda h, w: -tokamax.linear_softmax_cross_entropy_loss(
            h, t, w, reduction="none", implementation="mosaic_tpu"))
    return grad(lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl=impl,
                                                          logit_softcap=logit_softcap))
  return f


def compile_case(chip, n, d, v, dtype, impl, chip_known=True, logit_softcap=None) -> dict:
  """Compiles one case; returns `aot_tpu.compiled_stats` plus `ok`, `seconds`, and `error`
  (the compiler's first line) when it does not compile."""
  shapes = (jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32))
  start = time.perf_counter()
  try:
    stats = aot_tpu.compiled_stats(aot_tpu.compile_for(chip, _fwd_bwd(impl, logit_softcap), *shapes,
                                               chip_known=chip_known))
    stats.update(ok=True)
  except Exception as e:  # pylint: disable=broad-except  (a table row, not a crash)
    stats = dict(ok=False, error=str(e).strip().splitlines()[0][:160])
  stats["seconds"] = time.perf_counter() - start
  return stats


def roofline(stats, chip, n, d, v) -> dict:
  """FLOPs over N D V, the milliseconds of FLOPs and of HBM bytes, and the roofline over
  the 6 N D V bound, from a compiled case's cost analysis."""
  chip = tpu.get_chip(chip)
  flops_s = stats["flops"] / chip.peak_flops
  bytes_s = stats["bytes_accessed"] / chip.hbm_bandwidth
  return dict(flops_ndv=stats["flops"] / (n * d * v), flops_ms=1e3 * flops_s,
              bytes_ms=1e3 * bytes_s,
              ratio=max(flops_s, bytes_s) / (6 * n * d * v / chip.peak_flops))


def _cell(r, chip, n, d, v):
  if not r["ok"]:
    if "HbmOom" in r["error"]:
      return "does not fit (the compiler's HBM check)"
    return f"FAIL: {r['error'][:60]}"
  if r["argument"] + r["output"] + r["temp"] > tpu.get_chip(chip).hbm_bytes:
    return f"does not fit ({(r['argument'] + r['output'] + r['temp']) / 2**30:.0f} GiB)"
  if not r["flops"]:
    return f"{r['temp'] / 2**20:.0f} MiB, no cost estimate"
  f = roofline(r, chip, n, d, v)
  return f"{f['ratio']:.2f}x, {r['temp'] / 2**20:.0f} MiB"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--chips", default=",".join(tpu.CHIPS))
  parser.add_argument("--n", default="4096,16384", help="tokens per device")
  parser.add_argument("--d", default="2048,4096,8192")
  parser.add_argument("--v", default="32000,128256,256000")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--compare", default="naive,tokamax",
                      help="also compile these: naive (XLA's logits), tokamax")
  parser.add_argument("--json", help="append one JSON object per case to this file")
  args = parser.parse_args()
  if not aot_tpu.has_libtpu():
    sys.exit("benchmarks/logprobs_tpu.py needs libtpu: pip install -e '.[tpu]'")
  dtype = jnp.dtype(args.dtype)
  compare = [c for c in args.compare.split(",") if c]
  print(f"# fused_logprobs fwd+bwd ({dtype.name}), compiled ahead of time for one chip "
        f"(jax {jax.__version__}); roofline = max(FLOPs/peak, bytes/HBM) over 6 N D V / "
        "peak, with temporaries per device")
  print("| chip | N | D | V | tiles fwd / bwd | FLOPs / NDV | FLOP ms | HBM ms | roofline | "
        "temp MiB |" + "".join(f" {dict(naive='XLA logits', tokamax='Tokamax')[c]} |"
                                for c in compare))
  print("|---" * (10 + len(compare)) + "|")
  worst = 0.0
  for chip in args.chips.split(","):
    for n in map(int, args.n.split(",")):
      for d in map(int, args.d.split(",")):
        for v in map(int, args.v.split(",")):
          head = f"| {chip} | {n} | {d} | {v} |"
          bs = tunix_kernels.LogprobsBlockSizes.get_default(d, dtype, chip, num_tokens=n,
                                                            vocab_size=v)
          tiles = (f"{bs.block_n}x{bs.block_v} / " + ("{}x{}".format(*bs.backward_tiles)
                                                      if bs.fused else f"split D {bs.block_d}"))
          p = compile_case(chip, n, d, v, dtype, "auto")
          others = {c: compile_case(chip, n, d, v, dtype, c) for c in compare}
          if p["ok"]:
            f = roofline(p, chip, n, d, v)
            if chip != "v4":
              worst = max(worst, f["ratio"])
            ours = (f"{f['flops_ndv']:.2f} | {f['flops_ms']:.1f} | {f['bytes_ms']:.1f} | "
                    f"{f['ratio']:.2f}x | {p['temp'] / 2**20:.0f}")
          else:
            ours = f"FAIL: {p['error'][:80]} | | | |"
          print(f"{head} {tiles} | {ours} |" + "".join(
              f" {_cell(r, chip, n, d, v)} |" for r in others.values()), flush=True)
          if args.json:
            with open(args.json, "a") as out:
              out.write(json.dumps(dict(chip=chip, n=n, d=d, v=v, dtype=dtype.name,
                                        tiles=tiles, ours=p, **others)) + "\n")
  print(f"# worst roofline on v5e, v5p, v6e: {worst:.2f}x the 6 N D V bound")
  return 0


if __name__ == "__main__":
  sys.exit(main())
