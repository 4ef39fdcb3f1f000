"""`--compile_only`: the step plan a run's flags would train, compiled for a target
topology, and whether it fits, without allocating anything.

The plan is the one `run.loop.train` builds (`training.plan.make_plan`): from the data
when `--train_data` is given (it is read and encoded, nothing else), else from the
flags' worst case. With `libtpu` installed, `--target_topology=v5e-8` (or any Cloud TPU
slice name, `tunix_kernels.aot_tpu.parse_topology`) gives the devices of that TPU slice on any
host, even with `JAX_PLATFORMS=cpu`; the step is lowered with `jax.ShapeDtypeStruct` inputs sharded on a
mesh of them and compiled by the real TPU compiler (Pallas kernels included). Nothing is
initialised or loaded: the params, optimizer state, reference and batch are abstract
(under `--reference=precomputed` the reference log-probs are an abstract input too),
and `--hf_model_dir` contributes only its `config.json` and tokenizer. Settings are
validated against the target's device count, and `impl="auto"` and
`--compute_dtype=auto` resolve as that platform would run them.
`--target_topology=local` compiles for this host's devices instead.
"""

import dataclasses
import glob
import os
import re
import tempfile

import jax

from tunix_kernels import tpu
from tunix_kernels import aot_tpu
from tunix_core import model as model_lib
from tunix_core.aot import comms
from tunix_core.aot import overlap
from tunix_core.data import packing
from tunix_core.run import source
from tunix_core.training import flops
from tunix_core.training import plan as plan_lib
from tunix_core.training import executables
from tunix_core.training import fit
from tunix_core.training import memory
from tunix_core.training import step as step_lib
from tunix_core.training.config import ConfigError

GiB = 1 << 30


def target_devices(name: str) -> tuple[tpu.Chip | None, list]:
  """`(chip or None for local devices, devices)` of a `--target_topology`."""
  if name == "local":
    return None, jax.devices()
  if not aot_tpu.has_libtpu():
    raise RuntimeError("compiling for a TPU topology needs libtpu: pip install "
                       "'jax[tpu]' (the `tpu` extra)")
  return aot_tpu.topology_devices(name)


def lower(plan: plan_lib.StepPlan, devices):
  """`(steps, the train step of `plan` lowered on `devices` with abstract inputs)`."""
  steps = step_lib.make_steps(plan, devices)
  with jax.set_mesh(steps.mesh):  # so impl="auto" and the kernel tiles see the target
    return steps, steps.train_step.lower(*steps.abstract_inputs())


def gib(n: int) -> str:
  """Bytes in GiB, or MiB below 0.1 GiB, to 3 significant figures."""
  value, unit = (n / GiB, "GiB") if n >= GiB // 10 else (n / (1 << 20), "MiB")
  return f"{value:#.3g}".rstrip(".") + f" {unit}"


def _allocated_in_hbm(dump_dir: str) -> int | None:
  """The bytes the compiler's buffer assignment places in device memory (colour 0) for
  the train step, from the memory-usage report of an XLA dump; None where it has none."""
  for path in glob.glob(os.path.join(dump_dir, "*train_step*memory-usage-report.txt")):
    with open(path) as f:
      found = re.search(r"Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)", f.read())
    if found:
      return int(found.group(1))
  return None


