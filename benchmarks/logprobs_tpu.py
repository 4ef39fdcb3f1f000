"""`fused_logprobs` forward+backward compiled ahead of time for TPU generations, on a host
without a TPU: Pallas (`impl="auto"`, default tiles) vs the xla path.

    python benchmarks/logprobs_tpu.py [--chips v4,v5e,v5p,v6e] [--n 8192]
        [--d 2048,2304,3072,4096,5120,8192] [--v 32000,128256,151936,256000]
        [--f32_max_d 4096] [--json out.jsonl]

Needs `libtpu` (`pip install -e '.[tpu]'`); runs with `JAX_PLATFORMS=cpu`. Nothing is
allocated or run: each case is lowered with `jax.ShapeDtypeStruct` inputs under a mesh
of one device of the chip and compiled by the real TPU compiler, and the table prints
its per-device memory analysis (arguments, temporaries) and cost analysis. A case whose
arguments and outputs alone exceed the chip's HBM is reported as such, not compiled.
The xla path's cost analysis counts its vocabulary `lax.scan` body once (XLA does not
multiply loop bodies by their trip count), so its flops and bytes are per chunk.
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


def _fwd_bwd(impl, logit_softcap=None):
  def f(h, w, t):
    loss = lambda h, w: jnp.sum(tunix_kernels.fused_logprobs(h, w, t, impl=impl,
                                                       logit_softcap=logit_softcap))
    return jax.value_and_grad(loss, argnums=(0, 1))(h, w)
  return f


def io_bytes(n, d, v, dtype) -> int:
  """Arguments (hidden, weight, targets) plus outputs (loss, d_hidden, d_weight)."""
  s = jnp.dtype(dtype).itemsize
  return 2 * (n * d + d * v) * s + n * 4 + 4


def compile_case(chip, n, d, v, dtype, impl, chip_known=True, logit_softcap=None) -> dict:
  """Compiles one case; returns `tpu.compiled_stats` plus `ok`, `seconds`, and `error`
  (the compiler's first line) when it does not compile."""
  shapes = (jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32))
  start = time.perf_counter()
  try:
    stats = tpu.compiled_stats(tpu.compile_for(chip, _fwd_bwd(impl, logit_softcap), *shapes,
                                               chip_known=chip_known))
    stats.update(ok=True)
  except Exception as e:  # pylint: disable=broad-except  (a table row, not a crash)
    stats = dict(ok=False, error=str(e).strip().splitlines()[0][:160])
  stats["seconds"] = time.perf_counter() - start
  return stats


def _mib(x):
  return f"{x / 2**20:.0f}"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--chips", default=",".join(tpu.CHIPS))
  parser.add_argument("--n", type=int, default=8192, help="tokens per device")
  parser.add_argument("--d", default="2048,2304,3072,4096,5120,8192")
  parser.add_argument("--v", default="32000,128256,151936,256000")
  parser.add_argument("--f32_max_d", type=int, default=4096,
                      help="also compile float32 for hidden sizes up to this")
  parser.add_argument("--json", help="append one JSON object per case to this file")
  args = parser.parse_args()
  if not tpu.has_libtpu():
    sys.exit("benchmarks/logprobs_tpu.py needs libtpu: pip install -e '.[tpu]'")

  print(f"# fused_logprobs fwd+bwd, N={args.n} per device, compiled ahead of time "
        f"(jax {jax.__version__}); MiB per device; flops/bytes from the cost analysis")
  print("| chip | dtype | D | V | pallas tiles | pallas | pallas temp | xla | xla temp | "
        "args | pallas flops | pallas bytes | xla flops (1 chunk) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  failures = 0
  for chip in args.chips.split(","):
    for dtype in (jnp.bfloat16, jnp.float32):
      for d in map(int, args.d.split(",")):
        if dtype == jnp.float32 and d > args.f32_max_d:
          continue
        for v in map(int, args.v.split(",")):
          name = jnp.dtype(dtype).name
          head = f"| {chip} | {name} | {d} | {v} |"
          if io_bytes(args.n, d, v, dtype) > tpu.get_chip(chip).hbm_bytes:
            print(f"{head} - | exceeds HBM ({_mib(io_bytes(args.n, d, v, dtype))} MiB "
                  "of arguments and outputs) | | | | | | | |", flush=True)
            continue
          bs = tunix_kernels.LogprobsBlockSizes.get_default(d, dtype, chip, num_tokens=args.n,
                                                      vocab_size=v)
          p = compile_case(chip, args.n, d, v, dtype, "auto")
          x = compile_case(chip, args.n, d, v, dtype, "xla")
          tiles = f"{bs.block_n}x{bs.block_v}x{bs.block_d or d}"
          if bs.vmem_limit_bytes:
            tiles += f" @{_mib(bs.vmem_limit_bytes)}M"
          cell = lambda r, key: _mib(r[key]) if r["ok"] else "-"
          ok = lambda r: "ok" if r["ok"] else f"FAIL: {r['error']}"
          print(f"{head} {tiles} | {ok(p)} | {cell(p, 'temp')} | {ok(x)} | {cell(x, 'temp')}"
                f" | {cell(p, 'argument') if p['ok'] else cell(x, 'argument')}"
                f" | {p.get('flops', 0):.3g} | {p.get('bytes_accessed', 0):.3g}"
                f" | {x.get('flops', 0):.3g} |", flush=True)
          failures += not p["ok"] or (x["ok"] and p["temp"] > x["temp"])
          if args.json:
            with open(args.json, "a") as f:
              f.write(json.dumps(dict(chip=chip, dtype=name, d=d, v=v, n=args.n,
                                      tiles=tiles, pallas=p, xla=x)) + "\n")
  print(f"# {failures} case(s) where pallas does not compile or needs more temp than xla")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
