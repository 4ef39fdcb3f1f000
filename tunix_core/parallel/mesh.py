"""Device meshes of a run, and reading a sharded array back on the host.

A run's mesh is `("data",)`, `("data", "model")` with tensor parallelism, and on several
TPU slices a `"slice"` axis in front (MaxText's DCN x ICI split): the slow data-centre
network only carries what crosses `"slice"` (the once-per-step gradient all-reduce), every
per-layer collective stays on a slice's own ICI links.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

SLICE, DATA, MODEL = "slice", "data", "model"


def device_slices(devices) -> int:
  """How many TPU slices `devices` span (`slice_index`; 1 for devices without one)."""
  return len({getattr(d, "slice_index", 0) for d in devices})


def resolve_slices(devices, requested: int) -> int:
  """`--num_slices` for `devices`: 0 (auto) is the slices they span. Raises ValueError
  (one line) where a request cannot hold: it must match real slices; on devices without
  slices (CPU), it simulates that many groups of consecutive devices."""
  real = device_slices(devices)
  if requested == 0:
    return real
  if real > 1 and requested != real:
    raise ValueError(f"--num_slices={requested} but the devices span {real} slices")
  if requested < 1 or len(devices) % requested:
    raise ValueError(f"--num_slices={requested} does not divide the {len(devices)} devices")
  return requested


def make_mesh(devices, model_parallel: int = 1, num_slices: int = 1) -> Mesh:
  """`("data",)` over `devices`; with `model_parallel > 1` a `("data", "model")` mesh
  whose inner axis groups `model_parallel` consecutive devices (on one host, so the
  per-layer psums stay on its fastest links); with `num_slices > 1` a `"slice"` axis in
  front, each of its entries one slice's devices (by `slice_index`, else consecutive)."""
  devices = list(devices)
  if model_parallel < 1 or len(devices) % (model_parallel * num_slices):
    raise ValueError(f"--model_parallel={model_parallel} x --num_slices={num_slices} does "
                     f"not divide the {len(devices)} devices")
  if device_slices(devices) > 1:  # slice-major, each slice in its own order
    devices = sorted(devices, key=lambda d: d.slice_index)
  grid = np.array(devices).reshape(num_slices, -1, model_parallel)
  names = (SLICE, DATA, MODEL)
  keep = [num_slices > 1, True, model_parallel > 1]
  return Mesh(grid.reshape([n for n, k in zip(grid.shape, keep) if k]),
              tuple(name for name, k in zip(names, keep) if k))


def batch_axes(mesh: Mesh):
  """The mesh axes a batch's pairs split over: every data-parallel device of every
  slice (`"data"`, or `("slice", "data")`)."""
  return (SLICE, DATA) if SLICE in mesh.axis_names else DATA


def slice_axis(mesh: Mesh) -> str | None:
  """The axis across slices, or None on one slice."""
  return SLICE if SLICE in mesh.axis_names else None


def to_host(x: jax.Array) -> np.ndarray:
  """The global value of `x` as NumPy, also when other processes hold some shards."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
