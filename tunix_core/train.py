"""The DPO training loop: data in, steps dispatched, metrics, evaluation, checkpoints.

`train(cfg)` reads top to bottom: load the data, build the step functions on a mesh of
every device, resume or initialise the state, optionally precompute the reference
log-probs, then loop. The loop dispatches step N+1 before it reads step N's metrics, so
the host never stalls the device; checkpoints are saved asynchronously.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

from tunix_core import checkpoint
from tunix_core import data as data_lib
from tunix_core import evaluate as evaluate_lib
from tunix_core import flops
from tunix_core import health as health_lib
from tunix_core import hf_source
from tunix_core import metrics as metrics_lib
from tunix_core import model as model_lib
from tunix_core import packing
from tunix_core import preemption
from tunix_core import ref_cache
from tunix_core import resume
from tunix_core import scored
from tunix_core import step as step_lib
from tunix_core.config import ConfigError
from tunix_core.config import TrainConfig


def _load_data(cfg: TrainConfig, tok: data_lib.Tokenizer, vocab_size: int, log):
  """`(train_set, eval_set or None)`, encoded; logs their sizes."""
  def load(path):
    return data_lib.load_dataset(path, tok, cfg.max_length, cfg.max_prompt_length,
                                 cfg.skip_bad_lines, vocab_size=vocab_size)
  train_set = load(cfg.train_data)
  eval_set = load(cfg.eval_data) if cfg.eval_data else None
  mismatches = train_set.num_prefix_mismatch + (eval_set.num_prefix_mismatch if eval_set
                                                else 0)
  log(f"data: {len(train_set)} train pairs ({train_set.num_dropped} dropped, "
      f"{train_set.num_skipped_lines} bad lines skipped)"
      + (f", {len(eval_set)} eval pairs" if eval_set else "")
      + (f"; {mismatches} responses tokenized apart from their prompt (the joint "
         "tokens did not start with the prompt's)" if mismatches else ""))
  if eval_set is not None and len(eval_set) < cfg.batch_size:
    raise ConfigError(f"--eval_data has {len(eval_set)} pairs, fewer than --batch_size")
  return train_set, eval_set


def _precompute_refs(cfg, steps, ref_params, train_set, eval_set, log):
  """Reference log-prob tables `(train, eval)` when `--precompute_ref_logps`, else Nones."""
  if not cfg.precompute_ref_logps:
    return None, None
  cache_dir = os.path.join(cfg.output_dir, "ref_cache")
  train_ref = ref_cache.precompute_ref_logps(steps, ref_params, train_set, cache_dir)
  eval_ref = (None if eval_set is None else
              ref_cache.precompute_ref_logps(steps, ref_params, eval_set, cache_dir))
  log(f"reference log-probs precomputed (cache: {cache_dir})")
  return train_ref, eval_ref


def _packing_spec(cfg: TrainConfig, num_devices: int, splits) -> packing.Spec | None:
  """The packed rows' static shapes (`tunix_core.packing`) for a device's micro-batch of
  any pairs of `splits`, or None without --prefix_sharing and --packing."""
  if not (cfg.prefix_sharing or cfg.packing):
    return None
  pairs = cfg.batch_size // (num_devices // cfg.model_parallel * cfg.grad_accum_steps)
  sizes = [packing.pair_sizes(data_lib.take_pairs(d, np.arange(len(d))), cfg.prefix_sharing)
           for d in splits]
  return packing.make_spec(sizes, pairs, cfg.prefix_sharing, cfg.packing)


def _every(n: int, step: int, last: int) -> bool:
  """True on multiples of `n` and on the last step; never when `n` is 0."""
  return bool(n) and (step % n == 0 or step == last)


def train(cfg: TrainConfig, log=print, devices=None) -> dict:
  """Runs DPO training on `devices` (default: all), resuming from and writing
  checkpoints in `{output_dir}/checkpoints`.

  Returns `{"train": last logged train row, "eval": last eval metrics, "state": final
  train state}`. Raises `preemption.Preempted` after saving on SIGTERM/SIGINT,
  `health.NonFiniteStep` when a step is NaN/Inf under `--on_nonfinite=stop`,
  `checkpoint.CheckpointWriteError` when a save fails, and `ConfigError`,
  `data_lib.DataError` or `checkpoint.CheckpointError` on bad input.
  """
  devices = devices or jax.devices()
  cfg.validate(len(devices))
  primary = jax.process_index() == 0
  log = log if primary else (lambda *_: None)
  try:
    os.makedirs(cfg.output_dir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--output_dir={cfg.output_dir!r} cannot be created: {e}") from None
  mcfg = cfg.model_config()
  tok = hf_source.tokenizer(cfg)
  train_set, eval_set = _load_data(cfg, tok, mcfg.vocab_size, log)

  splits = [d for d in (train_set, eval_set) if d is not None]
  scored_size = scored.block_size(max(scored.max_span(d.loss_mask) for d in splits),
                                  cfg.max_length)
  steps = step_lib.StepFunctions(cfg, step_lib.make_mesh(devices, cfg.model_parallel), mcfg,
                                 scored_size=scored_size,
                                 packed=_packing_spec(cfg, len(devices), splits))
  key = jax.random.PRNGKey(cfg.seed)
  ckpt = checkpoint.Checkpointer(os.path.join(cfg.output_dir, "checkpoints"), keep=cfg.keep,
                                 keep_period=cfg.keep_period or None)
  source = hf_source.source(cfg)
  state, meta = resume.resume(steps, ckpt, cfg, log, source=source)
  start = 0 if meta is None else meta["step"]
  # The reference is the frozen initial policy (on a resume: the pretrained weights
  # reloaded, or the init rebuilt from the seed), in its own buffers, so donating the
  # train state never invalidates it.
  ref_dtype = model_lib.DTYPES[cfg.ref_param_dtype()]
  if state is None:
    state = steps.init_state(key, hf_source.initial_params(cfg, steps))
    ref_params = jax.tree.map(lambda x: jnp.array(x, ref_dtype, copy=True), state["params"])
  else:
    ref_params = hf_source.initial_params(cfg, steps, ref_dtype) or steps.init_params(key)
    ref_params = jax.tree.map(lambda x: x.astype(ref_dtype), ref_params)
  num_params = sum(x.size for x in jax.tree.leaves(steps.param_shapes))
  mesh = " x ".join(f"{n} {axis}" for axis, n in steps.mesh.shape.items())
  log(f"model: {cfg.hf_model_dir or cfg.model} ({num_params:,} params, "
      f"{cfg.param_dtype}) on {len(devices)} "
      f"{devices[0].platform} device(s) in {jax.process_count()} process(es), mesh {mesh}")
  if steps.packed is not None:
    spec = steps.packed
    log(f"packed rows (--prefix_sharing={cfg.prefix_sharing}, --packing={cfg.packing}): "
        f"{spec.rows} x {spec.length} tokens and {spec.head} LM-head positions per "
        f"{spec.pairs} pairs, vs {2 * spec.pairs} x {cfg.max_length} unpacked")
  elif steps.scored_size is not None and steps.scored_size < cfg.max_length:
    log(f"LM head on the scored block of each row: {steps.scored_size} of "
        f"{cfg.max_length} positions (--head_on_scored)")
  train_ref, eval_ref = _precompute_refs(cfg, steps, ref_params, train_set, eval_set, log)
  if cfg.precompute_ref_logps:
    ref_params = None  # the step never runs the reference forward

  it = data_lib.BatchIterator(train_set, cfg.batch_size, cfg.seed,
                              state=meta["data_state"] if meta else None)
  writer = (metrics_lib.MetricsWriter(cfg.output_dir, resume_step=start, log=log)
            if primary else None)
  reference_forward = not (cfg.reference_free or cfg.precompute_ref_logps)
  progress = metrics_lib.Progress(
      writer, log, start, cfg.steps,
      step_flops=flops.step_flops(mcfg, cfg.batch_size, cfg.max_length, reference_forward),
      peak_flops=flops.matmul_peak(
          model_lib.DTYPES[mcfg.compute_dtype], n=1024,
          device=next(d for d in devices if d.process_index == jax.process_index()))
      * len(devices))

  def flush():
    """Logs the deferred step; a non-finite step found there stops or is counted."""
    health = progress.flush()
    if health is not None:
      health_lib.check_finite(health, cfg.on_nonfinite, lambda *_: None)

  def save(step):
    # Never checkpoint a state that went through a non-finite step under "stop" (this
    # read costs nothing extra: the save's fingerprints wait for the state anyway).
    health = jax.device_get(state["nonfinite"])
    health_lib.check_finite(health, cfg.on_nonfinite, log)
    digest = checkpoint.save_state(
        ckpt, step, dict(state, params=steps.logical_params(state["params"])),
        data_state=it.get_state(), num_shards=steps.num_devices, rng_key=key, config=cfg,
        model_config=mcfg, nonfinite=health, source=source,
        layout="fsdp" if steps.fsdp else "zero1", model_parallel=steps.model_parallel)
    log(f"checkpoint step {step}: saving asynchronously (content digest {digest})")

  try:
    with preemption.StopSignal() as stop:
      for step in range(start + 1, cfg.steps + 1):
        idx = it.next_indices()
        batch = ref_cache.with_ref(data_lib.take_pairs(train_set, idx), train_ref, idx)
        progress.count_tokens(int(batch["attention_mask"].sum()))
        state, metrics = steps.train_step(state, ref_params, steps.put_batch(batch))
        if step == start + 1 or (cfg.check_replicas_every
                                 and step % cfg.check_replicas_every == 0):
          steps.check_replicas(state["params"])
        flush()  # the previous step's metrics, read with this step queued
        if _every(cfg.log_every, step, cfg.steps):
          progress.defer(step, metrics)
        if eval_set is not None and _every(cfg.eval_every, step, cfg.steps):
          flush()
          progress.eval(step, evaluate_lib.evaluate(steps, state["params"], ref_params,
                                                    eval_set, eval_ref))
        if stop.should_stop(step):
          flush()
          save(step)
          ckpt.wait()
          log(f"stop signal: step {step} saved and committed")
          raise preemption.Preempted(step)
        if _every(cfg.save_every, step, cfg.steps):
          save(step)
      flush()
      health_lib.check_finite(jax.device_get(state["nonfinite"]), cfg.on_nonfinite, log)
  except BaseException:
    progress.close()
    ckpt.close(quiet=True)  # an error is on its way already; let pending saves finish
    raise
  progress.close()
  ckpt.close()
  log(f"done: steps {start + 1}-{cfg.steps} in {progress.elapsed()}")
  if cfg.export_hf_dir:
    hf_source.export(cfg, mcfg, steps.logical_params(state["params"]), log)
  return {"train": progress.last_train, "eval": progress.last_eval, "state": state}
