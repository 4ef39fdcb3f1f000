"""Compiling for a TPU slice ahead of time, on a host without one: the slice's devices
from `jax.experimental.topologies` (libtpu's plugin loaded through JAX internals, the one
place this package touches `jax._src`), one-device compiles and their memory figures.
Nothing runs on these devices; `tpu` holds the chips' facts.
"""

import importlib.util
import re

import jax

from tunix_kernels.tpu import CHIPS
from tunix_kernels.tpu import Chip
from tunix_kernels.tpu import get_chip

# A TPU slice as Cloud TPU names it: `v5e-256`, `v6e-64`, `v5p-128`, `v4-8`, and `KxNAME`
# for K slices of it (`2xv5e-256`). v4 and v5p names count TensorCores (two per chip).
_SLICE = re.compile(r"(?:(\d+)x)?(v4|v5e|v5p|v6e)-(\d+)")


def _load_plugin():
  """Loads libtpu's PJRT plugin with JAX's plugin callbacks run on it, as JAX's plugin
  discovery does for a TPU backend. A CPU host that only builds TPU topologies skips
  that discovery, and without the callbacks the TPU compiler has no partitioner for
  `jax.experimental.custom_partitioning` (the kernels' rules under plain `jax.jit`).
  Uses JAX internals; does nothing when the plugin is already loaded."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  from jax._src.lib import xla_client  # pylint: disable=g-import-not-at-top
  import jax.experimental.custom_partitioning  # noqa: F401  (registers its callback)
  if xla_client.pjrt_plugin_loaded("tpu"):
    return
  c_api = xla_client.load_pjrt_plugin_dynamically("tpu", xla_bridge.get_tpu_library_path())
  xla_client.initialize_pjrt_plugin("tpu")
  with xla_bridge._plugin_callback_lock:  # pylint: disable=protected-access
    for callback in xla_bridge._plugin_callbacks:  # pylint: disable=protected-access
      callback(c_api=c_api)


def aot_devices(chip) -> list:
  """The devices of a `chip` slice (`Chip.topology`) from `jax.experimental.topologies`,
  for lowering and compiling ahead of time; needs `libtpu`, works with
  `JAX_PLATFORMS=cpu`. Nothing can run on them."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  _load_plugin()
  name, config, bounds = get_chip(chip).topology
  return list(topologies.get_topology_desc(
      topology_name=name, platform="tpu", chip_config_name=config,
      chips_per_host_bounds=bounds, num_slices=1, wrap=(False, False, False)).devices)


def parse_topology(name: str) -> tuple[str, str, str, tuple, int]:
  """`(chip, topology_name, chip_config_name, chips_per_host_bounds, num_slices)` of a
  slice name (`_SLICE`) for `jax.experimental.topologies.get_topology_desc`: v5e and v6e
  chips on a 2-D torus, v4 and v5p (megacore) on a 3-D one, a power of two of chips.
  ValueError naming what is wrong."""
  m = _SLICE.fullmatch(name)
  if m is None:
    raise ValueError(f"unknown TPU topology {name!r}: expected a Cloud TPU slice name "
                     "such as v5e-8, v5e-256, v6e-64, v5p-128, v4-8, or 2xv5e-256 for "
                     "two slices")
  slices, chip, count = int(m.group(1) or 1), m.group(2), int(m.group(3))
  chips, rest = divmod(count, CHIPS[chip].cores)
  if rest or chips < 1 or chips & (chips - 1) or slices < 1:
    raise ValueError(f"TPU topology {name!r}: {chip} slices have a power of two of chips"
                     + (" (the name counts TensorCores, two per chip)"
                        if CHIPS[chip].cores > 1 else ""))
  bits = chips.bit_length() - 1
  if chip in ("v5e", "v6e"):
    dims = (2 ** (bits // 2), 2 ** (bits - bits // 2))
    config, bounds = "default", (min(2, dims[0]), min(2, dims[1]), 1)
  else:  # chips go to x, y, z in turn
    dims = tuple(2 ** (bits // 3 + (bits % 3 > axis)) for axis in range(3))
    config, bounds = "megacore", (min(2, dims[0]), min(2, dims[1]), 1)
  return chip, f"{chip}:{'x'.join(map(str, dims))}", config, bounds, slices


def topology_devices(name: str) -> tuple[Chip, list]:
  """`(chip, devices)` of a named slice (`parse_topology`), for compiling ahead of time
  (needs `libtpu`; works with `JAX_PLATFORMS=cpu`). Devices of several slices are in
  slice order."""
  chip, topology, config, bounds, slices = parse_topology(name)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  _load_plugin()
  return CHIPS[chip], list(topologies.get_topology_desc(
      topology_name=topology, platform="tpu", chip_config_name=config,
      chips_per_host_bounds=bounds, num_slices=slices, wrap=(False, False, False)).devices)


def has_libtpu() -> bool:
  """Whether the TPU compiler is importable (ahead-of-time compilation possible)."""
  return importlib.util.find_spec("libtpu") is not None


def compile_for(chip, fn, *shapes, chip_known=True):
  """Compiles `jax.jit(fn)` ahead of time for one device of a `chip` slice, with nothing
  allocated: `shapes` are `jax.ShapeDtypeStruct`s (placed on that device here).

  With `chip_known`, traced under a one-device mesh of that chip, so `impl="auto"` and
  the default tiles resolve as they would on it; without, traced as a CPU host sees it
  (no mesh: "auto" means xla and the chip is unknown). Returns the
  `jax.stages.Compiled`; compiler errors propagate."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  device = aot_devices(chip)[0]
  mesh = jax.sharding.Mesh(np.array([device]), ("aot",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
  if not chip_known:
    return jax.jit(fn).lower(*placed).compile()
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(*placed).compile()


def compiled_stats(compiled) -> dict:
  """Per-device bytes (`argument`, `output`, `temp`, and `alias`: outputs written into
  donated arguments, counted in both) from the compiled memory analysis, `peak` (the
  compiler's own peak of live bytes, `peak_memory_in_bytes`; None where this jax does not
  report it), `host` (host memory: the temporaries offloaded to it, plus host arguments
  and outputs), and `flops`, `bytes_accessed` from its cost analysis."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return dict(argument=memory.argument_size_in_bytes, output=memory.output_size_in_bytes,
              temp=memory.temp_size_in_bytes,
              alias=getattr(memory, "alias_size_in_bytes", 0),
              peak=getattr(memory, "peak_memory_in_bytes", None),
              host=sum(getattr(memory, f"host_{k}_size_in_bytes", 0) or 0
                       for k in ("argument", "output", "temp")),
              flops=cost.get("flops", 0.0),
              bytes_accessed=cost.get("bytes accessed", 0.0))
