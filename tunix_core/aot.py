"""`--compile_only`: the exact train step of a run's flags compiled for a target
topology, and whether it fits, without allocating anything.

With `libtpu` installed, `--target_topology=v5e-8` (or any name in
`kernels.tpu.TOPOLOGIES`) gives the devices of that TPU slice on any host, even with
`JAX_PLATFORMS=cpu`; the step is lowered with `jax.ShapeDtypeStruct` inputs sharded on a
mesh of them and compiled by the real TPU compiler (Pallas kernels included). Nothing is
initialised or loaded: the params, optimizer state, reference and batch are abstract
(with `--precompute_ref_logps` the reference log-probs are an abstract input too), and
`--hf_model_dir` contributes only its `config.json`. Settings are validated against the
target's device count, and `impl="auto"` resolves as that platform would run it.
`--target_topology=local` compiles for this host's devices instead.
"""

import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels import tpu
from tunix_core import model as model_lib
from tunix_core import step as step_lib

GiB = 1 << 30


def target_devices(name: str) -> tuple[tpu.Chip | None, list]:
  """`(chip or None for local devices, devices)` of a `--target_topology`."""
  if name == "local":
    return None, jax.devices()
  if not tpu.has_libtpu():
    raise RuntimeError("compiling for a TPU topology needs libtpu: pip install "
                       "'jax[tpu]' (the `tpu` extra)")
  return tpu.topology_devices(name)


def abstract_inputs(steps: step_lib.StepFunctions) -> tuple:
  """`(state, ref_params, batch)` of `steps.train_step` as sharded ShapeDtypeStructs."""
  cfg, mesh = steps.cfg, steps.mesh
  scalar = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=steps.replicated)
  state = {"params": steps.abstract_params(), "opt_state": steps.abstract_opt_state(),
           "step": scalar(()), "nonfinite": scalar((3,))}
  ref_params = None
  if not (cfg.reference_free or cfg.precompute_ref_logps):
    ref_params = steps.abstract_params(model_lib.DTYPES[cfg.ref_param_dtype()])
  pairs = NamedSharding(mesh, P("data"))
  shape = (cfg.batch_size, 2, cfg.max_length)
  batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=pairs)
           for k in ("tokens", "targets", "loss_mask", "attention_mask")}
  if cfg.precompute_ref_logps:
    batch["ref_logps"] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=pairs)
  return state, ref_params, batch


def _gib(n: int) -> str:
  return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / (1 << 20):.1f} MiB"


def _allocated_in_hbm(dump_dir: str) -> int | None:
  """The bytes the compiler's buffer assignment places in device memory (colour 0) for
  the train step, from the memory-usage report of an XLA dump; None where it has none."""
  for path in glob.glob(os.path.join(dump_dir, "*train_step*memory-usage-report.txt")):
    with open(path) as f:
      found = re.search(r"Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)", f.read())
    if found:
      return int(found.group(1))
  return None


def compile_stats(cfg, target: str, model_config=None, devices=None) -> dict:
  """Compiles `cfg`'s train step for `target` (`model_config` overrides the flags'
  model; `devices`, the target's `(chip, devices)` when known already). Returns `{"chip",
  "devices", "num_params", "error"}` plus, when it compiled, `kernels.tpu.compiled_stats`
  per device, `"total"` (arguments + outputs not in donated arguments + temporaries as
  analysed), `"hbm"` (for a TPU target: the bytes the compiler's buffer assignment
  allocates in HBM, read from an XLA dump into a temporary directory; None where the
  dump lacks it) and `"need"`, what the fit is judged on: `hbm`, else the compiler's
  `peak`, else `total`, but never less than the arguments and outputs the caller holds
  through the step; `"error"` is the compiler's refusal or None.

  Why not `total`: on TPU `temp_size_in_bytes` can exceed the temporaries the buffer
  assignment allocates (for the 7B FSDP step of the README: 7.25 GiB, against one
  preallocated block of 5.40 GiB), so the sum overstates what the chip must hold.
  """
  chip, devices = devices or target_devices(target)
  cfg.validate(len(devices))
  mcfg = model_config or cfg.model_config()
  steps = step_lib.StepFunctions(cfg, step_lib.make_mesh(devices, cfg.model_parallel), mcfg)
  out = {"chip": chip, "devices": devices, "error": None,
         "num_params": sum(x.size for x in jax.tree.leaves(steps.param_shapes))}
  with tempfile.TemporaryDirectory() as dump_dir:
    try:
      with jax.set_mesh(steps.mesh):  # so impl="auto" and the kernel tiles see the target
        compiled = steps.train_step.lower(*abstract_inputs(steps)).compile(
            {"xla_dump_to": dump_dir} if chip is not None else None)
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the answer
      message = str(e)
      lines = [l for l in message.splitlines() if "exceeds" in l or "RESOURCE_EXHAUSTED" in l]
      out["error"] = (lines or message.splitlines() or [""])[0].strip()[:500]
      return out
    hbm = _allocated_in_hbm(dump_dir) if chip is not None else None
  stats = tpu.compiled_stats(compiled)
  total = stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]
  held = stats["argument"] + stats["output"] - stats["alias"]
  out.update(stats, total=total, hbm=hbm, need=max(hbm or stats["peak"] or total, held))
  return out


def compile_only(cfg, target: str, log=print) -> int:
  """Compiles `cfg`'s train step for `target`; logs per-device memory and the cost
  analysis. Returns the exit status: 0 if it compiles and fits the chip's HBM, 1 if
  the compiler refuses it (its message logged) or what it needs (`compile_stats`'
  "need") exceeds HBM."""
  chip, devices = target_devices(target)
  where = f"{target} ({len(devices)} x {devices[0].device_kind})"
  layout = ("FSDP" if cfg.fsdp else "ZeRO-1") + (
      f" x TP {cfg.model_parallel}" if cfg.model_parallel > 1 else "")
  num_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      lambda: model_lib.init_params(jax.random.PRNGKey(0), cfg.model_config()))))
  log(f"compile only: {cfg.hf_model_dir or cfg.model} ({num_params:,} params, {layout}) "
      f"for {where}")
  stats = compile_stats(cfg, target, devices=(chip, devices))
  if stats["error"] is not None:
    log(f"does not fit: {stats['error']}")
    return 1
  need = stats["need"]
  log(f"per device: arguments {_gib(stats['argument'])}, outputs {_gib(stats['output'])} "
      f"({_gib(stats['alias'])} of them in donated arguments), temporaries "
      f"{_gib(stats['temp'])} as analysed")
  figures = {"allocated by the compiler's buffer assignment": stats["hbm"],
             "the compiler's peak": stats["peak"],
             "arguments + temporaries as analysed": stats["total"]}
  basis = next((name for name, n in figures.items() if n == need),
               "the arguments and outputs held through the step")
  others = [f"{name} {_gib(n)}" for name, n in figures.items() if n and name != basis]
  log(f"total {_gib(need)}" + (f" of {_gib(chip.hbm_bytes)} HBM" if chip else "")
      + f" ({'; '.join([basis] + others)})")
  log(f"cost analysis per device: {stats['flops']:.4g} flops, "
      f"{stats['bytes_accessed']:.4g} bytes accessed")
  if chip is not None and need > chip.hbm_bytes:
    log(f"does not fit: {_gib(need)} per device exceeds the {_gib(chip.hbm_bytes)} of a "
        f"{chip.name} chip")
    return 1
  log("fits")
  return 0
