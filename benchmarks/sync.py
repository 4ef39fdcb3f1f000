"""Gradient sync of the `125m` preset's gradient tree on 8 simulated CPU devices.

    python benchmarks/sync.py [--preset 125m] [--bucket_mb 25] [--repeats 3]

Times (median of interleaved runs) a full data-parallel sync that leaves every device
with the mean gradient: bucketed reduce-scatter + all-gather (`xla` and `ring`), one
`pmean` per leaf, and one `pmean` of everything concatenated. Prints the collective
count of each compiled program, the bytes each device sends under a bandwidth-optimal
ring schedule, and the optimizer-state bytes per device for ZeRO vs replicated AdamW.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from tunix_core import model  # noqa: E402
from tunix_core.parallel import collectives  # noqa: E402
from tunix_core.parallel import zero  # noqa: E402


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", default="125m")
  p.add_argument("--bucket_mb", type=float, default=25)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()

  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("data",))
  cfg = model.preset(args.preset)
  shapes = jax.eval_shape(lambda: model.init_params(jax.random.PRNGKey(0), cfg))
  plan = collectives.BucketPlan.create(shapes, n, int(args.bucket_mb * 2**20))
  num_params = sum(x.size for x in jax.tree.leaves(shapes))
  grad_bytes = 4 * num_params

  # Per-device gradients: a leading [n] axis split over "data", made on the devices.
  stacked = jax.jit(lambda k: jax.tree.map(
      lambda s: jax.random.normal(k, (n,) + s.shape, s.dtype), shapes),
      out_shardings=NamedSharding(mesh, P("data")))(jax.random.PRNGKey(0))

  def sync_fn(body):
    return jax.jit(jax.shard_map(lambda g: body(jax.tree.map(lambda x: x[0], g)), mesh=mesh,
                                 in_specs=P("data"), out_specs=P(), check_vma=False))

  def bucketed(impl):
    def body(g):
      shards = collectives.reduce_scatter(g, plan, "data", impl=impl)
      return collectives.all_gather(shards, plan, "data", impl=impl)
    return body

  def per_leaf(g):
    return jax.tree.map(lambda x: jax.lax.pmean(x, "data"), g)

  def one_psum(g):
    leaves, treedef = jax.tree.flatten(g)
    flat = jax.lax.pmean(jnp.concatenate([x.reshape(-1) for x in leaves]), "data")
    sizes = np.cumsum([x.size for x in leaves])[:-1]
    return jax.tree.unflatten(treedef, [
        part.reshape(x.shape) for part, x in zip(jnp.split(flat, sizes), leaves)])

  ring_bytes = 2 * (n - 1) / n
  padded = 4 * sum(plan.bucket_size(b) for b in range(plan.num_buckets))
  variants = {
      "bucketed xla": (sync_fn(bucketed("xla")), ring_bytes * padded),
      "bucketed ring": (sync_fn(bucketed("ring")), ring_bytes * padded),
      "per-leaf psum": (sync_fn(per_leaf), ring_bytes * grad_bytes),
      "one psum": (sync_fn(one_psum), ring_bytes * grad_bytes),
  }
  counts = {}
  for name, (fn, _) in variants.items():
    hlo = fn.lower(stacked).compile().as_text()
    # Ops XLA combined into one tuple-shaped collective count once.
    counts[name] = sum(len(re.findall(rf" {op}(?:-start)?\(", hlo)) for op in (
        "all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all"))
    jax.block_until_ready(fn(stacked))  # warm up
  times = {name: [] for name in variants}
  for _ in range(args.repeats):
    for name, (fn, _) in variants.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(stacked))
      times[name].append(time.perf_counter() - t0)

  print(f"{args.preset}: {num_params:,} params, {len(plan.shapes)} leaves, "
        f"{plan.num_buckets} buckets of <= {args.bucket_mb} MiB, {n} devices")
  print(f"{'sync':>14} {'median ms':>10} {'collectives':>12} {'MiB sent/device':>16}")
  rows = {}
  for name, (_, sent) in variants.items():
    med = statistics.median(times[name])
    rows[name] = {"median_s": med, "collectives": counts[name], "bytes_sent": sent}
    print(f"{name:>14} {med * 1e3:10.1f} {counts[name]:12d} {sent / 2**20:16.1f}")

  tx = optax.adamw(1e-3)
  opt = zero.ShardedOptimizer(tx, plan, "data")
  local_state = jax.eval_shape(jax.shard_map(
      lambda p: opt.init(p), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), shapes)
  per_device = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(local_state))
  replicated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
      jax.eval_shape(tx.init, shapes)))
  print(f"adamw state per device: ZeRO {per_device / 2**20:.1f} MiB, replicated "
        f"{replicated / 2**20:.1f} MiB ({replicated / per_device:.3f}x)")
  print(json.dumps({"preset": args.preset, "devices": n, "buckets": plan.num_buckets,
                    "sync": rows, "opt_state_bytes_per_device": per_device,
                    "opt_state_bytes_replicated": replicated}))


if __name__ == "__main__":
  main()
