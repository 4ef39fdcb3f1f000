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


def snake(extents) -> list[tuple[int, ...]]:
  """The torus coordinates, one tuple per position, of the positions `0 .. prod(extents)`
  of a snake through a torus of `extents` (x first): position p's digits in the mixed
  radix `extents` (the first digit fastest) are its loop indices, and a coordinate runs
  backwards while the position's digits above it make an odd number, so consecutive
  positions are one step apart."""
  out = []
  for p in range(int(np.prod(extents))):
    coords, above = [], p
    for n in extents:
      digit, above = above % n, above // n
      coords.append(n - 1 - digit if above % 2 else digit)
    out.append(tuple(coords))
  return out


def ici_order(devices) -> list:
  """TPU devices along a snake through their torus coordinates (`snake`: z slowest, then
  y, then x, each reversing direction whenever a slower one advances; a chip's cores
  together), so consecutive devices are ICI neighbours: a ring over them (`collectives`
  impl "ring") sends every hop over one link. Devices without coordinates (CPU, GPU) keep
  their order. `jax.devices()`' order and `mesh_utils.create_device_mesh` both jump
  across the torus at row ends on 3-D slices (v4, v5p)."""
  devices = list(devices)
  if not devices or not all(hasattr(d, "coords") for d in devices):
    return devices
  at = {}
  for d in sorted(devices, key=lambda d: getattr(d, "core_on_chip", 0)):
    at.setdefault(tuple(d.coords), []).append(d)
  extents = [max(c[i] for c in at) + 1 for i in range(3)]
  return [d for c in snake(extents) for d in at.get(c, [])]


def stage_groups(stages: tuple, axis_size: int) -> list[list[list[int]]]:
  """Per stage of a gather in `stages` (torus extents, x first, their product the axis
  size), its `axis_index_groups` for positions in `snake` order (as `ici_order` lays
  out a slice's chips): stage i groups the positions whose coordinates differ only in
  coordinate i, a line of the torus, ascending. A coordinate's snake direction depends
  only on the digits above it, so a stage-i line holds every value of digit i once with
  the digits above fixed: gathering the stages in order leaves every shard in position
  order."""
  if int(np.prod(stages)) != axis_size:
    raise ValueError(f"gather stages {stages} do not multiply to the axis size {axis_size}")
  coords = snake(stages)
  out = []
  for i in range(len(stages)):
    lines = {}
    for p, c in enumerate(coords):
      lines.setdefault(c[:i] + c[i + 1:], []).append(p)
    out.append(list(lines.values()))
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
  x, y and z extents of a 3-D TPU slice that is the whole mesh, its chips in `ici_order`
  (as `make_mesh` lays them out), else None (one gather). On such a slice (v4, v5p from
  4x4x4: checked ahead of time on v5p-128) the TPU compiler makes a gather over all its
  chips an all-reduce, twice the bytes, and keeps a gather along each torus dimension in
  turn a gather; `stage_groups` makes each stage's groups lines of the torus."""
  devices = list(mesh.devices.reshape(-1))
  if mesh.axis_names != (DATA,) or not all(hasattr(d, "coords") for d in devices):
    return None
  extents = tuple(len({d.coords[k] for d in devices}) for k in range(3))
  if (min(extents) == 1 or int(np.prod(extents)) != len(devices)
      or ici_order(devices) != devices):  # the stage groups are lines in this order only
    return None
  return extents


def batch_axes(mesh: Mesh):
  """The mesh axes a batch's pairs split over: every data-parallel device of every
  slice (`"data"`, or `("slice", "data")`)."""
  return (SLICE, DATA) if SLICE in mesh.axis_names else DATA


def slice_axis(mesh: Mesh) -> str | None:
  """The axis across slices, or None on one slice."""
  return SLICE if SLICE in mesh.axis_names else None


# Device bytes per chip one round of `to_host` may take: every process's piece.
GATHER_BYTES = 64 * 2**20
# Pieces travel as [rows, _ROW] bytes: a TPU tiles an array's two minor dimensions
# (32 x 128 for 8-bit types), so a flat piece, gathered as [processes, n], would have
# its processes padded to 32 rows: up to 32 times its bytes on every chip.
_ROW = 1024


def to_host(x: jax.Array, keep: bool = True, budget: int = GATHER_BYTES):
  """The global value of `x` (any shape and dtype) as a NumPy array of its shape on a
  process that `keep`s it, None on the others; where other processes hold some of its
  shards, a collective: every process calls it, for the same arrays in the same order.

  Device memory stays bounded whatever the size of `x`: beyond `x` itself each chip
  holds at most `budget` bytes, plus its own process's piece of them; no chip ever holds
  `x` replicated (gathering `x` itself would put Llama-3-70B's float32 embedding, 4.2 GB,
  on every chip). Each process copies the blocks of `x` its devices hold to host; a
  block that some process lacks is sent by the first process holding it. The bytes to
  send travel in rounds: in each, every process contributes a piece of at most
  `budget / process_count` bytes (uint8 `[rows, _ROW]`; a short last round's rows a
  power of two: few shapes, few compiles), and `process_allgather` of that NumPy piece
  puts `[process_count, rows, _ROW]` on every chip. On host, each process holds its own
  blocks of `x`; one that keeps the value also `x` and the bytes it received (at most
  `x` again)."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x)) if keep else None
  me, n = jax.process_index(), jax.process_count()
  key = lambda index: tuple(s.indices(d)[:2] for s, d in zip(index, x.shape))
  holders = {}   # block (start, stop per dimension) -> processes holding it
  for device, index in x.sharding.devices_indices_map(x.shape).items():
    holders.setdefault(key(index), set()).add(device.process_index)
  sender = {k: min(p) for k, p in sorted(holders.items()) if len(p) < n}
  shape = lambda k: tuple(b - a for a, b in k)
  nbytes = lambda k: int(np.prod(shape(k))) * x.dtype.itemsize
  lengths = [sum(nbytes(k) for k, p in sender.items() if p == q) for q in range(n)]
  local = {key(s.index): np.asarray(s.data) for s in x.addressable_shards}
  stream = np.concatenate([np.zeros(0, np.uint8)] + [
      local[k].reshape(-1).view(np.uint8) for k, p in sender.items() if p == me])
  cap = max(1, budget // n // _ROW) * _ROW   # bytes of one process's piece
  received = [[] for _ in range(n)]
  for lo in range(0, max(lengths), cap):
    rows = -(-min(cap, max(lengths) - lo) // _ROW)
    rows = min(1 << (rows - 1).bit_length(), cap // _ROW)  # few shapes: few compiles
    piece = np.zeros(rows * _ROW, np.uint8)
    part = stream[lo:lo + rows * _ROW]
    piece[:part.size] = part
    got = multihost_utils.process_allgather(piece.reshape(rows, _ROW))
    if keep:
      for q in range(n):
        received[q].append(got[q].reshape(-1)[:max(0, lengths[q] - lo)].copy())
  if not keep:
    return None
  out = np.empty(x.shape, x.dtype)
  streams = [np.concatenate([np.zeros(0, np.uint8)] + r) for r in received]
  offsets = [0] * n
  for k, q in sender.items():   # each sender's blocks in the order it concatenated them
    start, offsets[q] = offsets[q], offsets[q] + nbytes(k)
    if k not in local:
      out[tuple(slice(a, b) for a, b in k)] = (
          streams[q][start:offsets[q]].view(x.dtype).reshape(shape(k)))
  for k, value in local.items():
    out[tuple(slice(a, b) for a, b in k)] = value
  return out
