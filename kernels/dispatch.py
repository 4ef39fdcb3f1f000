"""The one dispatch layer of the kernels: implementation names, shared constants, "auto".

Every op takes `impl` from `IMPLS` and resolves it with `resolve_impl`: "auto" becomes
"pallas" when the devices the computation is being compiled for are TPUs and "xla"
otherwise. That platform comes from the mesh the computation is traced under (see
`target_platform`), not from the process's default backend, so a CPU host that lowers
a `shard_map` over a TPU mesh ahead of time gets the TPU kernels.
"""

import jax

IMPLS = ("auto", "xla", "naive", "pallas", "interpret")
# TPU vregs are 8 sublanes x 128 lanes: vocabulary and sequence blocks are multiples of
# LANES, row statistics are kept lane-replicated `[rows, LANES]`.
LANES = 128
# The target id of positions that are not scored: they return 0 and get zero gradient.
IGNORE_INDEX = -100


def _mesh_device(mesh):
  """First device of a mesh, or None for an empty mesh or one without devices.

  An `AbstractMesh` carries an `abstract_device` (None when it was built without one;
  it has `platform` and `device_kind`); a concrete `Mesh` has real devices. Attributes
  are read defensively because their names are not part of JAX's stable API.
  """
  if mesh is None or getattr(mesh, "empty", True):
    return None
  device = getattr(mesh, "abstract_device", None)
  if device is None:
    devices = getattr(mesh, "devices", None)
    device = devices.flat[0] if devices is not None and devices.size else None
  return device


def _concrete_mesh():
  """The concrete context mesh (`jax.set_mesh`), or None; JAX only exposes it outside jit."""
  get_mesh = getattr(jax.sharding, "get_mesh", None)
  if get_mesh is None:
    return None
  try:
    return get_mesh()
  except ValueError:  # called under a trace; the abstract mesh answers there
    return None


def target_device():
  """A device (or `AbstractDevice`) of the kind the current computation is compiled for,
  or None when no mesh says so.

  In order: the abstract mesh of the context (inside `jax.shard_map`, under
  `jax.set_mesh` or `jax.sharding.use_abstract_mesh`), then the concrete context mesh.
  """
  abstract = getattr(jax.sharding, "get_abstract_mesh", lambda: None)()
  device = _mesh_device(abstract)
  if getattr(device, "platform", None) is None:
    device = _mesh_device(_concrete_mesh())
  return device if getattr(device, "platform", None) else None


def target_platform() -> str:
  """The platform ("tpu", "cpu", "gpu") the current computation is being compiled for.

  The platform of `target_device()`, else `jax.default_backend()` when no mesh says
  otherwise. Lowering for TPU from a CPU host without any mesh (a bare
  `jax.export(..., platforms=["tpu"])`) therefore reports "cpu"; trace under a TPU mesh
  (or `AbstractMesh`) to target TPU ahead of time.
  """
  device = target_device()
  return device.platform if device is not None else jax.default_backend()


def resolve_impl(op: str, impl: str) -> str:
  """Checks that `impl` is one of `IMPLS` (ValueError naming `op` if not) and resolves
  "auto" to "pallas" when compiling for TPU, else to "xla"; other names pass through."""
  if not isinstance(impl, str) or impl not in IMPLS:
    raise ValueError(f"unknown {op} impl {impl!r}; choose one of {IMPLS}")
  if impl == "auto":
    return "pallas" if target_platform() == "tpu" else "xla"
  return impl
