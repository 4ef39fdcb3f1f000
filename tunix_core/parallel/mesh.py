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


def ici_order(devices) -> list:
  """TPU devices along a snake through their torus coordinates (z slowest, then y, then
  x, each reversing direction whenever a slower one advances; a chip's cores together),
  so consecutive devices are ICI neighbours: a ring over them (`collectives` impl
  "ring") sends every hop over one link. Devices without coordinates (CPU, GPU) keep
  their order. `jax.devices()`' order and `mesh_utils.create_device_mesh` both jump
  across the torus at row ends on 3-D slices (v4, v5p)."""
  devices = list(devices)
  if not devices or not all(hasattr(d, "coords") for d in devices):
    return devices
  at = {}
  for d in sorted(devices, key=lambda d: getattr(d, "core_on_chip", 0)):
    at.setdefault(tuple(d.coords), []).append(d)
  X, Y, Z = (max(c[i] for c in at) + 1 for i in range(3))
  out, row = [], 0
  for z in range(Z):
    for y in (range(Y) if z % 2 == 0 else range(Y - 1, -1, -1)):
      for x in (range(X) if row % 2 == 0 else range(X - 1, -1, -1)):
        out += at.get((x, y, z), [])
      row += 1
  return out


def make_mesh(devices, model_parallel: int = 1, num_slices: int = 1) -> Mesh:
  """`("data",)` over `devices`; with `model_parallel > 1` a `("data", "model")` mesh
  whose inner axis groups `model_parallel` consecutive devices; with `num_slices > 1` a
  `"slice"` axis in front, each of its entries one slice's devices (by `slice_index`,
  else consecutive). Within a slice, TPU devices are in `ici_order`: the devices of a
  model group are ICI neighbours, and so, with `model_parallel=1`, are neighbours along
  the data axis."""
  devices = list(devices)
  if model_parallel < 1 or len(devices) % (model_parallel * num_slices):
    raise ValueError(f"--model_parallel={model_parallel} x --num_slices={num_slices} does "
                     f"not divide the {len(devices)} devices")
  if device_slices(devices) > 1:  # slice-major, each slice in its own order
    by_slice = {}
    for d in devices:
      by_slice.setdefault(d.slice_index, []).append(d)
    devices = [d for i in sorted(by_slice) for d in ici_order(by_slice[i])]
  else:
    devices = ici_order(devices)
  grid = np.array(devices).reshape(num_slices, -1, model_parallel)
  names = (SLICE, DATA, MODEL)
  keep = [num_slices > 1, True, model_parallel > 1]
  return Mesh(grid.reshape([n for n, k in zip(grid.shape, keep) if k]),
              tuple(name for name, k in zip(names, keep) if k))


def gather_stages(mesh: Mesh) -> tuple[int, ...] | None:
  """The stages of an FSDP weight gather over "data" (`collectives.all_gather`): the
  x, y and z extents of a 3-D TPU slice that is the whole mesh, else None (one gather).
  On such a slice (v4, v5p from 4x4x4: checked ahead of time on v5p-128) the TPU
  compiler makes a gather over all its chips an all-reduce, twice the bytes, and keeps a
  gather along each torus dimension in turn a gather; in `ici_order` the first stage's
  groups are torus rows."""
  devices = list(mesh.devices.reshape(-1))
  if mesh.axis_names != (DATA,) or not all(hasattr(d, "coords") for d in devices):
    return None
  extents = tuple(len({d.coords[k] for d in devices}) for k in range(3))
  if min(extents) == 1 or int(np.prod(extents)) != len(devices):
    return None
  return extents


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
