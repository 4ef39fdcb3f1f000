"""`--init_from=RUN_DIR[:STEP]`: a new run starts from the policy another run saved.

The saved step's params become the new run's initial policy and its frozen reference;
nothing else of that run is carried over (its data position, batch size, optimizer
state and step count). The step is read, never written: the other run may still be
training. Without `:STEP` the newest complete step is used, resolved at start-up and
recorded in the new run's checkpoints (`spec`) with a digest of its params' fingerprints
(`digest`): a resume reloads that very step, or refuses in one line when it is gone or
was saved again with other params (`run.source.pin_reference`).
"""

import dataclasses
import hashlib
import json
import os

import jax

from tunix_core import model as model_lib
from tunix_core.checkpoints.store import Checkpointer
from tunix_core.checkpoints.store import fingerprints
from tunix_core.storage import paths
from tunix_core.training.config import ConfigError

# The model's fields that are a run's choices, not the architecture the params fit.
RUN_CHOICES = ("param_dtype", "compute_dtype", "remat", "attention_impl", "lora_scale")


def _split(flag: str) -> tuple[str, int | None]:
  """`RUN_DIR[:STEP]` as `(run_dir, step or None)` (a `gs://` address keeps its colon)."""
  head, sep, tail = flag.rpartition(":")
  if sep and tail.isdigit():
    return head, int(tail)
  return flag, None


def _checkpoints(flag: str) -> tuple[Checkpointer, int]:
  """The other run's checkpoints, read-only, and the step to start from."""
  run_dir, step = _split(flag)
  directory = paths.join(run_dir, "checkpoints")
  if not paths.isdir(directory):
    raise ConfigError(f"--init_from={flag!r}: no checkpoints directory {directory}")
  ckpt = Checkpointer(directory, read_only=True)
  saved = ckpt.steps()
  if not saved:
    raise ConfigError(f"--init_from={flag!r}: {directory} holds no complete checkpoint")
  if step is None:
    step = saved[-1]
  elif step not in saved:
    raise ConfigError(f"--init_from={flag!r}: no complete step {step} in {directory} "
                      f"(saved: {saved})")
  return ckpt, step


def spec(flag: str) -> str:
  """`--init_from` with its step resolved, `RUN_DIR:STEP` with an absolute local path:
  what the new run's checkpoints record (a resume then reloads this very step)."""
  run_dir, _ = _split(flag)
  _, step = _checkpoints(flag)
  where = run_dir if paths.is_remote(run_dir) else os.path.abspath(run_dir)
  return f"{where}:{step}"


def digest(flag: str) -> str:
  """A digest of the saved fingerprints of the params at `--init_from`'s step."""
  ckpt, step = _checkpoints(flag)
  prints = {k: v for k, v in ckpt.read_meta(step)["fingerprints"].items()
            if k.startswith("['params']")}
  return hashlib.sha256(json.dumps(prints, sort_keys=True).encode()).hexdigest()[:32]


def load_params(flag: str, mcfg, shardings: dict, dtype) -> dict:
  """The logical params saved at `--init_from`'s step, placed by `shardings` (the
  logical arrays' placements) in `dtype`. A `ConfigError` when that run trained another
  architecture than `mcfg` or LoRA adapters (their step holds no whole model); the
  arrays are checked against the fingerprints saved with them."""
  ckpt, step = _checkpoints(flag)
  meta = ckpt.read_meta(step)
  saved = meta["config"]
  if saved.get("lora_rank") or saved.get("lora_init"):
    raise ConfigError(f"--init_from={flag!r}: step {step} holds LoRA adapters, not a whole "
                      "model; export that run with --export_merged and start from its "
                      "merged/ directory with --hf_model_dir")
  mine = dataclasses.asdict(mcfg)
  for name, value in meta["model_config"].items():
    got = mine.get(name)
    if name not in RUN_CHOICES and value != (list(got) if isinstance(got, tuple) else got):
      raise ConfigError(f"--init_from={flag!r}: step {step} is a model with {name}={value!r}"
                        f", this run's has {name}={got!r} (give the same --model or "
                        "--hf_model_dir)")
  as_saved = dataclasses.replace(mcfg, param_dtype=meta["model_config"]["param_dtype"])
  shapes = jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0), as_saved))
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          shapes, shardings)
  params = ckpt.restore_params(step, abstract)
  got = fingerprints({"params": params})
  bad = [k for k in got if got[k] != meta["fingerprints"].get(k)]
  if bad:
    raise ConfigError(f"--init_from={flag!r}: step {step} fails verification: {len(bad)} "
                      f"arrays differ from their saved fingerprints, e.g. {bad[0]}")
  return jax.tree.map(lambda x: x.astype(dtype), params)
