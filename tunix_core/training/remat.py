"""Rematerialisation policies in the order `--remat=auto` tries them, and what a device
may hold (`training.fit` chooses among them with `--grad_accum_steps`).

`none` keeps every activation for the backward, `dots` only the matmul outputs,
`attention` only what attention's backward needs (the MLP recomputed), `full` each
layer's input (its forward recomputed). `offload` and `full_prefetch` are never chosen:
they are given by name.
"""

CANDIDATES = ("none", "dots", "attention", "full")  # cheapest first


def capacity(devices) -> int | None:
  """Bytes one device may hold: a TPU's `bytes_limit`, else None (CPU and GPU devices:
  host memory, or an unknown bound; `--device_memory_gib` sets one)."""
  if devices[0].platform != "tpu":
    return None
  return (devices[0].memory_stats() or {}).get("bytes_limit")