def compile_stats(plan: plan_lib.StepPlan, chip, devices) -> dict:
  """Compiles `plan`'s train step for `devices` (of `chip`, None for local devices).
  Returns `{"chip",
  "devices", "num_params", "error"}` plus, when it compiled, `tunix_kernels.aot_tpu.compiled_stats`
  per device, `"parts"` (bytes per device of the params, the optimizer state and the
  reference or frozen base), `"total"` (arguments + outputs not in donated arguments + temporaries as
  analysed), `"hbm"` (for a TPU target: the bytes the compiler's buffer assignment
  allocates in HBM, read from an XLA dump into a temporary directory; None where the
  dump lacks it) and `"need"`, what the fit is judged on: `hbm`, else the compiler's
  `peak`, else `total`, but never less than the arguments and outputs the caller holds
  through the step; `"collectives"`, `comms.collectives` of the compiled HLO (bytes a
  device sends per step, by the mesh axes they cross); `"overlap"`, for a TPU target,
  `overlap.exposed` of its schedule (None for local devices); `"model_flops"`, the plan's
  model FLOPs per device; `"error"` is the compiler's refusal or None, and with a refusal
  `"refusal"` is its `executables.Refused` when it was over memory (else None).

  Why not `total`: on TPU `temp_size_in_bytes` can exceed the temporaries the buffer
  assignment allocates (for the 7B FSDP step of the README: 7.25 GiB, against one
  preallocated block of 5.40 GiB), so the sum overstates what the chip must hold.
  """
  steps, lowered = lower(plan, devices)
  state, frozen, _ = steps.abstract_inputs()
  out = {"chip": chip, "devices": devices, "error": None, "refusal": None,
         "num_params": sum(x.size for x in jax.tree.leaves(steps.param_shapes)),
         "parts": {"params": memory.shard_bytes(state["params"]),
                   "optimizer state": memory.shard_bytes(state["opt_state"]),
                   ("frozen base" if plan.lora else "reference"): memory.shard_bytes(frozen)}}
  if plan.offload_optimizer:
    out["parts"]["optimizer state in host memory"] = memory.shard_bytes(state["opt_state"],
                                                                        "pinned_host")
  with tempfile.TemporaryDirectory() as dump_dir:
    try:
      with jax.set_mesh(steps.mesh):
        compiled = lowered.compile({"xla_dump_to": dump_dir} if chip is not None else None)
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the answer
      message = str(e)
      unknown = re.search(r"No such compile option: '([\w]+)'", message)
      if unknown:
        raise ConfigError(f"--tpu_flags: the TPU compiler has no option "
                          f"{unknown.group(1)!r}") from None
      refusal = executables.memory_refusal(e, memory.shard_bytes(steps.abstract_inputs()))
      out["error"] = str(refusal) if refusal else (message.splitlines() or [""])[0][:500]
      out["refusal"] = refusal  # over memory, not another precondition
      return out
    hbm = _allocated_in_hbm(dump_dir) if chip is not None else None
  stats = aot_tpu.compiled_stats(compiled)
  text, mesh_shape = compiled.as_text(), dict(steps.mesh.shape)
  stats["collectives"] = comms.collectives(text, mesh_shape)
  stats["overlap"] = overlap.exposed(text, mesh_shape, chip.name) if chip else None
  stats["model_flops"] = flops.step_flops(plan, chip) / len(devices)
  total = stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]
  held = stats["argument"] + stats["output"] - stats["alias"]
  out.update(stats, total=total, hbm=hbm, need=max(hbm or stats["peak"] or total, held))
  return out


def plan_for(cfg, devices, log=lambda *_: None) -> plan_lib.StepPlan:
  """The plan `run.loop.train` would build for `cfg` on `devices` (before `training.fit`
  chooses what is auto): from the data when `--train_data` is given, else the flags'
  worst case."""
  return plan_lib.make_plan(cfg, devices, sizes_for(cfg, devices, log))


def sizes_for(cfg, devices, log=lambda *_: None) -> packing.Sizes | None:
  """The data's `packing.Sizes` when `--train_data` is given, else None (the worst case
  of the flags)."""
  cfg.validate(len(devices))
  sizes = None
  if cfg.train_data:
    # Compiling leaves nothing behind: the data goes to a throwaway token store unless
    # --data_cache_dir names a lasting one (then the run finds it there).
    with tempfile.TemporaryDirectory(prefix="tunix-compile-data-") as tmp:
      data_cfg = cfg if cfg.data_cache_dir else dataclasses.replace(cfg, data_cache_dir=tmp)
      splits = [d for d in source.load_data(data_cfg, log) if d is not None]
      sizes = plan_lib.data_sizes(cfg, splits)
  return sizes


def fitted(cfg, chip, devices, log=lambda *_: None) -> dict:
  """`cfg`'s step planned and fitted as the trainer would (`training.fit`), compiled for
  `devices` (of `chip`; None: local). Returns `{"plan", "stats"` (`compile_stats` of the
  plan taken; None where none fits)`, "limit"` (bytes a device may hold; None: no
  limit known)`, "chose"` (what `--remat` / `--grad_accum_steps=auto` measured)`,
  "failed"` (why none fits, or None)`, "refused"` (then the compiler's words on the last
  candidate it refused, or None)`, "need"` (bytes per device of the plan taken, or of the
  smallest candidate when none fits; None if the compiler refused it otherwise)`}`."""
  compiled = {}  # each candidate compiles once, its figures kept
  sizes = sizes_for(cfg, devices, log)

  def measure(candidate):
    compiled[candidate] = stats = compile_stats(candidate, chip, devices)
    if stats["error"] and stats["refusal"] is None:  # not over memory: reported as it is
      raise fit.DoesNotFit(f"the compiler refused the step: {stats['error']}")
    return stats["refusal"] or stats["need"]

  limit = fit.capacity(devices, cfg.device_memory_gib) if chip is None else (
      int(cfg.device_memory_gib * GiB) or chip.hbm_bytes)
  plan, chose = plan_lib.make_plan(cfg, devices, sizes), []
  try:  # (the plan line names what --remat / --grad_accum_steps=auto chose)
    plan, failed = fit.choose(
        plan, lambda *c: plan_lib.make_plan(cfg, devices, sizes, fit=c), limit, measure,
        log=chose.append,
        estimate=lambda p: memory.estimate(step_lib.make_steps(p, devices))), None
  except fit.DoesNotFit as e:
    failed, smallest = str(e), e.need
  stats = None if failed else compiled.get(plan) or compile_stats(plan, chip, devices)
  refused = [s["error"] for s in compiled.values() if s["error"]]
  return {"plan": plan, "stats": stats, "limit": limit, "chose": chose, "failed": failed,
          "refused": refused[-1] if failed and refused else None,
          "need": smallest if failed else stats["need"] if not stats["error"] else None}


