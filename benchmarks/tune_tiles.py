"""Measures the attention kernels' candidate tiles on a TPU chip and writes the fastest per
case as the generation's table, `kernels/attention/tuned/{chip}.json`, which
`tunix_kernels.attention.BlockSizes.get_default` reads (shipped in the wheel).

    python benchmarks/tune_tiles.py                       # on the chip: writes the table
    python benchmarks/tune_tiles.py --dry_run --out T.json   # tiny, interpret mode (CPU)

Each case is `b` causal rows of `T` tokens (`b = max(1, --tokens // T)`, so a case holds
about as many tokens as the step's batch), `--heads` query heads over `--kv_heads`,
head dim `K`, bf16; forward + backward (`jax.vjp`) of `attention.attention` with
`impl="pallas"` and each candidate `BlockSizes` that fits the chip's scoped VMEM,
compiled once, checked against the blockwise XLA path and timed interleaved (the median
of `--repeats`). The entry keeps every candidate's time beside the choice. The trainer's
rows share prompts and pack pairs, so their tiles are skipped more than a causal row's:
the table is a measured default for rows of that length, not the optimum of every row.
"""

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

import on_chip  # benchmarks/on_chip.py: `measure`, the interleaved timer
from tunix_kernels import attention as attention_lib
from tunix_kernels import tpu
from tunix_kernels.attention import blocks as attention_blocks

TOLERANCE = 2e-2  # relative error against the XLA path, bf16 inputs


def case(t: int, b: int, h: int, kv: int, kdim: int, chip, repeats: int, interpret: bool):
  """One table entry: every candidate's time for `b` causal rows of `t` tokens."""
  keys = jax.random.split(jax.random.PRNGKey(1), 4)
  q, g = (jax.random.normal(k, (b, t, h, kdim), jnp.float32).astype(jnp.bfloat16)
          for k in (keys[0], keys[3]))
  kk, vv = (jax.random.normal(k, (b, t, kv, kdim), jnp.float32).astype(jnp.bfloat16)
            for k in keys[1:3])
  vis = attention_lib.Visibility(positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32),
                                                            (b, t)),
                                 valid=jnp.ones((b, t), jnp.int32))

  def fn(impl, block_sizes=None):
    def f(q, kk, vv, g):
      att = lambda q, kk, vv: attention_lib.attention(q, kk, vv, vis, scale=kdim ** -0.5,
                                                      impl=impl, block_sizes=block_sizes)
      value, vjp = jax.vjp(att, q, kk, vv)
      return value, vjp(g)
    return f

  # The tiles `get_default` chooses from (capped at the row: some repeat), that fit.
  tiles = {f"{bs.block_q}x{bs.block_k}": bs
           for bs in attention_lib.BlockSizes.fitting(kdim, jnp.bfloat16, chip, t)}
  fns = {name: fn("interpret" if interpret else "pallas", bs) for name, bs in tiles.items()}
  rows = on_chip.measure(dict(fns, xla=fn("xla")), (q, kk, vv, g), repeats, chip, "xla")
  # Only tiles whose values and gradients agree with the XLA path may be chosen.
  timed = {name: r for name, r in rows.items() if name in tiles and "ms" in r
           and r.get("value_err", 0) < TOLERANCE and max(r.get("grad_errs", [0])) < TOLERANCE}
  if not timed:
    raise RuntimeError(f"no candidate ran at T={t}, K={kdim}: {rows}")
  best = tiles[min(timed, key=lambda name: timed[name]["ms"])]
  return dict(head_dim=kdim, dtype="bfloat16", seq_len=t, rows=b, heads=h, kv_heads=kv,
              block_q=best.block_q, block_k=best.block_k,
              ms={name: round(r["ms"], 4) for name, r in rows.items() if "ms" in r},
              errors={name: r["error"] for name, r in rows.items() if "error" in r})


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--head_dims", default="64,128")
  p.add_argument("--seq_lens", default="1280,2048,8192", help="T per row")
  p.add_argument("--tokens", type=int, default=10240, help="tokens per case (rows x T)")
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--kv_heads", type=int, default=4)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--out", help="the table (default on a chip: kernels/attention/tuned/"
                 "{chip}.json; required with --dry_run)")
  p.add_argument("--dry_run", action="store_true", help="tiny shapes in interpret mode (CPU)")
  a = p.parse_args()
  chip = tpu.target_chip()
  if chip is None and not a.dry_run:
    sys.exit("benchmarks/tune_tiles.py runs on a TPU chip (or --dry_run on CPU)")
  if a.dry_run and not a.out:
    sys.exit("benchmarks/tune_tiles.py: --dry_run needs --out (no table of a CPU ships)")
  name = chip.name if chip else "dry_run"
  out = a.out or os.path.join(attention_blocks.TUNED_DIR, f"{name}.json")
  shapes = ([(64, 256, 1, 4, 2)] if a.dry_run else
            [(k, t, max(1, a.tokens // t), a.heads, a.kv_heads)
             for k in map(int, a.head_dims.split(",")) for t in map(int, a.seq_lens.split(","))])
  entries = []
  for kdim, t, b, h, kv in shapes:
    entries.append(case(t, b, h, kv, kdim, chip, 1 if a.dry_run else a.repeats, a.dry_run))
    print(json.dumps(entries[-1]), flush=True)
  table = dict(chip=name, device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
               platform_version=getattr(jax.devices()[0].client, "platform_version", ""),
               date=datetime.date.today().isoformat(),
               how="benchmarks/tune_tiles.py: forward + backward of b causal rows, the "
                   "median of the interleaved repeats; block_q/block_k the fastest",
               entries=entries)
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(table, f, indent=1)
    f.write("\n")
  print(f"wrote {out}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
