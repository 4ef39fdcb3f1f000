"""`--tpu_flags`: the XLA TPU compiler options every step compiled for TPU gets (a run on
TPU and `--compile_only` for a TPU target alike), passed per compilation
(`jax.jit(..., compiler_options=...)`), never through `LIBTPU_INIT_ARGS`: a process
that compiles for CPU or GPU too is unaffected, and the options are part of the plan.

The default, `auto`, is the overlap set of MaxText's TPU recipes for the chip compiled
for: collectives run asynchronously and fused with the compute around them
(`xla_tpu_enable_async_collective_fusion*`, `xla_tpu_overlap_compute_collective_tc`,
`xla_enable_async_all_gather`), the layer loop's weight gathers pipelined into the
previous trip (`xla_tpu_enable_ici_ag_pipelining`: the forward's gather of layer i + 1
runs under layer i's matmuls), and the data-parallel all-reduce optimisation for what
stays an all-reduce (the slice axis, small replicated leaves). Per generation
(`BY_CHIP`), what makes the weight gathers asynchronous there: on v5e, all-gathers fused
into their continuation (`..._fuse_all_gather`); on v5p and v6e, all-gathers offloaded to
the SparseCores (`xla_tpu_enable_sparse_core_collective_offload_all_gather`), which run
them beside the TensorCores' matmuls. Not the fusion there: jax 0.12's TPU compiler
refuses it off v5e as "not supported/recommended on platforms other than TPU v5e" (it may
give wrong results or hang), and jax 0.10.2's accepted it silently. v4 gets neither (its
compilers ignore the offload). Each name was checked against the TPU compiler of jax
0.10.2 and 0.12 ahead of time; an unknown name aborts the compilation, which
`--compile_only` reports in one line.
"""

from tunix_kernels import tpu

AUTO = "auto"
OVERLAP = " ".join([
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_tpu_enable_ici_ag_pipelining=true",
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
])
# What `auto` adds on a generation: the flag that makes its weight gathers asynchronous.
BY_CHIP = {
    "v5e": "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "v5p": "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "v6e": "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
}


def _value(text: str):
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def options(flags: str, device) -> dict:
  """Compiler options of `--tpu_flags` for a step compiled for TPU `device` (a
  `jax.Device`): `auto` is `OVERLAP` plus its generation's `BY_CHIP` entry."""
  if flags == AUTO:
    kind = getattr(device, "device_kind", "")
    chip = next((c.name for c in tpu.CHIPS.values() if kind in c.device_kinds), None)
    flags = " ".join([OVERLAP] + ([BY_CHIP[chip]] if chip in BY_CHIP else []))
  return parse(flags)


def parse(flags: str) -> dict:
  """`"--name=value ..."` (spaces or commas between; `--name` alone is true) -> compiler
  options `{name: bool | int | float | str}`. ValueError naming a malformed entry."""
  options = {}
  for entry in flags.replace(",", " ").split():
    name, eq, value = entry.partition("=")
    if not name.startswith("--") or not name[2:].replace("_", "").isalnum():
      raise ValueError(f"{entry!r} is not --name=value")
    options[name[2:]] = _value(value) if eq else True
  return options
