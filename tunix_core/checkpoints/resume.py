"""Resuming: find the newest usable checkpoint step, check it and restore it on this mesh.

A step is usable when its metadata reads back, it was written by the same model and
run settings (`RESUME_FIELDS`), its arrays restore, and (with
`--verify_checkpoint`, the default) their fingerprints, recomputed on device, equal the
saved ones. Under `--resume=auto` an unusable step is moved aside and the next older one
is tried; under `--resume=required` it is an error. A step whose data position was saved
over other training data (another token store key) is refused before its state is read,
unless `--allow_data_change` (then the data iterator restarts the saved epoch).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp

from tunix_core import data as data_lib
from tunix_core.checkpoints.store import Checkpointer
from tunix_core.checkpoints.store import CheckpointError
from tunix_core.checkpoints.store import fingerprints
from tunix_core.parallel import layout as layout_lib
from tunix_core.parallel import lora as lora_layout
from tunix_core.parallel import zero
from tunix_core.training import config as config_lib
from tunix_core.training import optim


# What a resume must keep of the run's settings (the model's own fields apart): data
# order, optimizer state (its dtypes and error term), the frozen base.
# The schedule's shape is one; its horizon (--steps) is not: a resume with more steps
# stretches the decay from the saved step on, as transformers' Trainer does.
RESUME_FIELDS = ("max_length", "max_prompt_length", "seed", "batch_size", "optimizer",
                 "lr_schedule", "warmup_steps", "warmup_ratio",
                 "optimizer_dtype", "param_rounding", "quantize_base", "train_data",
                 "chat_template", "lora_rank", "lora_alpha", "lora_targets", "lora_rslora",
                 "lora_init", "init_from", "online_samples", "reward_fn",
                 "reward_model", "reward_weights",
                 "online_data_chosen", "online_temperature", "online_top_k", "online_top_p",
                 "online_max_new_tokens", "online_missing_eos_penalty")
# What a checkpoint written before one of `RESUME_FIELDS` existed ran with, where that
# differs from today's default (the schedule was constant after the warmup).
BEFORE_FIELD = {"lr_schedule": "constant"}
# How the step computes the same model, chosen per run and per device set (`--remat=auto`
# on fewer devices may rematerialise more): a resume need not match them.
EXECUTION_FIELDS = ("remat", "attention_impl")


def config_mismatch(saved: dict, current: dict, fields) -> str | None:
  """A message naming the first field in `fields` whose saved value differs, or None."""
  current = json.loads(json.dumps(current))  # as the metadata stores it: tuples as lists
  for field in fields:
    if field in saved and saved[field] != current.get(field):
      return (f"checkpoint was written with {field}={saved[field]!r} but this run has "
              f"{field}={current.get(field)!r}")
  return None


def source_mismatch(saved: dict, source: dict, legacy_fingerprint=None) -> str | None:
  """`config_mismatch` of the initial policy's `hf_fingerprint`. A saved one that differs
  still passes when it equals `legacy_fingerprint()` (asked only then): the weights'
  fingerprint as checkpoints of earlier versions (0.1.0 as released) computed it, ETags of `gs://` objects
  included, so those checkpoints resume."""
  mismatch = config_mismatch(saved, source, ("hf_fingerprint",))
  if mismatch and source.get("hf_fingerprint") and legacy_fingerprint is not None:
    return None if saved["hf_fingerprint"] == legacy_fingerprint() else mismatch
  return mismatch


def _saved_layout(steps, meta: dict):
  """The cut of the optimizer state the checkpoint described by `meta` was written in
  (older checkpoints carry no "layout" and no "model_parallel": they are ZeRO-1 without
  TP; before "single", one device's state was ZeRO-1's flat rows too)."""
  kw = dict(data_shards=meta["num_shards"], bucket_bytes=steps.plan.bucket_bytes,
            model_parallel=meta.get("model_parallel", 1),
            single=meta.get("layout") == "single")
  if steps.plan.lora is not None:  # the adapters' ZeRO-1 rows, whatever the base's layout
    return lora_layout.make(steps.mcfg, steps.plan.lora, steps.tx, **kw).cut
  return layout_lib.make(steps.mcfg, steps.tx, fsdp=meta.get("layout") == "fsdp", **kw).cut


def same_layout(steps, meta: dict) -> bool:
  return (meta["num_shards"] == steps.num_devices
          and meta.get("model_parallel", 1) == steps.model_parallel
          and meta.get("layout", "zero1") == steps.layout.name)


def predates_compensation(steps, meta: dict) -> bool:
  """Whether this run's optimizer is `optim.compensated` (bfloat16 params or moments)
  but the checkpoint of `meta` was written before that wrapper existed (its config has
  no `optimizer_dtype`): its state is the inner optimizer's alone."""
  init = jax.eval_shape(steps.tx.init, {"x": jax.ShapeDtypeStruct((1,), jnp.bfloat16)})
  return isinstance(init, optim.CompensatedState) and "optimizer_dtype" not in meta["config"]