def compile_only(cfg, target: str, log=print, then=None) -> int:
  """Compiles the train step `cfg` would run for `target`; logs its plan, per-device
  memory and the cost analysis, then calls `then(cfg, chip, devices, fitted(...), log)`
  if given (`aot.levers.compare`). Returns the exit status: 0 if it compiles and fits
  the chip's HBM, 1 if the compiler refuses it (its message logged) or what it needs
  (`compile_stats`' "need") exceeds HBM."""
  chip, devices = target_devices(target)
  where = f"{target} ({len(devices)} x {devices[0].device_kind})"
  got = fitted(cfg, chip, devices, log)
  plan = got["plan"]
  num_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      lambda: model_lib.init_params(jax.random.PRNGKey(0), plan.model))))
  log(f"compile only: {cfg.hf_model_dir or cfg.model} ({num_params:,} params, "
      f"{plan.layout}) for {where}")
  log(plan.describe())
  status = _report(got, chip, log)
  if then is not None:
    then(cfg, chip, devices, got, log)
  return status


def _report(got: dict, chip, log) -> int:
  """Logs `fitted`'s figures; the exit status (0: it fits)."""
  stats, limit, chose = got["stats"], got["limit"], got["chose"]
  if got["failed"]:
    log(got["failed"])
    if got["refused"]:
      log(f"does not fit: {got['refused']}")
    return 1
  if stats["error"] is not None:
    said = "does not fit" if stats["refusal"] else "the compiler refused the step"
    log(f"{said}: {stats['error']}")
    return 1
  need = stats["need"]
  log(f"per device: arguments {gib(stats['argument'])}, outputs {gib(stats['output'])} "
      f"({gib(stats['alias'])} of them in donated arguments), temporaries "
      f"{gib(stats['temp'])} as analysed"
      + (f"; host memory {gib(stats['host'])} (--remat=offload)" if stats["host"] else ""))
  figures = {"allocated by the compiler's buffer assignment": stats["hbm"],
             "the compiler's peak": stats["peak"],
             "arguments + temporaries as analysed": stats["total"]}
  basis = next((name for name, n in figures.items() if n == need),
               "the arguments and outputs held through the step")
  others = [f"{name} {gib(n)}" for name, n in figures.items() if n and name != basis]
  fits = limit is None or need <= limit
  log(f"total {gib(need)} per device" + (f" of {gib(limit)}" if limit else "")
      + (" HBM" if chip else "")
      + f": {'fits' if fits else 'does not fit'} ({'; '.join([basis] + others)})")
  held = sum(n for name, n in stats["parts"].items() if "host" not in name)
  log("per device: " + ", ".join(f"{name} {gib(n)}" for name, n in stats["parts"].items())
      + f", activations and the rest {gib(max(need - held, 0))}")
  for line in chose:  # what --remat / --grad_accum_steps=auto took, and what it measured
    log(line)
  log(f"per device: {stats['model_flops']:.4g} model flops per step (the plan's matmuls); "
      f"the compiler's cost analysis, which counts each loop body once: "
      f"{stats['flops']:.4g} flops, {stats['bytes_accessed']:.4g} bytes accessed")
  sent = sum(stats["collectives"].values())
  axes = ", ".join(f"{gib(b)} over {' x '.join(a)}"
                   for a, b in sorted(stats["collectives"].items()))
  if chip is not None:
    roof = comms.share(stats["collectives"], stats["model_flops"], chip.name)
    log(f"communication share: {roof['share']:.1%} (per device {gib(sent)} sent: "
        f"{axes or 'none'}; {roof['ici_s'] * 1e3:.3g} ms over ICI and "
        f"{roof['dcn_s'] * 1e3:.3g} ms across slices against {roof['compute_s'] * 1e3:.3g}"
        f" ms of compute, not overlapped)")
    log(overlap.describe(stats["overlap"]))
    if stats["overlap"]["share"] > comms.SHARE_LIMIT and not stats["overlap"]["unknown"]:
      log(f"exposed communication over {comms.SHARE_LIMIT:.0%}: this step is bound by its "
          f"collectives (FSDP moves the whole model every step whatever the batch; more "
          f"pairs per device, --batch_size, amortise it)")
  else:
    log(f"communication per device: {gib(sent)} sent ({axes or 'none'})")
  if not fits:
    log(f"does not fit: {gib(need)} per device exceeds the {gib(limit)} it may hold")
  return 0 if fits else 1
