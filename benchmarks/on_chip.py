"""The kernels on a real TPU chip: values and gradients against XLA, and measured time
against the roofline of their own compiled cost analysis.

    python benchmarks/on_chip.py logprobs [--heads 8192:4096:128256,...] [--out r.jsonl]
    python benchmarks/on_chip.py attention [--rows 4096,8192] [--head_dims 64,128] [--out r.jsonl]
    python benchmarks/on_chip.py matmul [--products M:K:N,...]   # what the chip sustains
    python benchmarks/on_chip.py --dry_run logprobs   # tiny shapes, interpret mode, CPU

Everything else of ours about a TPU is an ahead-of-time compile; this runs the Mosaic
kernels. Per case, forward + backward of one jitted function (the sum of the op's output
times a fixed random cotangent, differentiated in every input the op takes):

- log-probs (`fused_logprobs`, bf16 hidden `[N, D]` and weight `[D, V]`): `pallas` (the
  default tiles: the fused backward where it fits), `split` (the split backward kernels,
  `LogprobsBlockSizes` with a `block_d`), `xla` (the chunked scan) and `naive` (XLA's
  `[N, V]` logits, where they fit the chip);
- attention (causal GQA rows of one sequence, bf16 `[B, T, H, K]`): `pallas` and `xla`.

Columns: the median wall time of `--repeats` interleaved calls (after one warm-up);
the roofline of the same executable, `max(flops / peak, bytes / HBM bandwidth)` from
its compiled cost analysis (a Pallas kernel reports its `cost_estimate`) and
`tunix_kernels.tpu.Chip`'s figures; log-probs also over the 6 N D V compute bound; the
compiled temporaries; and the error against `naive` (log-probs) or `xla` (attention):
the largest absolute difference of the values over their largest magnitude, and the
norm of each gradient's difference over the reference gradient's norm. With `--oracle`
(as `on_chip.sh` runs it) `pallas`, the default tiles (a generation's tuned table), is
also checked against float64 NumPy on the host (`tests/oracles.py`): the log-probs'
largest absolute error and the hidden states' gradient on 256 sampled rows (the
weight's gradient needs every row's logits: checked on the chip only), attention's
output and gradients for the first KV head's query heads (past `--oracle_full_t` tokens
the output and dq of 256 sampled query rows); gradients as the largest absolute error
over the reference's largest magnitude.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import tunix_kernels
from tunix_kernels import attention as attention_lib
from tunix_kernels import tpu
from tunix_kernels.logprobs import blocks as logprobs_blocks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import oracles  # pylint: disable=g-import-not-at-top,wrong-import-position  (float64 NumPy)
sys.path.pop(0)


def split_tiles(d, dtype, chip, n, v):
  """The default rule's tiles (not a measured table's) with the split backward ranked
  first (it fits wherever the fused one does), as `benchmarks/ladder.py
  --split_backward` compiles them. `get_default` ranks the two backwards only for a known
  chip: the dry run (no chip) takes v5e's."""
  saved = logprobs_blocks.roofline_seconds
  logprobs_blocks.roofline_seconds = lambda bs, *_: float(bs.fused)
  try:
    return tunix_kernels.LogprobsBlockSizes.get_default(d, dtype, chip or "v5e", num_tokens=n,
                                                        vocab_size=v, measured=False)
  finally:
    logprobs_blocks.roofline_seconds = saved


@jax.jit
def _diff(a, b):
  """(norm of a - b, norm of b, max |a - b|, max |b|) in float32, fused on the device:
  host copies of gradients of `[D, V]` would take minutes."""
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return (jnp.sqrt(jnp.sum(jnp.square(a - b))), jnp.sqrt(jnp.sum(jnp.square(b))),
          jnp.max(jnp.abs(a - b)), jnp.max(jnp.abs(b)))


def _errors(out, ref) -> dict:
  (value, grads), (ref_value, ref_grads) = out, ref
  _, _, err, top = map(float, _diff(value, ref_value))
  rel = lambda g, r: (lambda d: float(d[0] / max(d[1], 1e-30)))(_diff(g, r))
  return dict(value_err=err / max(top, 1e-30),
              grad_errs=[rel(g, r) for g, r in zip(grads, ref_grads)])


