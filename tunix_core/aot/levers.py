"""`--compile_only --compare_levers`: what each memory lever saves on a step, compiled.

Each lever the flags do not already use is compiled alone on top of them, through the
trainer's own fit (`aot.compile.fitted`: `--remat` and `--grad_accum_steps=auto` choose
again for each), then together, added in the order of `LEVERS`, until the step fits.
Every figure is a compile's, none an estimate. The order is the docs' advice for a
large full-DPO run (docs/training.md#bfloat16-params): bfloat16 params trained as
float32 (no cost in quality), the reference's log-probs computed once before training
(no reference copy in the step), 8-bit moments, the optimizer state in host memory (it
costs transfer time every step), and FSDP (params split over the devices).
"""

import dataclasses

from tunix_core.aot import compile as aot
from tunix_core.training import validation
from tunix_core.training.config import ConfigError

LEVERS = (
    ("--param_dtype=bfloat16", dict(param_dtype="bfloat16")),
    ("--reference=precomputed", dict(reference="precomputed")),
    ("--optimizer_dtype=float8", dict(optimizer_dtype="float8")),
    ("--offload_optimizer", dict(offload_optimizer=True)),
    ("--fsdp", dict(fsdp=True)),
)


def available(cfg, num_devices: int) -> list[tuple[str, dict]]:
  """The `LEVERS` that `cfg` does not use and that are valid with it on `num_devices`."""
  out = []
  for name, change in LEVERS:
    if all(getattr(cfg, k) == v for k, v in change.items()) or (
        "fsdp" in change and num_devices // cfg.model_parallel == 1):  # nothing to split
      continue
    try:
      validation.check(dataclasses.replace(cfg, **change), num_devices)
    except ConfigError:
      continue
    out.append((name, change))
  return out


def _outcome(got: dict) -> tuple[int | None, bool, str]:
  """`(bytes a device needs, or None, whether it fits, what to print)` of an
  `aot.compile.fitted` result (when none fits: its smallest candidate's bytes)."""
  need, limit = got["need"], got["limit"]
  if need is None:  # refused for another reason than memory
    return None, False, got["failed"][:200]
  fits = not got["failed"] and (limit is None or need <= limit)
  return need, fits, f"{aot.gib(need)} per device, {'fits' if fits else 'does not fit'}"


def compare(cfg, chip, devices, base: dict, log=print) -> None:
  """Logs what each available lever needs with `cfg` on `devices` (of `chip`, None:
  local) and saves against `base` (`cfg`'s own `fitted` result), then the first prefix of
  the levers, in `LEVERS`' order, whose step fits."""
  levers = available(cfg, len(devices))
  if not levers:
    log("levers: each memory lever is on already or does not apply")
    return
  measured = {}

  def outcome(names):
    if names not in measured:
      change = {k: v for name, c in levers if name in names for k, v in c.items()}
      measured[names] = _outcome(aot.fitted(dataclasses.replace(cfg, **change), chip,
                                            devices))
    return measured[names]

  base_need, base_fits, _ = _outcome(base)
  for name, _ in levers:
    need, _, said = outcome((name,))
    saves = (f"; saves {aot.gib(base_need - need)}"
             if need is not None and base_need is not None else "")
    log(f"lever {name}: {said}{saves}")
  if base_fits:
    log("levers: the step fits as it is")
    return
  names = ()
  for name, _ in levers:
    names += (name,)
    need, fits, said = outcome(names)
    if fits:
      log(f"levers: fits with {' '.join(names)}: {aot.gib(need)} per device")
      return
  log(f"levers: does not fit with all of them ({' '.join(names)}: {said})")
