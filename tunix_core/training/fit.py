"""Fitting the train step to the device: `--remat=auto` and `--grad_accum_steps=auto`.

Rematerialisation trades compute for memory (`none` keeps every activation, `dots` the
matmul outputs, `attention` what attention's backward needs, `full` each layer's input),
and so do micro-batches (each holds 1/k of the step's activations; the step then runs k
forwards and backwards in a row). The candidates are every policy `--remat` allows, at
each micro-batch count `--grad_accum_steps` allows: the policies, cheapest first, at one
micro-batch, then at two, and so on over the divisors of the pairs per device (one
micro-batch for a batch-coupled loss, `losses.LossSpec.batch_coupled`: splitting it
would change the loss).

The choice is made before compiling: each candidate's bytes are estimated
(`memory.estimate`), and only the first whose estimate fits `MARGIN` of the device's
capacity is compiled. If the compiler refuses it or its compiled figure does not fit
after all, that policy's estimates are scaled by what the compile showed and the next
candidate that then fits is compiled, so a cold start compiles one candidate, rarely
two (a refusal takes seconds: the compiler stops at its memory verdict). The
taken candidate is recorded beside the compilation cache (`decision-{key}.json`, keyed
by the plan as the flags give it and the devices): a restart compiles it alone, which
the compilation cache then answers. A step that fits no candidate ends in one line
naming the smallest figure reached.

`MARGIN`: the compiler's figure is exact, but the runtime's allocator fragments; a step
may fill 95% of what the device reports (a TPU's `bytes_limit`, `--device_memory_gib`).
Without a capacity (CPU and GPU devices and no `--device_memory_gib`) nothing is
measured: `none` at one micro-batch (the flags' own values where they are not auto).
"""

import hashlib
import json

import jax
from tunix_kernels import aot_tpu

from tunix_core.storage import paths
from tunix_core.training import executables
from tunix_core.training import memory
from tunix_core.training import plan as plan_lib
from tunix_core.training import remat
from tunix_core.training import step as step_lib
from tunix_core.training.validation import ConfigError

POLICIES = remat.CANDIDATES  # cheapest first
MARGIN = 0.95
GiB = 1 << 30


class DoesNotFit(ConfigError):
  """No candidate's step fits the device (`choose`'s one line); `need`: the bytes per
  device of the smallest candidate measured or estimated (None: not known)."""

  def __init__(self, message: str, need: int | None = None):
    super().__init__(message)
    self.need = need


def capacity(devices, override_gib: float = 0.0) -> int | None:
  """Bytes one device may hold: `override_gib` when set, else `remat.capacity` (a TPU's
  `bytes_limit`; None elsewhere)."""
  return int(override_gib * GiB) if override_gib else remat.capacity(devices)


def candidates(plan: plan_lib.StepPlan) -> list[tuple[str, int]]:
  """`(remat, micro_batches)` in the order they are tried (module docstring)."""
  policies = POLICIES if plan.remat_auto else (plan.model.remat,)
  if plan.micro_batches_auto and not plan.loss.batch_coupled:
    pairs = plan.pairs_per_device
    counts = [k for k in range(1, pairs + 1) if pairs % k == 0]
  else:
    counts = [plan.micro_batches]
  return [(p, k) for k in counts for p in policies]


def decision_path(plan: plan_lib.StepPlan, devices, limit: int | None,
                  where: str | None) -> str | None:
  """Where the choice for `plan` (as the flags give it) on `devices` holding `limit`
  bytes each is recorded, in the compilation cache's directory `where` (None: nowhere)."""
  if not where:
    return None
  kinds = [(d.platform, d.device_kind, d.id) for d in devices]
  key = hashlib.sha256(repr((plan, kinds, limit)).encode()).hexdigest()[:32]
  return paths.join(where, f"decision-{key}.json")


def _gib(n) -> str:
  return f"{n / GiB:.3g} GiB"