def _recut(opt_state, old, steps):
  """`opt_state` laid out by `old`, re-cut in the layout of `steps`: its moments widened
  to float32 (8-bit ones are scaled per row of a device's piece), re-cut, and
  stored again as this run stores them (bfloat16 and float32 exactly)."""
  wide = jax.vmap(optim.widen_moments)(opt_state)
  cut = zero.relayout_opt_state(wide, old, steps.layout.cut)
  like = steps.abstract_opt_state()
  return jax.vmap(lambda s: optim.store_moments(s, like, jnp.uint32(0)))(cut)


def restore_state(steps, ckpt: Checkpointer, step: int, meta: dict) -> dict:
  """The train state at `step` (whose metadata is `meta`), placed on the mesh of `steps`
  (a `step.StepFunctions`) in its layout. Params are saved as logical arrays and restored
  into `steps.logical_shardings()` (split under FSDP) before they are cut; the optimizer
  state is re-cut when it was saved for another device count or layout (FSDP or not,
  --model_parallel). A state from before `optim.compensated` (`predates_compensation`)
  is wrapped, its error term (if this run keeps one) zero."""
  old = _saved_layout(steps, meta)
  divides = old.num_shards % steps.mesh.size == 0
  opt_abstract = zero.abstract_opt_state(old, steps.tx,
                                         steps.opt_sharding if divides else steps.replicated)
  params_abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      steps.param_shapes, steps.logical_shardings())
  legacy = predates_compensation(steps, meta)
  restored = ckpt.restore(step, {"params": params_abstract, "opt_state": (
      opt_abstract.inner if legacy else opt_abstract)})
  opt_state = restored["opt_state"]
  if legacy:
    zeros = lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding)
    opt_state = optim.CompensatedState(opt_state, jax.tree.map(zeros, opt_abstract.error),
                                       zeros(opt_abstract.count))
  if not same_layout(steps, meta):
    opt_state = jax.device_put(jax.jit(lambda s: _recut(s, old, steps),
                                       out_shardings=steps.rows)(opt_state), steps.opt_sharding)
  return {"params": steps.place_params(restored["params"]), "opt_state": opt_state,
          "step": jax.device_put(jnp.asarray(step, jnp.int32), steps.replicated),
          "nonfinite": steps.put_nonfinite(meta.get("nonfinite", [0, 0, 0]))}


def verify(steps, state: dict, meta: dict, params_only: bool = False
           ) -> tuple[int, list[str]]:
  """Recomputes the fingerprints of the restored `state` and compares them with the
  saved ones: `(arrays checked, paths that differ)`. Params are compared as the logical
  arrays they were saved as; the optimizer state only when it was restored in the
  layout it was saved in (and not `params_only`)."""
  tree = {"params": steps.logical_params(state["params"])}
  if same_layout(steps, meta) and not params_only and not predates_compensation(steps, meta):
    tree["opt_state"] = state["opt_state"]
  got = fingerprints(tree)
  want = meta["fingerprints"]
  return len(got), [k for k in got if got[k] != want.get(k)]


class _Unusable(Exception):
  """A step that cannot be resumed from: unreadable, or failing verification."""


def _unreadable(e: Exception) -> _Unusable:
  return _Unusable(f"is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:200]})")