def measure(fns: dict, args: tuple, repeats: int, chip, reference: str,
            oracle=None) -> dict:
  """Compiles each of `fns` on `args`, checks it against `fns[reference]` (and the names
  in `oracle`, a dict of functions of an output returning more columns, against those),
  and times them interleaved; returns one dict per name (`error` where it did not compile
  or run)."""
  rows, compiled, ref = {}, {}, None
  # The reference first, so each other output is checked as it comes and then dropped:
  # four sets of gradients of a large head do not fit the chip at once.
  for name in sorted(fns, key=lambda name: name != reference):
    try:
      exe = jax.jit(fns[name]).lower(*args).compile()
      cost = exe.cost_analysis()
      cost = cost[0] if isinstance(cost, (list, tuple)) else cost
      mem = exe.memory_analysis()
      out = jax.block_until_ready(exe(*args))  # also the warm-up
      compiled[name] = exe
      rows[name] = dict(flops=float(cost.get("flops", 0.0)),
                        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
                        temp_bytes=int(mem.temp_size_in_bytes) if mem else None)
      if chip is not None:
        rows[name]["roofline_ms"] = 1e3 * max(rows[name]["flops"] / chip.peak_flops,
                                              rows[name]["bytes_accessed"]
                                              / chip.hbm_bandwidth)
      if name == reference:
        ref = out
      elif ref is not None:
        rows[name].update(_errors(out, ref))
      if name in (oracle or {}):
        try:  # a failing host check costs its own columns, not the row
          rows[name].update(oracle[name](out))
        except Exception as e:  # pylint: disable=broad-except
          rows[name]["oracle_error"] = f"{type(e).__name__}: {str(e).strip()[:160]}"
      del out
    except Exception as e:  # pylint: disable=broad-except  (a table row: OOM, refusal)
      rows[name] = dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
  del ref
  times = {name: [] for name in compiled}
  for _ in range(repeats):
    for name, exe in compiled.items():  # interleaved: drift hits every impl alike
      t0 = time.perf_counter()
      jax.block_until_ready(exe(*args))
      times[name].append(time.perf_counter() - t0)
  for name, ts in times.items():
    rows[name]["ms"] = 1e3 * statistics.median(ts)
  return rows


def logprobs_case(n, d, v, impls, chip, repeats, interpret, oracle=False) -> dict:
  """One head: `hidden [n, d]`, `weight [d, v]` (bf16), each of `impls` (module
  docstring; with `interpret`, the kernels in interpret mode), checked against `naive`
  (and with `oracle` the default tiles' kernels against float64 NumPy on sampled rows,
  `_logprobs_oracle`)."""
  dtype = jnp.bfloat16
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  args = (jax.random.normal(k[0], (n, d), jnp.float32).astype(dtype),
          (jax.random.normal(k[1], (d, v), jnp.float32) / d ** 0.5).astype(dtype),
          jax.random.randint(k[2], (n,), 0, v), jax.random.normal(k[3], (n,), jnp.float32))
  kernel = "interpret" if interpret else "pallas"
  tiles = dict(pallas=None, split=split_tiles(d, dtype, chip and chip.name, n, v))

  def fn(impl):
    op = dict(pallas=kernel, split=kernel).get(impl, impl)
    def f(h, w, t, g):
      logp = lambda h, w: tunix_kernels.fused_logprobs(h, w, t, impl=op,
                                                       block_sizes=tiles.get(impl))
      value, vjp = jax.vjp(logp, h, w)
      return value, vjp(g)
    return f

  rows = measure({impl: fn(impl) for impl in impls}, args, repeats, chip, "naive",
                 oracle and {"pallas": functools.partial(_logprobs_oracle, args)})
  bound_ms = 1e3 * 6 * n * d * v / chip.peak_flops if chip else None
  for row in rows.values():
    if "flops" in row:
      row["flops_ndv"] = row["flops"] / (n * d * v)
    if bound_ms and "ms" in row:
      row.update(bound_ms=bound_ms, over_bound=row["ms"] / bound_ms)
  t = tiles["split"]
  return dict(op="logprobs", n=n, d=d, v=v, split_tiles=f"{t.block_n}x{t.block_v} D {t.block_d}",
              impls=rows)


def _rows_sample(n: int) -> np.ndarray:
  """The rows the host oracle checks: the first and last 64 and 128 drawn between."""
  drawn = np.random.default_rng(0).choice(np.arange(64, max(64, n - 64)),
                                          min(128, max(0, n - 128)), replace=False)
  return np.unique(np.concatenate([np.arange(min(64, n)), drawn, np.arange(max(0, n - 64), n)]))


