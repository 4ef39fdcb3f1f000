"""`--remat=auto`: the cheapest rematerialisation policy whose step fits the device.

Rematerialisation trades memory for compute: `none` keeps every activation for the
backward, `dots` keeps only the matmul outputs and recomputes the rest, `attention` keeps
only what attention's backward needs and recomputes the MLP, `full` recomputes each
layer's forward. `auto` compiles the plan's step under each policy in that order of
cost and takes the first whose compiled memory (`need`) fits the device's capacity; a
step that fits under none of them gets `full` and fails as it would. Without a capacity (CPU and GPU devices:
host memory, or an unknown bound) it is `none`. Each compile is the very step the run
then executes: `resolve_steps` hands the chosen one's functions to the run (on a thread
beside its restore: a state's shapes and placement are the same under every policy),
whose first step then finds it compiled; a restart finds every candidate in the
persistent compilation cache.
"""

import dataclasses

from tunix_kernels import aot_tpu

from tunix_core.training import executables
from tunix_core.training import plan as plan_lib
from tunix_core.training import step as step_lib

CANDIDATES = ("none", "dots", "attention", "full")  # cheapest first


def capacity(devices) -> int | None:
  """Bytes one device may hold: a TPU's `bytes_limit`, else None (no bound known)."""
  if devices[0].platform != "tpu":
    return None
  return (devices[0].memory_stats() or {}).get("bytes_limit")


def need(plan: plan_lib.StepPlan, devices, steps: step_lib.StepFunctions | None = None,
         log=print) -> int | None:
  """Per-device bytes of `plan`'s compiled train step on `devices` (through `steps`, its
  `StepFunctions`, when given), or None when the compiler refuses it for memory. It is
  compiled as the run's first step compiles it (`executables.compile_step`, which keeps
  the executable for that compile to find)."""
  steps = steps or step_lib.make_steps(plan, devices)
  try:
    compiled = executables.compile_step(steps, executables.store_dir(devices), log)
  except executables.Refused:
    return None
  stats = aot_tpu.compiled_stats(compiled)
  held = stats["argument"] + stats["output"] - stats["alias"]
  # The TPU compiler's peak of live bytes; elsewhere (CPU) its peak leaves out the
  # temporaries, so they are added whole.
  peak = stats["peak"] if devices[0].platform == "tpu" else None
  return max(peak or held + stats["temp"], held)


def resolve(plan: plan_lib.StepPlan, devices, limit: int | None, log=lambda *_: None,
            measure=need) -> plan_lib.StepPlan:
  """`plan` with `--remat=auto` resolved for devices holding `limit` bytes each (None:
  no bound, `none`); any other `--remat` as given. `measure(plan, devices)`: a
  candidate's bytes per device, None if it does not compile (default `need`)."""
  if not plan.remat_auto:
    return plan
  with_policy = lambda p: dataclasses.replace(plan, model=dataclasses.replace(plan.model,
                                                                              remat=p))
  if limit is None:
    return with_policy("none")
  for policy in CANDIDATES:
    bytes_ = measure(with_policy(policy), devices)
    if bytes_ is not None and bytes_ <= limit:
      log(f"--remat=auto: {policy} ({bytes_ / 2**30:.3g} of {limit / 2**30:.3g} GiB per "
          "device)")
      return with_policy(policy)
  log(f"--remat=auto: no policy fits {limit / 2**30:.3g} GiB per device; full")
  return with_policy("full")


def resolve_steps(plan: plan_lib.StepPlan, devices, limit: int | None,
                  log=lambda *_: None, steps: step_lib.StepFunctions | None = None
                  ) -> tuple[plan_lib.StepPlan, step_lib.StepFunctions]:
  """`resolve`, and the chosen plan's `StepFunctions`: the very ones its candidate was
  measured with, so a start-up traces and loads the step once, not once to choose and
  again to run. `steps`: those of `plan` as given (its `--remat=auto` stands as none
  until resolved), used for that candidate."""
  built = {} if steps is None else {plan.model.remat: steps}

  def make(candidate):
    if candidate.model.remat not in built:
      built[candidate.model.remat] = step_lib.make_steps(candidate, devices)
    return built[candidate.model.remat]

  plan = resolve(plan, devices, limit, log, lambda p, d: need(p, d, make(p), log))
  return plan, make(plan)
