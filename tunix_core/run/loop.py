"""The DPO training loop: data in, steps dispatched, metrics, evaluation, checkpoints.

`train(cfg)` reads top to bottom: load the data, plan the step from it
(`training.plan`: the very plan `--compile_only` compiles), build its step functions on
a mesh of every device, resume or initialise the state, optionally precompute the
reference log-probs, then loop. The loop dispatches step N+1 before it reads step N's
metrics, so the host never stalls the device; checkpoints are saved asynchronously, the
last step always.
"""

import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp

from tunix_kernels import tpu
from tunix_core import data as data_lib
from tunix_core import generate
from tunix_core import model as model_lib
from tunix_core import online as online_lib
from tunix_core.checkpoints import resume
from tunix_core.checkpoints import store as checkpoint
from tunix_core.run import compile_cache
from tunix_core.run import evaluate as evaluate_lib
from tunix_core.run import metrics as metrics_lib
from tunix_core.run import observe
from tunix_core.run import preemption
from tunix_core.run import ref_cache
from tunix_core.run import samples as samples_lib
from tunix_core.run import source as source_lib
from tunix_core.run import watchdog as watchdog_lib
from tunix_core.storage import paths
from tunix_core.training import executables
from tunix_core.training import flops
from tunix_core.training import health as health_lib
from tunix_core.training import plan as plan_lib
from tunix_core.training import fit as fit_lib
from tunix_core.training import step as step_lib
from tunix_core.training.config import ConfigError
from tunix_core.training.config import TrainConfig


@functools.partial(jax.jit, static_argnums=1)
def frozen_copy(params: dict, dtype) -> dict:
  """`params` in `dtype` in buffers of their own (donating the train state then never
  frees the reference), as one executable: a copy per leaf compiles (or loads from the
  compilation cache) once per leaf shape, seconds of a start-up."""
  return jax.tree.map(lambda x: jnp.array(x, dtype, copy=True), params)


class Hooks(typing.NamedTuple):
  """Where tests inject faults (`tests/fault_trainer.py`); each does nothing here.
  `on_beat(what)`: as each named piece of work starts, by the name the watchdog gives it
  ("train step 5", "reference log-probs: batch 3/64 of data.jsonl", ...), before it
  runs; `after_read(step, idx, pairs)`: step `step` drew the pairs `idx` of the token
  store `pairs` (whose `last_read` are those this process read)."""
  on_beat: typing.Callable = lambda what: None
  after_read: typing.Callable = lambda step, idx, pairs: None


def _precompute_refs(cfg, steps, ref_params, train_set, eval_set, log, beat):
  """Reference log-prob tables `(train, eval)` when the plan's reference is
  precomputed, else Nones."""
  if steps.plan.reference != "precomputed":
    return None, None
  cache_dir = source_lib.data_cache_dir(cfg)
  beat = functools.partial(beat, kind="reference batch")  # the first batch compiles
  train_ref, eval_ref = (None if pairs is None else ref_cache.precompute_ref_logps(
      steps, ref_params, pairs, cache_dir, log, beat) for pairs in (train_set, eval_set))
  log(f"reference log-probs precomputed (cache: {cache_dir})")
  return train_ref, eval_ref


def _every(n: int, step: int, last: int) -> bool:
  """True on multiples of `n` and on the last step; never when `n` is 0."""
  return bool(n) and (step % n == 0 or step == last)


