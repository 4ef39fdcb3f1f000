"""A saved step of a run as a Hugging Face directory (`python -m tunix_core.hf export`),
or, for a LoRA run, as a PEFT adapter directory.

The step's params are restored (and verified against their saved fingerprints) on the
local devices, whatever device count and layout wrote them, split over them as FSDP
splits them (1/N of every large array per device); the model config comes from the
checkpoint's metadata and the tokenizer and config files from the run's
`--hf_model_dir` (recorded in the metadata; `src_dir` overrides it).
"""

import dataclasses
from typing import NamedTuple

import jax

from tunix_core import hf
from tunix_core.hf import peft
from tunix_core import model as model_lib
from tunix_core.checkpoints import resume
from tunix_core.checkpoints import store as checkpoint
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.storage import paths
from tunix_core.training import config as config_lib
from tunix_core.training import plan as plan_lib
from tunix_core.training import step as step_lib


def _known(cls, values: dict) -> dict:
  """The entries of `values` that are fields of dataclass `cls` (older metadata may
  lack new fields, which keep their defaults)."""
  names = {f.name for f in dataclasses.fields(cls)}
  return {k: v for k, v in values.items() if k in names}


class SavedStep(NamedTuple):
  """A restored, verified step: its number, metadata, run and model configs, the step
  functions it was restored with (their plan: one-step, data-free, local devices, FSDP)
  and its params as logical arrays, each split over the devices as FSDP splits it (a
  LoRA run's: its adapters); no optimizer state."""
  step: int
  meta: dict
  cfg: config_lib.TrainConfig
  model: model_lib.ModelConfig
  steps: step_lib.StepFunctions
  logical: dict

  def params(self) -> dict:
    """The params as logical arrays (a LoRA run's: its adapters)."""
    return self.logical


def restore_step(output_dir: str, step: int | None = None) -> SavedStep:
  """Step `step` (default: the newest) of the run in `output_dir`, restored on the local
  devices and verified. Raises `checkpoint.CheckpointError` for a missing or damaged
  step."""
  ckpt = checkpoint.Checkpointer(paths.join(output_dir, "checkpoints"), async_save=False)
  try:
    available = ckpt.steps()
    if not available:
      raise checkpoint.CheckpointError(f"{ckpt.directory} holds no complete checkpoint")
    step = available[-1] if step is None else step
    if step not in available:
      raise checkpoint.CheckpointError(f"{ckpt.directory} has no step {step}; it has "
                                       f"{available}")
    meta = ckpt.read_meta(step)
    cfg = config_lib.TrainConfig(**_known(config_lib.TrainConfig, meta["config"]))
    mcfg = model_lib.ModelConfig(**_known(model_lib.ModelConfig, meta["model_config"]))
    # The params restore the same under any plan of this model: plan a one-step,
    # data-free run on the local devices, fully sharded (FSDP: each device holds 1/N of
    # every large array, so a model that trained on these devices exports on them).
    devices = jax.devices()
    plan_cfg = dataclasses.replace(
        cfg, model_parallel=1, num_slices=1, fsdp=True, compile_only=True, train_data="",
        eval_data="", eval_every=0, check_replicas_every=0, batch_size=len(devices),
        grad_accum_steps=1, hf_model_dir="", chat_template="auto", sample_every=0,
        sample_prompts="")  # the model config is the saved one
    steps = step_lib.make_steps(plan_lib.make_plan(plan_cfg, devices, model_config=mcfg),
                                devices)
    state = resume.restore_state(steps, ckpt, step, meta)
    _, bad = resume.verify(steps, state, meta, params_only=True)
    if bad:
      raise checkpoint.CheckpointError(f"step {step} fails verification: {len(bad)} arrays "
                                       f"differ, e.g. {bad[0]}")
  finally:
    ckpt.close(quiet=True)
  # Only the logical params go on (the step's cut of them and Adam's moments are
  # dropped): each device keeps 1/N of the params; the restore itself briefly holds
  # the moments and the cut too, 1/N each.
  return SavedStep(step, meta, cfg, mcfg, steps, steps.logical_params(state.pop("params")))


def export_step(output_dir: str, out_dir: str, step: int | None = None,
                dtype: str = "bfloat16", src_dir: str | None = None, log=print) -> int:
  """Writes step `step` (default: the newest) of the run in `output_dir` to `out_dir`;
  returns the step. Raises `checkpoint.CheckpointError` for a missing or damaged step."""
  saved = restore_step(output_dir, step)
  step, meta, cfg, mcfg, steps = saved.step, saved.meta, saved.cfg, saved.model, saved.steps
  src_dir = src_dir or meta.get("source", {}).get("hf_model_dir")
  if src_dir and not paths.isdir(src_dir):
    log(f"warning: {src_dir} is gone; exporting without its tokenizer files")
    src_dir = None
  params = saved.params()
  if steps.plan.lora is not None:  # a LoRA run's state is its adapters: a PEFT directory
    peft.write_adapter(out_dir, jax.tree.map(mesh_lib.to_host, params), mcfg, steps.plan.lora,
                       base_model=src_dir or cfg.model)
    log(f"exported step {step} of {output_dir} to {out_dir} (a PEFT LoRA adapter)")
    return step
  # One tensor at a time to the host: the devices keep their 1/N of the rest.
  hf.save_params(params, mcfg, out_dir, src_dir=src_dir, dtype=dtype,
                 fetch=mesh_lib.to_host)
  log(f"exported step {step} of {output_dir} to {out_dir} ({dtype}"
      + (f", tokenizer and config from {src_dir})" if src_dir else ")"))
  return step