def _logprobs_oracle(args, out) -> dict:
  """The log-probs and the hidden states' gradient of sampled rows against float64 NumPy
  on the host (`tests/oracles.py`; a row's values and gradient depend on its own logits
  alone; the weight's gradient needs every row's logits, compared on the chip only)."""
  h, w, t, g = (np.asarray(x) for x in args)
  (logp, (dh, _)), rows = out, _rows_sample(h.shape[0])
  h64, w64 = h[rows].astype(np.float64), w.astype(np.float64)  # one host copy of the head
  forward = oracles.numpy_logprobs(h64, w64, t[rows])  # the [rows, V] logits once
  want = forward[0]
  want_dh, _ = oracles.numpy_logprob_grads(h64, w64, t[rows], g[rows], weight_grad=False,
                                           forward=forward)
  got, got_dh = np.asarray(logp, np.float64)[rows], np.asarray(dh, np.float64)[rows]
  return dict(oracle_value_abs=float(np.max(np.abs(got - want))),
              oracle_grad_errs=[oracles.rel_error(got_dh, want_dh)])


def _attention_oracle(args, scale, full_t, out) -> dict:
  """The output and gradients of the first KV head's group (its query heads and the KV
  head) against float64 NumPy on the host (`tests/oracles.py`), causal rows; past
  `full_t` tokens (float64 `[heads, T, T]` scores take minutes and gigabytes there) the
  output and dq of 256 sampled query rows, which depend on their own scores alone."""
  q, kk, vv, g = (np.asarray(x).astype(np.float32) for x in args)
  G = q.shape[2] // kk.shape[2]
  b, t = q.shape[:2]
  rows = np.arange(t) if t <= full_t else _rows_sample(t)
  pos, ones = np.broadcast_to(np.arange(t), (b, t)), np.ones((b, t), np.int32)
  mask = oracles.numpy_attention_mask(pos, ones, 0 * ones, 0 * ones, 0)[:, rows]
  want = oracles.numpy_attention(q[:, rows, :G], kk[:, :, :1], vv[:, :, :1], g[:, rows, :G],
                                 mask, scale)
  value, (dq, dk, dv) = out
  got = [np.asarray(x, np.float64) for x in (value[:, rows, :G], dq[:, rows, :G],
                                             dk[:, :, :1], dv[:, :, :1])]
  pairs = list(zip(got[1:], want[1:]))[:3 if t <= full_t else 1]  # dk, dv need every row
  return dict(oracle_value_abs=float(np.max(np.abs(got[0] - want[0]))),
              oracle_grad_errs=[oracles.rel_error(a, b) for a, b in pairs])


def attention_case(t, impls, repeats, interpret, chip, b=1, h=32, kv=8, kdim=128,
                   oracle=0) -> dict:
  """`b` causal rows of `t` tokens, `h` query heads over `kv` KV heads of `kdim` (bf16),
  each of `impls`, checked against `xla` (and with `oracle` > 0 the kernels against
  float64 NumPy for one KV head's group, rows of up to `oracle` tokens whole,
  `_attention_oracle`)."""
  dtype = jnp.bfloat16
  k = jax.random.split(jax.random.PRNGKey(1), 4)
  q = jax.random.normal(k[0], (b, t, h, kdim), jnp.float32).astype(dtype)
  kk, vv = (jax.random.normal(x, (b, t, kv, kdim), jnp.float32).astype(dtype) for x in k[1:3])
  g = jax.random.normal(k[3], (b, t, h, kdim), jnp.float32).astype(dtype)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  vis = attention_lib.Visibility(positions=pos, valid=jnp.ones((b, t), jnp.int32))

  def fn(impl):
    op = "interpret" if (impl == "pallas" and interpret) else impl
    def f(q, kk, vv, g):
      att = lambda q, kk, vv: attention_lib.attention(q, kk, vv, vis, scale=kdim ** -0.5,
                                                      impl=op)
      value, vjp = jax.vjp(att, q, kk, vv)
      return value, vjp(g)
    return f

  rows = measure({impl: fn(impl) for impl in impls}, (q, kk, vv, g), repeats, chip, "xla",
                 oracle and {"pallas": functools.partial(_attention_oracle, (q, kk, vv, g),
                                                         kdim ** -0.5, oracle)})
  return dict(op="attention", b=b, t=t, h=h, kv=kv, head_dim=kdim, impls=rows)