def train(cfg: TrainConfig, log=print, devices=None, hooks: Hooks = Hooks()) -> dict:
  """Runs DPO training on `devices` (default: all), resuming from and writing
  checkpoints in `{output_dir}/checkpoints`; `hooks`: fault injection (`Hooks`).

  Returns `{"train": last logged train row, "eval": last eval metrics, "state": final
  train state}`. Raises `preemption.Preempted` after saving on SIGTERM/SIGINT,
  `health.NonFiniteStep` when a step is NaN/Inf under `--on_nonfinite=stop`,
  `checkpoint.CheckpointWriteError` when a save fails, and `ConfigError`,
  `data_lib.DataError` or `checkpoint.CheckpointError` on bad input. Work that outlives
  `--step_timeout` ends the process with `exit_status.WATCHDOG` (`run.watchdog`).
  """
  devices = devices or jax.devices()
  cfg.validate(len(devices))
  if cfg.reward_fn:  # user code: imported before any data is read or compiled
    online_lib.load_reward(cfg.reward_fn)
  if cfg.reward_model:
    online_lib.check_reward_model(cfg.reward_model)
  with watchdog_lib.Watchdog(cfg.step_timeout) as dog:

    def beat(what: str, first: bool = False, kind: str | None = None,
             open_ended: bool = False) -> None:
      """Names the work that starts now to the watchdog (`Watchdog.beat`) and the hooks."""
      dog.beat(what, first, kind, open_ended)
      hooks.on_beat(what)

    return _train(cfg, devices, log, beat, hooks)


