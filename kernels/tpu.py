"""TPU generations: the per-chip facts the kernels size their blocks from (compiling for
a slice ahead of time is `aot_tpu`'s).

VMEM figures are per TensorCore, as a Pallas kernel sees them. `scoped_vmem_bytes` is
what the compiler grants a kernel that does not set `vmem_limit_bytes`; the kernels
raise the limit only up to `vmem_bytes` and only when the chip is known. HBM is per
JAX device (a v4 or v5p megacore chip is one device with two TensorCores).
"""

import dataclasses

import jax

from tunix_kernels import dispatch

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation.

  Attributes:
    name: short name ("v4", "v5e", "v5p", "v6e").
    device_kinds: `jax.Device.device_kind` strings of this generation.
    vmem_bytes: VMEM per TensorCore.
    scoped_vmem_bytes: the compiler's default scoped VMEM limit per kernel.
    hbm_bytes: HBM per JAX device.
    topology: `(topology_name, chip_config_name, chips_per_host_bounds)` of an 8-chip
      (v5e, v6e) or 4-chip (v4, v5p megacore) slice for `aot_devices`.
    peak_flops: dense bf16 flop/s per JAX device, and
    hbm_bandwidth: HBM bytes/s per JAX device, both from the Cloud TPU documentation
      (docs.cloud.google.com/tpu/docs/v4, v5e, v5p, v6e): the roofline the kernels'
      tiles are chosen against.
    cores: TensorCores per JAX device (2 on the v4 and v5p megacores, which split a
      kernel's leading "parallel" grid axis between them).
  """

  name: str
  device_kinds: tuple
  vmem_bytes: int
  scoped_vmem_bytes: int
  hbm_bytes: int
  topology: tuple
  peak_flops: float
  hbm_bandwidth: float
  cores: int = 1


CHIPS = {
    "v4": Chip("v4", ("TPU v4",), 16 * MiB, 16 * MiB, 32 * GiB,
               ("v4:2x2x1", "megacore", (2, 2, 1)), 275e12, 1200e9, 2),
    "v5e": Chip("v5e", ("TPU v5 lite", "TPU v5e"), 128 * MiB, 16 * MiB, 16 * GiB,
                ("v5e:2x4", "default", (2, 2, 1)), 197e12, 819e9),
    "v5p": Chip("v5p", ("TPU v5", "TPU v5p"), 64 * MiB, 16 * MiB, 95 * GiB,
                ("v5p:2x2x1", "megacore", (2, 2, 1)), 459e12, 2765e9, 2),
    "v6e": Chip("v6e", ("TPU v6 lite", "TPU v6e"), 128 * MiB, 32 * MiB, 32 * GiB,
                ("v6e:2x4", "default", (2, 2, 1)), 918e12, 1638e9),
}

# What the kernels may assume when the generation is unknown at trace time.
MIN_SCOPED_VMEM_BYTES = min(c.scoped_vmem_bytes for c in CHIPS.values())
# The share of a VMEM limit the kernels' own model of their tiles may fill: the rest is
# for what Mosaic allocates beyond it (semaphores, spills, alignment).
VMEM_HEADROOM = 0.9


def check_vmem(need: int, vmem_limit_bytes: int | None, chip, tiles: str, problem: str,
               hint: str) -> None:
  """Raises ValueError unless `need` bytes of VMEM fit `VMEM_HEADROOM` of the limit:
  `vmem_limit_bytes` (itself at most the VMEM of `chip` when that is known), else the
  default scoped VMEM of `chip`, or of the smallest generation. The message names the
  `tiles`, the `problem` they were sized for and what to do instead (`hint`)."""
  chip = None if chip is None else get_chip(chip)
  if vmem_limit_bytes is not None:
    limit, where = vmem_limit_bytes, "vmem_limit_bytes"
    if chip is not None and limit > chip.vmem_bytes:
      raise ValueError(f"BlockSizes.vmem_limit_bytes={limit} exceeds the "
                       f"{chip.vmem_bytes} bytes of VMEM of a TPU {chip.name} core")
  else:
    limit = MIN_SCOPED_VMEM_BYTES if chip is None else chip.scoped_vmem_bytes
    where = ("the default scoped VMEM" + (f" of TPU {chip.name}" if chip else
                                           " of the smallest TPU generation"))
  if need > limit * VMEM_HEADROOM:
    raise ValueError(f"{tiles} needs about {need / 2**20:.1f} MiB of VMEM for {problem}, "
                     f"more than {VMEM_HEADROOM:.0%} of {where} ({limit / 2**20:.0f} MiB): "
                     f"{hint}")


def get_chip(chip) -> Chip:
  """A `Chip` from a `Chip`, a name in `CHIPS` or a device kind; ValueError otherwise."""
  if isinstance(chip, Chip):
    return chip
  found = CHIPS.get(chip) or next(
      (c for c in CHIPS.values() if chip in c.device_kinds), None)
  if found is None:
    raise ValueError(f"unknown TPU generation {chip!r}; choose one of {tuple(CHIPS)}")
  return found


def target_chip() -> Chip | None:
  """The generation the current computation is compiled for, or None when that is not a
  TPU this module knows (a CPU host lowering without a TPU mesh, or a newer chip).

  The device comes from `dispatch.target_device()` (the context's abstract or concrete
  mesh), else from `jax.devices()` when the default backend is a TPU.
  """
  device = dispatch.target_device()
  if device is None and jax.default_backend() == "tpu":
    device = jax.devices()[0]
  if device is None or device.platform != "tpu":
    return None
  kind = getattr(device, "device_kind", None)
  return next((c for c in CHIPS.values() if kind in c.device_kinds), None)