def choose(plan: plan_lib.StepPlan, make, limit: int | None, measure, *, log=print,
           beat=lambda *_: None, record: str | None = None, estimate=None):
  """The taken candidate of `plan`: `make(remat, micro_batches)`'s result (the caller's
  plan or step functions) for the first candidate whose step fits `MARGIN` of `limit`
  bytes per device. `measure(made)`: the compiled bytes per device, or the
  `executables.Refused` of the compiler's refusal for memory (each call is one compile:
  `beat` names it to the watchdog first); `estimate(made)`: the modelled bytes (default
  `memory.estimate`, of step functions).
  `record`: the decision's file (`decision_path`). Raises `DoesNotFit` when no
  candidate fits."""
  estimate = estimate or memory.estimate
  order = candidates(plan)
  if limit is None or not (plan.remat_auto or plan.micro_batches_auto):
    return make(*order[0]) if limit is None else make(plan.model.remat, plan.micro_batches)
  budget = limit * MARGIN
  recorded = _read(record)
  if recorded in order:  # a restart: the taken one first, then the others after it
    order = order[order.index(recorded):]
  # What each policy's compiles showed against its estimates: the model's error is the
  # policy's (what it keeps), nearly the same at every micro-batch count.
  scale, smallest, tried = {}, None, 0
  for i, (policy, k) in enumerate(order):
    made = make(policy, k)
    guess = estimate(made)
    if (guess * scale.get(policy, 1.0) > budget and i < len(order) - 1
        and (policy, k) != recorded):
      continue
    beat(f"start-up: compiling the train step (remat {policy}, {k} micro-batch(es))")
    got, tried = measure(made), tried + 1
    if isinstance(got, executables.Refused):  # its figure, where the compiler said one
      got = None if got.needed is None else max(got.needed, int(budget) + 1)
    elif got <= budget:
      log(f"fit: remat {policy}, {k} micro-batch(es) of {plan.pairs_per_device // k} "
          f"pair(s) per device: {_gib(got)} of {_gib(budget)} per device ({MARGIN:.0%} of "
          f"{_gib(limit)}; estimated {_gib(guess)}; {tried} compile(s))")
      _write(record, (policy, k), log)
      return made
    seen = got if got is not None else guess * max(scale.get(policy, 1.0), 1.0 / MARGIN)
    smallest = min(smallest or (seen, policy, k), (seen, policy, k))
    scale[policy] = max(scale.get(policy, 1.0), seen / guess)
  seen, policy, k = smallest
  raise DoesNotFit(
      f"the train step fits no remat policy and micro-batch count: the smallest, remat "
      f"{policy} with {k} micro-batch(es) ({plan.pairs_per_device // k} pair(s) per "
      f"device), needs {_gib(seen)} against {_gib(budget)} per device ({MARGIN:.0%} of "
      f"{_gib(limit)}); a shorter --max_length, --fsdp, --model_parallel, --lora_rank or "
      f"more devices would change it", need=int(seen))


def _read(record):
  if record is None:
    return None
  try:
    if not paths.exists(record):
      return None
    got = json.loads(paths.read_text(record))
    return got["remat"], int(got["micro_batches"])
  except (ValueError, KeyError, TypeError, OSError):
    return None  # a damaged record decides nothing


def _write(record, choice, log) -> None:
  if record is None:
    return
  try:
    paths.write_bytes(record, json.dumps(dict(remat=choice[0],
                                              micro_batches=choice[1])).encode())
  except OSError as e:  # paths.StorageError included: a record never ends the run
    log(f"fit: {record} not written ({type(e).__name__})")


def compiled_bytes(compiled, devices) -> int:
  """Per-device bytes of a compiled step (`jax.stages.Compiled`): the TPU compiler's
  peak of live bytes; elsewhere (CPU) its peak leaves out the temporaries, so they are
  added whole; never less than the arguments and outputs held through the step."""
  stats = aot_tpu.compiled_stats(compiled)
  held = stats["argument"] + stats["output"] - stats["alias"]
  peak = stats["peak"] if devices[0].platform == "tpu" else None
  return max(peak or held + stats["temp"], held)


def fit_steps(cfg, plan: plan_lib.StepPlan, steps, devices, sizes, log=print,
              beat=lambda *_: None):
  """The run's `training.step.StepFunctions` for the candidate `choose` takes on
  `devices` (a TPU's capacity, or `--device_memory_gib`): the very ones its candidate
  was compiled with (`executables.compile_step` keeps the executable, so the run's first
  step finds it); `steps`, those of `plan` as the flags give it (`sizes`: its data's),
  serve the candidate equal to it. The decision is recorded beside the compilation
  cache when it is on."""
  built = {plan: steps}

  def make(policy, k):
    candidate = plan_lib.make_plan(cfg, devices, sizes, fit=(policy, k))
    if candidate not in built:
      built[candidate] = step_lib.make_steps(candidate, devices)
    return built[candidate]

  where = executables.store_dir(devices)

  def measure(candidate):
    try:
      return compiled_bytes(executables.compile_step(candidate, where, log), devices)
    except executables.Refused as refusal:
      return refusal

  limit = capacity(devices, cfg.device_memory_gib)
  cache = (jax.config.jax_compilation_cache_dir
           if jax.config.jax_enable_compilation_cache and jax.process_index() == 0 else None)
  return choose(plan, make, limit, measure, log=log, beat=beat, estimate=memory.estimate,
                record=decision_path(plan, devices, limit, cache))