def _load(steps, ckpt: Checkpointer, step: int, cfg, log, source: dict,
          legacy_fingerprint, data_key) -> tuple[dict, dict]:
  """`(state, meta)` of `step`, checked; `_Unusable` if damaged, `ConfigError` if it was
  written by a different run configuration, `DataError` if its data position is in
  another token store than `data_key` (unless `--allow_data_change`)."""
  try:
    meta = ckpt.read_meta(step)
  except Exception as e:  # noqa: BLE001 - Orbax raises many kinds on a damaged step
    raise _unreadable(e) from None
  mcfg = steps.mcfg
  mismatch = (config_mismatch(meta["model_config"], dataclasses.asdict(mcfg),
                              [f.name for f in dataclasses.fields(mcfg)
                               if f.name not in EXECUTION_FIELDS])
              or config_mismatch({**BEFORE_FIELD, **meta["config"]},
                                 dataclasses.asdict(cfg), RESUME_FIELDS)
              or source_mismatch(meta.get("source", {}), source, legacy_fingerprint))
  if mismatch:
    raise config_lib.ConfigError(f"cannot resume from step {step}: {mismatch}")
  # Before the restore: a refusal need not wait for the state to be read.
  refusal = data_lib.data_change(meta["data_state"], data_key)
  if refusal:
    if not cfg.allow_data_change:
      raise data_lib.DataError(f"cannot resume from step {step}: {refusal}")
    log(f"--allow_data_change: the training data changed since step {step}; epoch "
        f"{meta['data_state']['epoch']} restarts from its start over the new data")
  try:
    state = restore_state(steps, ckpt, step, meta)
  except Exception as e:  # noqa: BLE001
    raise _unreadable(e) from None
  if predates_compensation(steps, meta) and state["opt_state"].error is not None:
    log(f"checkpoint step {step} predates the bfloat16 params' error term: it resumes "
        "at zero (the rounding of steps before it stays lost)")
  if cfg.verify_checkpoint:
    n, bad = verify(steps, state, meta)
    if bad:
      raise _Unusable(f"fails verification: {len(bad)} arrays differ, e.g. {bad[0]}")
    log(f"checkpoint step {step}: {n} array fingerprints verified")
  return state, meta


def resume(steps, ckpt: Checkpointer, cfg, log, source: dict | None = None,
           legacy_fingerprint=None, data_key: str | None = None
           ) -> tuple[dict | None, dict | None]:
  """`(state, meta)` of the checkpoint `cfg.resume` says to resume from, on the mesh of
  `steps`, or `(None, None)` for a fresh start.

  Steps are tried newest first. Under "auto" a step that is unreadable or fails
  verification is reported in one line, moved aside (`Checkpointer.reject`) and the next
  older one is tried; under "required" it is a `CheckpointError`. A step written by a
  different configuration (or, per `source`, from different pretrained weights) is a
  `ConfigError` in either mode; `legacy_fingerprint` as `source_mismatch`'s. A step
  whose data position is in another token store than `data_key` (the training data's,
  `data.PairStore.key`) is a `DataError` naming `--allow_data_change`, unless it is set.
  """
  existing = ckpt.steps()
  if cfg.resume == "never":
    if existing:
      raise config_lib.ConfigError(
          f"--resume=never but {ckpt.directory} already holds checkpoints (steps "
          f"{existing}); use --resume=auto or another --output_dir")
    return None, None
  for step in reversed(existing):
    try:
      state, meta = _load(steps, ckpt, step, cfg, log, source or {}, legacy_fingerprint,
                          data_key)
    except _Unusable as e:
      msg = f"checkpoint step {step} in {ckpt.directory} {e}"
      if cfg.resume == "required":
        raise CheckpointError(msg) from None
      log(f"{msg}; moved aside to {ckpt.reject(step)}; trying the previous step")
      continue
    log(f"resumed from step {step} ({ckpt.directory}), data position {meta['data_state']}")
    return state, meta
  if cfg.resume == "required":
    raise CheckpointError(f"--resume=required but {ckpt.directory} holds no complete "
                          "checkpoint")
  return None, None


def saved_micro_batches(ckpt: Checkpointer, cfg, log):
  """`cfg` with `--grad_accum_steps=auto` replaced by the count its newest checkpoint
  was trained with, so a resume splits each batch as before (the gradient sums run in
  the same order: the resume is exact); `cfg` itself otherwise, and where that step's
  metadata does not read (`resume` then deals with it)."""
  if cfg.grad_accum_steps != "auto" or cfg.resume == "never" or not ckpt.steps():
    return cfg
  step = ckpt.steps()[-1]
  try:
    saved = ckpt.read_meta(step)["config"]["grad_accum_steps"]
  except Exception:  # noqa: BLE001 - a damaged step is `resume`'s to report
    return cfg
  if not str(saved).isdigit():
    return cfg
  log(f"--grad_accum_steps=auto: {saved} micro-batch(es), as checkpoint step {step} "
      "was trained")
  return dataclasses.replace(cfg, grad_accum_steps=int(saved))
