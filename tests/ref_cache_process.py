"""One process of the 2-process reference-cache test (`test_export.py`), each on 4 CPU
devices: `python tests/ref_cache_process.py ADDRESS PROCESS_ID OUT`.

Builds the token store of `OUT/pairs.jsonl` as the trainer does (`run.source.load_data`),
plans the step for it on both processes' 8 devices and precomputes the reference
log-probs of a random init into `OUT/cache` (a disk both processes see: process 0
writes). Every `parallel.mesh.to_host` call of the pass is recorded: whether this
process received the batch's log-probs. Writes `OUT/kept_<PROCESS_ID>.json`.
"""

import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runs  # pylint: disable=g-import-not-at-top,wrong-import-position
from tunix_core.parallel import mesh as mesh_lib  # pylint: disable=wrong-import-position
from tunix_core.run import ref_cache  # pylint: disable=wrong-import-position
from tunix_core.run import source as source_lib  # pylint: disable=wrong-import-position
from tunix_core.training import plan as plan_lib  # pylint: disable=wrong-import-position
from tunix_core.training import step as step_lib  # pylint: disable=wrong-import-position


def precompute(out: str, devices) -> ref_cache.RefTable:
  """The reference pass of `OUT/pairs.jsonl` on `devices` into `OUT/cache`."""
  cfg = runs.config(os.path.join(out, "run"), train_data=os.path.join(out, "pairs.jsonl"),
                    reference="precomputed", data_cache_dir=os.path.join(out, "data"))
  train_set, _ = source_lib.load_data(cfg, lambda *_: None)
  plan = plan_lib.make_plan(cfg, devices, plan_lib.data_sizes(cfg, [train_set]))
  steps = step_lib.make_steps(plan, devices)
  return ref_cache.precompute_ref_logps(steps, steps.init_params(jax.random.PRNGKey(0)),
                                        train_set, os.path.join(out, "cache"))


def main(address: str, process_id: int, out: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(address, num_processes=2, process_id=process_id)
  kept, to_host = [], mesh_lib.to_host

  def record(x, **kw):
    value = to_host(x, **kw)
    kept.append(value is not None)
    return value

  mesh_lib.to_host = record
  precompute(out, jax.devices())
  with open(os.path.join(out, f"kept_{process_id}.json"), "w") as f:
    json.dump(kept, f)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
