"""Memory and CPU time of `fused_logprobs` forward+backward: `xla` vs `naive`.

    python benchmarks/logprobs.py [--mem_n 8192 --mem_d 2048 --mem_v 128256]
                                  [--time_n 2048 --time_d 512 --time_v 32000 --repeats 7]

Memory is XLA's compiled memory analysis (temporary buffers, exact and repeatable);
time is the median wall time of interleaved runs on this machine's devices.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

import tunix_kernels


def loss_and_grads(impl):
  def loss(h, w, t, g):
    return jnp.sum(tunix_kernels.fused_logprobs(h, w, t, impl=impl) * g)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def shapes(N, D, V, dtype):
  return (jax.ShapeDtypeStruct((N, D), dtype), jax.ShapeDtypeStruct((D, V), dtype),
          jax.ShapeDtypeStruct((N,), jnp.int32), jax.ShapeDtypeStruct((N,), jnp.float32))


def temp_bytes(impl, N, D, V, dtype):
  compiled = loss_and_grads(impl).lower(*shapes(N, D, V, dtype)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mem_n", type=int, default=8192)
  p.add_argument("--mem_d", type=int, default=2048)
  p.add_argument("--mem_v", type=int, default=128256)
  p.add_argument("--time_n", type=int, default=2048)
  p.add_argument("--time_d", type=int, default=512)
  p.add_argument("--time_v", type=int, default=32000)
  p.add_argument("--repeats", type=int, default=7)
  args = p.parse_args()
  results = {"device": jax.devices()[0].device_kind, "memory": [], "time": {}}

  N, D, V = args.mem_n, args.mem_d, args.mem_v
  print(f"compiled temporary memory, forward+backward, N={N} D={D} V={V}")
  print(f"{'dtype':>9} {'naive MiB':>10} {'xla MiB':>9} {'ratio':>7}")
  for dtype in (jnp.float32, jnp.bfloat16):
    naive, xla = (temp_bytes(impl, N, D, V, dtype) for impl in ("naive", "xla"))
    print(f"{jnp.dtype(dtype).name:>9} {naive / 2**20:10.1f} {xla / 2**20:9.1f} "
          f"{naive / xla:6.1f}x")
    results["memory"].append({"dtype": jnp.dtype(dtype).name, "naive_bytes": naive,
                              "xla_bytes": xla, "ratio": naive / xla})

  N, D, V = args.time_n, args.time_d, args.time_v
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  inputs = (jax.random.normal(k[0], (N, D)), jax.random.normal(k[1], (D, V)) / D ** 0.5,
            jax.random.randint(k[2], (N,), 0, V), jax.random.normal(k[3], (N,)))
  fns = {impl: loss_and_grads(impl) for impl in ("naive", "xla")}
  times = {impl: [] for impl in fns}
  for fn in fns.values():
    jax.block_until_ready(fn(*inputs))  # compile
  for _ in range(args.repeats):
    for impl, fn in fns.items():  # interleaved, so drift hits both alike
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*inputs))
      times[impl].append(time.perf_counter() - t0)
  med = {impl: statistics.median(ts) for impl, ts in times.items()}
  print(f"\nwall time, forward+backward, f32, N={N} D={D} V={V}, median of {args.repeats}")
  for impl in fns:
    print(f"{impl:>9}: {med[impl] * 1e3:8.1f} ms")
  print(f"xla / naive: {med['xla'] / med['naive']:.2f}x")
  results["time"] = {"shape": [N, D, V], "median_s": med,
                     "ratio": med["xla"] / med["naive"]}
  print(json.dumps(results))


if __name__ == "__main__":
  main()
