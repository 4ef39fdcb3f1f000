"""Measures the kernels' candidate tiles on a TPU chip and writes the fastest per case as
the generation's table, `kernels/{attention,logprobs}/tuned/{chip}.json`, which the
package's `BlockSizes.get_default` reads (shipped in the wheel).

    python benchmarks/tune_tiles.py [attention]            # on the chip: writes the table
    python benchmarks/tune_tiles.py logprobs               # the log-prob heads' table
    python benchmarks/tune_tiles.py --dry_run --out T.json   # tiny, interpret mode (CPU)

Attention: each case is `b` causal rows of `T` tokens (`b = max(1, --tokens // T)`, so a
case holds about as many tokens as the step's batch), `--heads` query heads over
`--kv_heads`, head dim `K`, bf16; forward + backward (`jax.vjp`) of
`attention.attention` with `impl="pallas"` and each candidate `BlockSizes` that fits the
chip (past its default scoped VMEM with the limit raised), checked against the
blockwise XLA path and timed interleaved (the median of `--repeats`). The trainer's rows
share prompts and pack pairs, so their tiles are skipped more than a causal row's: the
table is a measured default for rows of that length, not the optimum of every row.

Log-probs: each case is a head `hidden [N, D] @ weight [D, V]` (bf16, `--lm_heads`); the
forward's tiles are timed on the forward alone, then the fused backward's on forward +
backward with the fastest forward tiles, each checked against the chunked XLA path.

The entry keeps every candidate's time beside the choice, and when and on what it was
measured (`measured`); the table is rewritten after each entry, and `--merge` keeps its
entries of the cases not measured now.
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

import on_chip  # benchmarks/on_chip.py: `measure`, the interleaved timer
import tunix_kernels
from tunix_kernels import attention as attention_lib
from tunix_kernels import common
from tunix_kernels import tpu
from tunix_kernels.attention import blocks as attention_blocks
from tunix_kernels.logprobs import blocks as logprobs_blocks

TOLERANCE = 2e-2  # relative error against the XLA path, bf16 inputs
# Beyond the default rules' candidates: tiles that need the scoped VMEM limit raised.
LARGE_ATTENTION = ((2048, 1024), (1024, 2048), (1024, 1024), (2048, 512), (512, 2048),
                   (1024, 512), (512, 1024))
# Log-probs: the large heads' candidates (small tiles never win there), capped at the head.
FORWARD = ((2048, 1024), (2048, 512), (1024, 1024), (1024, 512), (512, 1024), (512, 512))
BACKWARD = ((512, 2048), (512, 1024), (256, 4096), (256, 2048), (256, 1024), (1024, 1024),
            (512, 512), (128, 1024))


def _fastest(rows: dict, tiles: dict, what: str):
  """The name of the fastest of `tiles` whose values and gradients agree with the
  reference; RuntimeError when none ran."""
  timed = {name: r for name, r in rows.items() if name in tiles and "ms" in r
           and r.get("value_err", 0) < TOLERANCE
           and max(r.get("grad_errs") or [0]) < TOLERANCE}
  if not timed:
    raise RuntimeError(f"no candidate ran at {what}: {rows}")
  return min(timed, key=lambda name: timed[name]["ms"])


def _times(rows: dict) -> dict:
  return {name: round(r["ms"], 4) for name, r in rows.items() if "ms" in r}


def case(t: int, b: int, h: int, kv: int, kdim: int, chip, repeats: int, interpret: bool):
  """One attention entry: every candidate's time for `b` causal rows of `t` tokens."""
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

  # The tiles `get_default` chooses from and the larger ones a table may name, their
  # VMEM limit raised (capped at the row: some repeat), that fit.
  tiles = {f"{bs.block_q}x{bs.block_k}": bs for bs in attention_lib.BlockSizes.fitting(
      kdim, jnp.bfloat16, chip, t, LARGE_ATTENTION + attention_blocks.CANDIDATES,
      raised=True, groups=h // kv)}
  fns = {name: fn("interpret" if interpret else "pallas", bs) for name, bs in tiles.items()}
  rows = on_chip.measure(dict(fns, xla=fn("xla")), (q, kk, vv, g), repeats, chip, "xla")
  best = tiles[_fastest(rows, tiles, f"T={t}, K={kdim}")]
  return dict(head_dim=kdim, dtype="bfloat16", seq_len=t, rows=b, heads=h, kv_heads=kv,
              block_q=best.block_q, block_k=best.block_k, ms=_times(rows),
              errors={name: r["error"] for name, r in rows.items() if "error" in r})


def logprobs_entry(n: int, d: int, v: int, chip, repeats: int, interpret: bool):
  """One log-prob entry: the forward's candidate tiles on the forward, then the fused
  backward's on forward + backward, for `hidden [n, d] @ weight [d, v]`."""
  dtype, Tiles = jnp.bfloat16, logprobs_blocks.BlockSizes
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  args = (jax.random.normal(k[0], (n, d), jnp.float32).astype(dtype),
          (jax.random.normal(k[1], (d, v), jnp.float32) / d ** 0.5).astype(dtype),
          jax.random.randint(k[2], (n,), 0, v), jax.random.normal(k[3], (n,), jnp.float32))
  kernel = "interpret" if interpret else "pallas"
  room = (chip.vmem_bytes if chip else tpu.MIN_SCOPED_VMEM_BYTES) * tpu.VMEM_HEADROOM
  # Capped as `get_default` caps: at N and V rounded up to the TPU tiling.
  n_cap, v_cap = common.round_up(n, 16), common.round_up(v, 128)
  cap = lambda bn, bv: (min(bn, n_cap), min(bv, v_cap))

  def fn(impl, bs, backward):
    def f(h, w, t, g):
      logp = lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl=impl, block_sizes=bs)
      if not backward:
        return logp(h, w), []
      value, vjp = jax.vjp(logp, h, w)
      return value, vjp(g)
    return f

  # From the rule's tiles (not a table's), fused: the stages time the fused backward.
  default = Tiles.get_default(d, dtype, chip, num_tokens=n, vocab_size=v, measured=False)
  stages, best = {}, dataclasses.replace(default, block_d=None)
  for stage, candidates in (
      ("forward", FORWARD), ("backward", BACKWARD)):
    fields = ("block_n", "block_v") if stage == "forward" else ("block_n_bwd", "block_v_bwd")
    tiles = {}
    for c in dict.fromkeys(cap(*c) for c in candidates):
      bs = dataclasses.replace(best, **dict(zip(fields, c))).raised(d, dtype, chip)
      if bs.vmem_bytes(d, dtype) <= room:
        tiles[f"{c[0]}x{c[1]}"] = bs
    fns = {name: fn(kernel, bs, stage == "backward") for name, bs in tiles.items()}
    rows = on_chip.measure(dict(fns, xla=fn("xla", None, stage == "backward")), args,
                           repeats, chip, "xla")
    best = tiles[_fastest(rows, tiles, f"{stage} N={n} D={d} V={v}")]
    stages[stage] = rows
  return dict(d_model=d, dtype="bfloat16", num_tokens=n, vocab_size=v,
              block_n=best.block_n, block_v=best.block_v, block_n_bwd=best.block_n_bwd,
              block_v_bwd=best.block_v_bwd,
              rule=[default.block_n, default.block_v, default.block_d,
                    *default.backward_tiles],
              ms_forward=_times(stages["forward"]), ms=_times(stages["backward"]),
              errors={f"{stage} {name}": r["error"] for stage, rows in stages.items()
                      for name, r in rows.items() if "error" in r})


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("op", nargs="?", default="attention", choices=("attention", "logprobs"))
  p.add_argument("--head_dims", default="64,128", help="attention: K per head")
  p.add_argument("--seq_lens", default="1280,2048,8192", help="attention: T per row")
  p.add_argument("--tokens", type=int, default=10240, help="attention: tokens per case")
  p.add_argument("--heads", type=int, default=12, help="attention: query heads")
  p.add_argument("--kv_heads", type=int, default=4, help="attention: KV heads")
  p.add_argument("--lm_heads", default="8192:4096:128256,4096:8192:128256,"
                 "8192:2048:128256,8192:1536:151936", help="log-probs: N:D:V,...")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--out", help="the table (default on a chip: kernels/OP/tuned/{chip}.json; "
                 "required with --dry_run)")
  p.add_argument("--merge", action="store_true", help="keep the table's entries of other "
                 "cases (head dim and row length; D and V)")
  p.add_argument("--dry_run", action="store_true", help="tiny shapes in interpret mode (CPU)")
  a = p.parse_args()
  chip = tpu.target_chip()
  if chip is None and not a.dry_run:
    sys.exit("benchmarks/tune_tiles.py runs on a TPU chip (or --dry_run on CPU)")
  if a.dry_run and not a.out:
    sys.exit("benchmarks/tune_tiles.py: --dry_run needs --out (no table of a CPU ships)")
  name = chip.name if chip else "dry_run"
  repeats = 1 if a.dry_run else a.repeats
  if a.op == "attention":
    out = a.out or os.path.join(attention_blocks.TUNED_DIR, f"{name}.json")
    shapes = ([(64, 256, 1, 4, 2)] if a.dry_run else
              [(k, t, max(1, a.tokens // t), a.heads, a.kv_heads)
               for k in map(int, a.head_dims.split(","))
               for t in map(int, a.seq_lens.split(","))])
    cases = (case(t, b, h, kv, kdim, chip, repeats, a.dry_run)
             for kdim, t, b, h, kv in shapes)
    how = ("forward + backward of b causal rows, the median of the interleaved repeats; "
           "block_q/block_k the fastest")
  else:
    out = a.out or os.path.join(logprobs_blocks.TUNED_DIR, f"{name}.json")
    heads = ([(64, 256, 512)] if a.dry_run else
             [tuple(map(int, x.split(":"))) for x in a.lm_heads.split(",")])
    cases = (logprobs_entry(n, d, v, chip, repeats, a.dry_run) for n, d, v in heads)
    how = ("the forward's tiles timed on the forward, then the fused backward's on "
           "forward + backward, the median of the interleaved repeats")
  key = ((lambda e: (e["head_dim"], e["dtype"], e["seq_len"])) if a.op == "attention"
         else (lambda e: (e["d_model"], e["dtype"], e["vocab_size"])))
  kept = []
  if a.merge and os.path.exists(out):
    with open(out, encoding="utf-8") as f:
      kept = json.load(f)["entries"]
  device = jax.devices()[0]
  measured = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                  platform_version=getattr(device.client, "platform_version", ""))
  entries = []
  for entry in cases:  # the table rewritten after each entry: a cut-off run keeps its own
    entries.append(dict(entry, measured=measured))
    print(json.dumps(entry), flush=True)
    done = set(map(key, entries))
    table = dict(chip=name, device_kind=device.device_kind, **measured,
                 how=f"benchmarks/tune_tiles.py {a.op}: " + how,
                 entries=[e for e in kept if key(e) not in done] + entries)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
      json.dump(table, f, indent=1)
      f.write("\n")
  print(f"wrote {out}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