def _train(cfg, devices, log, beat, hooks):
  """`train` under the watchdog, to which `beat` names each piece of blocking work."""
  # Start-up beats once per unit of its work (a chunk tokenized, a weight tensor read, a
  # reference batch), each under the longer deadline: a stall ends it, not its length.
  startup = functools.partial(beat, first=True)
  startup("start-up: the output directory and the data")
  primary = jax.process_index() == 0
  # Each process says what only it knows (its share of the weights' bytes); the rest is
  # process 0's to say.
  host_log = log if jax.process_count() == 1 else (
      lambda line, say=log: say(f"process {jax.process_index()}: {line}"))
  log = log if primary else (lambda *_: None)
  try:
    paths.makedirs(cfg.output_dir)
  except paths.StorageError as e:
    raise ConfigError(f"--output_dir={cfg.output_dir!r} cannot be created: {e}") from None
  train_set, eval_set = source_lib.load_data(cfg, log, beat=startup)
  key = jax.random.PRNGKey(cfg.seed)
  ckpt = checkpoint.Checkpointer(paths.join(cfg.output_dir, "checkpoints"), keep=cfg.keep,
                                 keep_period=cfg.keep_period or None)
  cfg = resume.saved_micro_batches(ckpt, cfg, log)  # a resume splits batches as before
  sizes = plan_lib.data_sizes(cfg, [d for d in (train_set, eval_set) if d is not None])
  plan = plan_lib.make_plan(cfg, devices, sizes)
  steps = step_lib.make_steps(plan, devices)
  # The step compiles (or loads from the compilation cache) on a thread while the state
  # is made; under --remat=auto or --grad_accum_steps=auto that thread first chooses
  # (`training.fit`, compiling the candidate it takes), which the state does not wait
  # for: its shapes and placement are every candidate's.
  warmup = compile_cache.Warmup(
      lambda chosen: executables.compile_step(chosen, executables.store_dir(devices), log),
      choose=lambda: fit_lib.fit_steps(cfg, plan, steps, devices, sizes, log, startup))
  startup("start-up: the newest checkpoint and the weights")
  source = source_lib.source(cfg)
  state, meta = resume.resume(steps, ckpt, cfg, log, source=source, legacy_fingerprint=(
      lambda: source_lib.fingerprint(cfg.hf_model_dir, legacy=True)), data_key=train_set.key)
  start = 0 if meta is None else meta["step"]
  # An --init_from run's weights: the step recorded (on a resume: at its first start).
  start_cfg, source = source_lib.pin_reference(cfg, meta, source)
  # The reference is the frozen initial policy (on a resume: the pretrained weights
  # reloaded, or the init rebuilt from the seed), in its own buffers, so donating the
  # train state never invalidates it.
  ref_dtype = model_lib.DTYPES[plan.ref_dtype]
  if plan.lora is not None:  # the step's frozen input is the base (`parallel.lora`)
    ref_params, adapters = source_lib.lora_start(start_cfg, steps, key, ref_dtype, host_log,
                                                 startup)
    state = state or steps.init_state(key, adapters)
  elif state is None:
    state = steps.init_state(key, source_lib.initial_params(start_cfg, steps, log=host_log,
                                                            beat=startup))
    ref_params = frozen_copy(state["params"], ref_dtype)
  else:
    ref_params = (source_lib.initial_params(start_cfg, steps, ref_dtype, host_log, startup)
                  or steps.init_params(key))
    ref_params = jax.tree.map(lambda x: x.astype(ref_dtype), ref_params)
  steps = warmup.choice()
  plan = steps.plan
  mcfg = plan.model
  count = lambda shapes: sum(x.size for x in jax.tree.leaves(shapes))
  num_params = count(getattr(steps.layout, "read", steps.base_layout).param_shapes)
  trained = (f"; LoRA: {count(steps.param_shapes):,} trained" if plan.lora else "")
  mesh = " x ".join(f"{n} {axis}" for axis, n in steps.mesh.shape.items())
  log(f"model: {cfg.hf_model_dir or cfg.model} ({num_params:,} params, "
      f"{cfg.param_dtype}{trained}) on {len(devices)} "
      f"{devices[0].platform} device(s) in {jax.process_count()} process(es), mesh {mesh}")
  log(plan.describe())
  train_ref, eval_ref = _precompute_refs(cfg, steps, ref_params, train_set, eval_set, log,
                                         beat)
  startup("start-up: metrics, profiler and sampler")
  if plan.reference != "step" and plan.lora is None:
    ref_params = None  # the step never runs the reference forward

  it = data_lib.BatchIterator(train_set, cfg.batch_size, cfg.seed,
                              state=meta["data_state"] if meta else None,
                              data_key=train_set.key, allow_data_change=cfg.allow_data_change)
  writer = (metrics_lib.MetricsWriter(cfg.output_dir, resume_step=start, log=log,
                                      sinks=observe.open_sinks(cfg, source, log))
            if primary else None)
  profiler = observe.Profiler(cfg, log)
  tok = source_lib.tokenizer(cfg)
  sampler = (samples_lib.Sampler(cfg, mcfg, tok, samples_lib.read_prompts(cfg), log, start,
                                 writer)
             if cfg.sample_every else None)  # every process joins the generation
  # Online DPO's sampling and scoring; with a reward alone, the greedy eval answers'.
  online = (online_lib.OnlineSampler(cfg, steps, train_set, tok,
                                     generate.eos_ids(cfg.hf_model_dir, tok))
            if cfg.reward_fn or cfg.reward_model else None)
  peak, peak_source = flops.peak_flops(
      next(d for d in devices if d.process_index == jax.process_index()),
      model_lib.DTYPES[mcfg.compute_dtype])
  log(f"MFU against {len(devices)} x {peak / 1e12:.3g} TFLOP/s ({peak_source})")
  progress = metrics_lib.Progress(writer, log, start, cfg.steps,
                                  step_flops=flops.step_flops(plan, tpu.target_chip()),
                                  peak_flops=peak * len(devices))

  def flush():
    """Logs the deferred step; a non-finite step found there stops or is counted."""
    health = progress.flush()
    if health is not None:
      health_lib.check_finite(health, cfg.on_nonfinite, lambda *_: None)

  def save(step):
    # Named with its destination (Orbax's own writes are not calls the watchdog names);
    # the first save compiles its gathers.
    beat(f"saving checkpoint step {step} to {ckpt.directory}", kind="save")
    # Never checkpoint a state that went through a non-finite step under "stop" (this
    # read costs nothing extra: the save's fingerprints wait for the state anyway).
    health = jax.device_get(state["nonfinite"])
    health_lib.check_finite(health, cfg.on_nonfinite, log)
    if writer is not None:
      writer.sync()  # the rows up to this step are stored before it can commit
    digest = checkpoint.save_state(
        ckpt, step, dict(state, params=steps.logical_params(state["params"])),
        data_state=it.get_state(), num_shards=steps.num_devices, rng_key=key,
        config=dataclasses.replace(cfg, grad_accum_steps=plan.micro_batches),
        model_config=mcfg, nonfinite=health, source=source,
        layout=steps.layout.name, model_parallel=steps.model_parallel)
    log(f"checkpoint step {step}: saving asynchronously (content digest {digest})")
    if writer is not None:
      writer.note(f"checkpoint/{step}", digest)

  startup(f"compiling step {start + 1}")
  log(warmup.describe(f"step {start + 1}"))
  train_step = executables.TrainStep(steps, warmup.compiled, log)
  try:
    with preemption.StopSignal() as stop:
      if sampler and start == 0:
        beat("sampling at step 0", kind="sampling")
        sampler(0, steps.policy_params(state["params"], ref_params))  # the run's start
      for step in range(start + 1, cfg.steps + 1):
        # Step N's batch read and dispatch, and the wait for step N - 1 (its metrics are
        # read below): the first step may compile again, the second waits for its run.
        beat(f"train step {step}", first=step <= start + 2)
        idx = it.next_indices()
        sampled = {}
        if cfg.online_samples:  # the pairs of the policy's own samples of these prompts
          batch, sampled = online(step, steps.policy_params(state["params"], ref_params), idx)
          progress.count_tokens(int(batch["attention_mask"].sum()))
        else:
          batch = ref_cache.host_batch(steps, train_set, idx, train_ref)
          progress.count_tokens(train_set.num_tokens(idx))
        hooks.after_read(step, idx, train_set)
        profiler.before(step)
        with compile_cache.FirstCompile() as compiled:
          state, metrics = train_step(state, ref_params, steps.put_batch(batch))
        if step == start + 1 and compiled.compiles:  # a plan whose inputs differ
          log(f"{compiled.describe(f'step {step}')} again at its first call: its inputs "
              "differ from the step's abstract inputs")
        profiler.after(step, state)
        if step == start + 1 or (cfg.check_replicas_every
                                 and step % cfg.check_replicas_every == 0):
          steps.check_replicas(state["params"])
        if step > start + 1:  # the wait for step N - 1's run, queued ahead of step N
          beat(f"train step {step - 1}: its run", first=step - 1 <= start + 2)
        flush()  # the previous step's metrics, read with this step queued
        if _every(cfg.log_every, step, cfg.steps):
          progress.defer(step, dict(metrics, **sampled))
        if eval_set is not None and _every(cfg.eval_every, step, cfg.steps):
          flush()
          say = lambda what: beat(f"evaluation at step {step}: {what}", kind="evaluation")
          means = evaluate_lib.evaluate(steps, state["params"], ref_params, eval_set,
                                        eval_ref, say)
          if online is not None:
            say("greedy answers")
            means.update(online.evaluate(steps.policy_params(state["params"], ref_params),
                                         eval_set))
          progress.eval(step, means)
        if sampler and _every(cfg.sample_every, step, cfg.steps):
          flush()
          beat(f"sampling at step {step}", kind="sampling")
          sampler(step, steps.policy_params(state["params"], ref_params))
        if stop.should_stop(step):
          flush()
          save(step)
          ckpt.wait()
          log(f"stop signal: step {step} saved and committed")
          raise preemption.Preempted(step)
        if _every(cfg.save_every, step, cfg.steps) or step == cfg.steps:
          flush()  # its row is written before the step can be restored
          save(step)
      beat(f"train step {cfg.steps}")  # its end: its metrics are read
      flush()
      health_lib.check_finite(jax.device_get(state["nonfinite"]), cfg.on_nonfinite, log)
      profiler.stop()  # a range past the last step ends with the run
  except BaseException:
    profiler.stop()
    progress.close(upload=False)  # the error may be the storage's: no more uploads
    ckpt.close(quiet=True)  # an error is on its way already; let pending saves finish
    raise
  beat("writing the last metrics and waiting for the last checkpoint")
  progress.close()
  ckpt.close()
  log(f"done: steps {start + 1}-{cfg.steps} in {progress.elapsed()}")
  if cfg.export_hf_dir:
    beat(f"exporting to {cfg.export_hf_dir}", first=True)
    source_lib.export(cfg, steps, state["params"], ref_params, log)
  return {"train": progress.last_train, "eval": progress.last_eval, "state": state}