def matmul_case(m, k, n, repeats, chip) -> dict:
  """What the chip sustains on one bf16 product `[m, k] @ [k, n]` (float32 accumulation,
  bf16 out), the MFU ceiling of the step's matmuls of these shapes."""
  ka, kb = jax.random.split(jax.random.PRNGKey(2))
  a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(kb, (k, n), jnp.float32).astype(jnp.bfloat16)
  rows = measure({"xla": lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32
                                             ).astype(jnp.bfloat16)}, (a, b), repeats, chip,
                 "xla")
  if "ms" in rows["xla"]:
    rows["xla"]["tflops"] = 2 * m * k * n / rows["xla"]["ms"] * 1e-9
  return dict(op="matmul", m=m, k=k, n=n, impls=rows)


def _print(case: dict) -> None:
  shape = " ".join(f"{k}={case[k]}" for k in ("m", "k", "n", "d", "v", "b", "t", "h", "kv", "head_dim")
                   if k in case)
  for name, r in case["impls"].items():
    if "error" in r:
      print(f"{case['op']} {shape} {name}: {r['error']}", flush=True)
      continue
    extra = "".join(f" {k}={r[k]:.3g}" for k in ("roofline_ms", "flops_ndv", "over_bound",
                                                 "value_err", "tflops", "oracle_value_abs")
                    if k in r)
    grads = "".join(f" {k}=" + ",".join(f"{e:.2g}" for e in r[k])
                    for k in ("grad_errs", "oracle_grad_errs") if k in r)
    temp = f" temp={r['temp_bytes'] / 2**20:.0f}MiB" if r.get("temp_bytes") is not None else ""
    print(f"{case['op']} {shape} {name}: {r['ms']:.3f} ms{extra}{temp}{grads}", flush=True)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("op", choices=("logprobs", "attention", "matmul"))
  p.add_argument("--heads", default="8192:4096:128256,4096:8192:128256,8192:2048:128256,"
                 "8192:2048:256000,16384:2048:32000", help="N:D:V,...")
  p.add_argument("--impls", default=None, help="default: pallas,split,xla,naive (log-probs), "
                 "pallas,xla (attention)")
  p.add_argument("--rows", default="2048,8192", help="attention: T per row")
  p.add_argument("--head_dims", default="128", help="attention: K per head, e.g. 64,128")
  p.add_argument("--products", default="8192:8192:8192,16384:896:4864,16384:4864:896,"
                 "16384:960:49152,16384:896:151936", help="matmul: M:K:N,...")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--out", help="append one JSON line per case")
  p.add_argument("--oracle", action="store_true", help="also check `pallas` (the default, "
                 "tuned tiles) against float64 NumPy on the host: log-probs on 256 sampled "
                 "rows, attention on one KV head's group (rows of up to --oracle_full_t "
                 "tokens whole, longer ones on 256 sampled query rows)")
  p.add_argument("--oracle_full_t", type=int, default=2048)
  p.add_argument("--dry_run", action="store_true", help="tiny shapes in interpret mode (CPU)")
  a = p.parse_args()
  chip = tpu.target_chip()
  if chip is None and not a.dry_run:
    sys.exit("benchmarks/on_chip.py runs on a TPU chip (or --dry_run on CPU)")
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  if a.op == "logprobs":
    heads = [tuple(map(int, h.split(":"))) for h in a.heads.split(",")]
    if a.dry_run:
      heads = [(64, 256, 512)]
    impls = (a.impls or "pallas,split,xla,naive").split(",")
    cases = (logprobs_case(n, d, v, impls, chip, a.repeats, a.dry_run, a.oracle)
             for n, d, v in heads)
  elif a.op == "matmul":
    products = ([(256, 128, 512)] if a.dry_run
                else [tuple(map(int, x.split(":"))) for x in a.products.split(",")])
    cases = (matmul_case(m, k, n, a.repeats, chip) for m, k, n in products)
  else:
    rows = [256] if a.dry_run else [int(t) for t in a.rows.split(",")]
    impls = (a.impls or "pallas,xla").split(",")
    cases = (attention_case(t, impls, a.repeats, a.dry_run, chip, kdim=kdim,
                            oracle=a.oracle_full_t if a.oracle else 0,
                            **(dict(h=4, kv=2) if a.dry_run else {}))
             for kdim in map(int, a.head_dims.split(",")) for t in rows)
  for case in cases:
    _print(case)
    if a.out:
      with open(a.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(case) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
