"""Device meshes of a run, and reading a sharded array back on the host."""

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh


def make_mesh(devices, model_parallel: int = 1) -> Mesh:
  """`("data",)` over `devices`, or with `model_parallel > 1` a `("data", "model")` mesh
  whose inner axis groups `model_parallel` consecutive devices (on one host, so the
  per-layer psums stay on its fastest links)."""
  devices = np.array(devices)
  if model_parallel == 1:
    return Mesh(devices, ("data",))
  if model_parallel < 1 or devices.size % model_parallel:
    raise ValueError(f"--model_parallel={model_parallel} does not divide the "
                     f"{devices.size} devices")
  return Mesh(devices.reshape(-1, model_parallel), ("data", "model"))


def to_host(x: jax.Array) -> np.ndarray:
  """The global value of `x` as NumPy, also when other processes hold some shards."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
