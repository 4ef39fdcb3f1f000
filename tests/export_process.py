"""One process of the 2-process export test (`test_export.py`), each on 4 CPU devices:
`python tests/export_process.py ADDRESS PROCESS_ID OUT BUDGET`.

Loads the llama3 fixture split over a `("hosts", "local")` mesh of both processes'
devices (one row per process; a leaf on "local" first where a dimension divides, then
on "hosts", so some blocks live on one process only and some on both), then writes it
with `hf.save_params` to `OUT/export` as the trainer's export does: each tensor gathered
to process 0 by `parallel.mesh.to_host` (`keep` there only, a `BUDGET` of device bytes).
Then every process gathers every leaf for itself (`keep` everywhere) and checks it
against the fixture read whole. Writes to `OUT/gathered_<PROCESS_ID>.json` what each
`process_allgather` call was given (`numpy` or not, shape, bytes) and, per tensor
handed to the gather, its bytes, how many processes hold its blocks and whether one of
its blocks lives on one process only.
"""

import functools
import json
import os
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_core import hf
from tunix_core.parallel import mesh as mesh_lib

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf", "llama3")


def main(address: str, process_id: int, out: str, budget: int) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(address, num_processes=2, process_id=process_id)
  mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("hosts", "local"))

  def spec(x):
    axes, free = [], ["local", "hosts"]
    for dim in x.shape:
      axis = next((a for a in free if dim % mesh.shape[a] == 0), None)
      axes.append(axis)
      free = [a for a in free if a != axis]
    return NamedSharding(mesh, P(*axes))

  cfg = hf.read_config(FIXTURE)
  whole = hf.load_params(FIXTURE, cfg)
  params = hf.load_params(FIXTURE, cfg, shardings=jax.tree.map(spec, whole))

  gathered, fetched = [], []
  allgather = multihost_utils.process_allgather

  def record_allgather(x, *args, **kw):
    gathered.append(dict(numpy=isinstance(x, np.ndarray), shape=list(np.shape(x)),
                         nbytes=int(x.nbytes)))
    return allgather(x, *args, **kw)

  def record_fetch(x, **kw):
    holders = {}  # block -> the processes whose devices hold it
    for d, index in x.sharding.devices_indices_map(x.shape).items():
      holders.setdefault(str(index), set()).add(d.process_index)
    fetched.append(dict(nbytes=int(x.nbytes), processes=len(set().union(*holders.values())),
                        lone=any(len(p) == 1 for p in holders.values()),
                        replicated=bool(x.sharding.is_fully_replicated)))
    return mesh_lib.to_host(x, **kw)

  multihost_utils.process_allgather = record_allgather
  hf.save_params(params, cfg, os.path.join(out, "export"), src_dir=FIXTURE, dtype="float32",
                 fetch=functools.partial(record_fetch, keep=process_id == 0, budget=budget))
  exported = list(gathered)
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(functools.partial(mesh_lib.to_host, budget=budget), params), whole)
  with open(os.path.join(out, f"gathered_{process_id}.json"), "w") as f:
    json.dump(dict(export=exported, fetched=fetched, kept=gathered[len(exported):]), f)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
