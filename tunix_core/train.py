"""The DPO training loop: config, optimizer, jitted data-parallel step, eval and logging.

Data parallelism here is `jax.jit` over a one-axis mesh `("data",)`: params and
optimizer state are replicated, batch rows are split over devices, and XLA inserts the
gradient all-reduce.
"""

import dataclasses
import functools
import hashlib
import json
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kernels
from tunix_core import checkpoint
from tunix_core import collectives
from tunix_core import data as data_lib
from tunix_core import model as model_lib
from tunix_core import zero


class ConfigError(ValueError):
  """A setting that cannot work; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything a run depends on; the trainer's flags map one to one onto these fields."""

  output_dir: str
  train_data: str
  eval_data: str = ""
  model: str = "tiny"
  compute_dtype: str = "float32"
  remat: str = "none"
  max_length: int = 64
  max_prompt_length: int = 32
  skip_bad_lines: bool = False
  steps: int = 100
  batch_size: int = 8
  seed: int = 0
  optimizer: str = "adamw"
  learning_rate: float = 1e-3
  warmup_steps: int = 0
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  beta: float = 0.1
  loss_type: str = "sigmoid"
  label_smoothing: float = 0.0
  reference_free: bool = False
  precompute_ref_logps: bool = False
  logprob_impl: str = "auto"
  loss_impl: str = "auto"
  bucket_mb: float = 25.0
  sync_impl: str = "xla"
  grad_sync_dtype: str = "float32"
  grad_accum_steps: int = 1
  check_replicas_every: int = 0
  log_every: int = 10
  eval_every: int = 0
  save_every: int = 0
  keep: int = 3
  keep_period: int = 0
  resume: str = "auto"
  verify_checkpoint: bool = False

  def validate(self, num_devices: int) -> None:
    """Raises ConfigError with one line naming the offending setting."""
    def need(cond, msg):
      if not cond:
        raise ConfigError(msg)

    need(self.model in model_lib.PRESETS,
         f"--model={self.model!r} is not a preset; choose one of {sorted(model_lib.PRESETS)}")
    need(self.loss_type in kernels.LOSS_TYPES,
         f"--loss_type={self.loss_type!r} is unknown; choose one of {kernels.LOSS_TYPES}")
    need(self.optimizer in OPTIMIZERS,
         f"--optimizer={self.optimizer!r} is unknown; choose one of {sorted(OPTIMIZERS)}")
    need(self.resume in ("auto", "never", "required"),
         f"--resume={self.resume!r} must be auto, never or required")
    need(self.logprob_impl in kernels.LOGPROB_IMPLS,
         f"--logprob_impl={self.logprob_impl!r}; choose one of {kernels.LOGPROB_IMPLS}")
    need(self.loss_impl in kernels.DPO_LOSS_IMPLS,
         f"--loss_impl={self.loss_impl!r}; choose one of {kernels.DPO_LOSS_IMPLS}")
    need(self.steps > 0, f"--steps must be positive, got {self.steps}")
    need(self.batch_size > 0, f"--batch_size must be positive, got {self.batch_size}")
    need(self.batch_size % num_devices == 0,
         f"--batch_size={self.batch_size} is not divisible by the {num_devices} devices")
    need(self.grad_accum_steps > 0, f"--grad_accum_steps must be positive, got "
         f"{self.grad_accum_steps}")
    need(self.batch_size % (num_devices * self.grad_accum_steps) == 0,
         f"--batch_size={self.batch_size} does not split into {self.grad_accum_steps} "
         f"micro-batches on each of {num_devices} devices")
    need(self.sync_impl in collectives.IMPLS,
         f"--sync_impl={self.sync_impl!r}; choose one of {collectives.IMPLS}")
    need(self.grad_sync_dtype in SYNC_DTYPES,
         f"--grad_sync_dtype={self.grad_sync_dtype!r}; choose one of {sorted(SYNC_DTYPES)}")
    need(self.bucket_mb > 0, f"--bucket_mb must be positive, got {self.bucket_mb}")
    need(self.check_replicas_every >= 0, "--check_replicas_every must be >= 0")
    need(0 < self.max_prompt_length < self.max_length,
         f"--max_prompt_length={self.max_prompt_length} must be positive and less than "
         f"--max_length={self.max_length}")
    need(self.beta > 0, f"--beta must be positive, got {self.beta}")
    need(self.learning_rate > 0, f"--learning_rate must be positive, got {self.learning_rate}")
    need(self.log_every > 0, f"--log_every must be positive, got {self.log_every}")
    need(self.eval_every >= 0, f"--eval_every must be >= 0, got {self.eval_every}")
    need(not (self.reference_free and self.precompute_ref_logps),
         "--precompute_ref_logps makes no sense with --reference_free")
    for name in ("train_data", "eval_data"):
      path = getattr(self, name)
      need(name == "eval_data" and not path or os.path.isfile(path),
           f"--{name}={path!r}: no such file")
    need(not (self.eval_every and not self.eval_data), "--eval_every needs --eval_data")

  def model_config(self) -> model_lib.ModelConfig:
    return model_lib.preset(self.model, compute_dtype=self.compute_dtype, remat=self.remat)


OPTIMIZERS = {"adamw", "rmsprop", "sgd"}
SYNC_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Linear warmup to `learning_rate`, then constant. Weight decay (adamw) skips the
  norm scales. Clipping is not in here: `ShardedOptimizer` clips by the global norm."""
  if cfg.warmup_steps > 0:
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  else:
    schedule = optax.constant_schedule(cfg.learning_rate)
  if cfg.optimizer == "adamw":
    def decay_mask(params):
      return jax.tree_util.tree_map_with_path(
          lambda path, _: not str(path[-1].key).endswith("norm"), params)
    tx = optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask)
  elif cfg.optimizer == "rmsprop":
    tx = optax.rmsprop(schedule)
  else:
    tx = optax.sgd(schedule)
  return tx, schedule


def sequence_logps(params, batch, mcfg: model_lib.ModelConfig, impl: str) -> jax.Array:
  """Per-token log-probs `[2B, T]` of the batch targets (0 where unscored)."""
  hidden = model_lib.forward(params, batch["tokens"], batch["attention_mask"], mcfg)
  head = model_lib.lm_head(params, mcfg).astype(hidden.dtype)
  return kernels.fused_logprobs(hidden, head, batch["targets"], impl=impl,
                                ignore_index=data_lib.IGNORE_INDEX)


def dpo_objective(params, ref_logps, batch, cfg: TrainConfig, mcfg: model_lib.ModelConfig):
  """DPO loss of `params` on a `[2B, T]` batch, given reference log-probs `[2B, T]`."""
  logps = sequence_logps(params, batch, mcfg, cfg.logprob_impl)
  mask = batch["loss_mask"]
  B = logps.shape[0] // 2
  return kernels.dpo_loss(
      logps[:B], logps[B:],
      None if ref_logps is None else ref_logps[:B],
      None if ref_logps is None else ref_logps[B:],
      chosen_mask=mask[:B], rejected_mask=mask[B:], beta=cfg.beta,
      loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
      reference_free=cfg.reference_free, impl=cfg.loss_impl)


def _rows(pairs_batch: dict) -> dict:
  """`[2, b, T]` (chosen, rejected) arrays -> `[2b, T]`, chosen rows first."""
  return {k: v.reshape((-1,) + v.shape[2:]) for k, v in pairs_batch.items()}


class Trainer:
  """The jitted, `shard_map`ped step functions for one config on a mesh axis "data".

  Params are replicated; each device runs the model on its own pairs, then
  `ShardedOptimizer` reduce-scatters the gradients in buckets, updates its 1/N of the
  params and optimizer state, and all-gathers the params. Optimizer-state leaves carry
  a leading `[N]` axis sharded over "data" (the local state of each device).

  Batches go to devices as `[2, B, T]` (chosen, rejected) split on B, so each device
  holds both rows of each of its pairs.
  """

  def __init__(self, cfg: TrainConfig, mesh: Mesh,
               model_config: model_lib.ModelConfig | None = None):
    self.cfg, self.mesh = cfg, mesh
    self.mcfg = model_config or cfg.model_config()
    self.num_devices = mesh.shape["data"]
    self.tx, self.schedule = make_optimizer(cfg)
    shapes = jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0), self.mcfg))
    self.plan = collectives.BucketPlan.create(shapes, self.num_devices,
                                              int(cfg.bucket_mb * 2**20))
    self.opt = zero.ShardedOptimizer(
        self.tx, self.plan, "data", max_grad_norm=cfg.max_grad_norm or None,
        impl=cfg.sync_impl, comm_dtype=SYNC_DTYPES[cfg.grad_sync_dtype])
    self.replicated = NamedSharding(mesh, P())
    self.pairs = NamedSharding(mesh, P(None, "data"))
    state_specs = {"params": P(), "opt_state": P("data"), "step": P()}
    smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    self.train_step = jax.jit(
        smap(self._train_step, in_specs=(state_specs, P(), P(None, "data")),
             out_specs=(state_specs, P())), donate_argnums=(0,))
    self.eval_step = jax.jit(smap(self._eval_step, in_specs=(P(), P(), P(None, "data")),
                                  out_specs=P()))
    self.ref_logps = jax.jit(smap(self._ref_logps, in_specs=(P(), P(None, "data")),
                                  out_specs=P(None, "data")))
    self._init_opt = jax.jit(smap(
        lambda params: jax.tree.map(lambda x: x[None], self.opt.init(params)),
        in_specs=P(), out_specs=P("data")))
    self._checksums = jax.jit(smap(self._checksum, in_specs=P(), out_specs=P("data")))

  def init_params(self, key: jax.Array) -> dict:
    return jax.jit(lambda k: model_lib.init_params(k, self.mcfg),
                   out_shardings=self.replicated)(key)

  def init_state(self, key: jax.Array) -> dict:
    params = self.init_params(key)
    return {"params": params, "opt_state": self._init_opt(params),
            "step": jax.device_put(jnp.zeros((), jnp.int32), self.replicated)}

  def _ref_logps(self, ref_params, batch):
    logps = sequence_logps(ref_params, _rows(batch), self.mcfg, self.cfg.logprob_impl)
    return jax.lax.stop_gradient(logps).reshape(batch["targets"].shape)

  def _resolve_ref(self, ref_params, batch):
    """Reference log-probs `[2b, T]` for a local `[2, b, T]` batch."""
    if self.cfg.reference_free:
      return None
    if "ref_logps" in batch:
      return _rows(batch)["ref_logps"]
    return _rows({"x": self._ref_logps(ref_params, batch)})["x"]

  def _train_step(self, state, ref_params, batch):
    k = self.cfg.grad_accum_steps
    micro = jax.tree.map(lambda x: x.reshape((x.shape[0], k, -1) + x.shape[2:]).swapaxes(0, 1),
                         batch)  # [k, 2, b/k, T]

    def micro_step(mb):
      ref = self._resolve_ref(ref_params, mb)
      (loss, metrics), grads = jax.value_and_grad(dpo_objective, has_aux=True)(
          state["params"], ref, _rows(mb), self.cfg, self.mcfg)
      return grads, dict(metrics, loss=loss)

    def accumulate(carry, mb):
      return jax.tree.map(jnp.add, carry, micro_step(mb)), None

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                         jax.eval_shape(micro_step, jax.tree.map(lambda x: x[0], micro)))
    (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
    # Local means over micro-batches; the sync averages over devices, once per step.
    grads, metrics = jax.tree.map(lambda x: x / k, (grads, metrics))
    opt_state = jax.tree.map(lambda x: x[0], state["opt_state"])
    params, opt_state, grad_norm = self.opt.update(grads, opt_state, state["params"],
                                                   return_grad_norm=True)
    metrics = jax.lax.pmean(metrics, "data")
    metrics = dict(metrics, grad_norm=grad_norm, learning_rate=self.schedule(state["step"]))
    new_state = {"params": params, "opt_state": jax.tree.map(lambda x: x[None], opt_state),
                 "step": state["step"] + 1}
    return new_state, metrics

  def _eval_step(self, params, ref_params, batch):
    loss, metrics = dpo_objective(params, self._resolve_ref(ref_params, batch), _rows(batch),
                                  self.cfg, self.mcfg)
    return jax.lax.pmean(dict(metrics, loss=loss), "data")

  @staticmethod
  def _checksum(params):
    """This device's params as one uint32: the wrapping sum of their bit patterns."""
    total = jnp.zeros((), jnp.uint32)
    for x in jax.tree.leaves(params):
      bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
      total = total + jnp.sum(bits, dtype=jnp.uint32)
    return total[None]

  def abstract_state(self, num_shards: int) -> dict:
    """Shapes and target shardings of `{"params", "opt_state"}` as saved by a run on
    `num_shards` devices, placed on this trainer's mesh."""
    params = jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0), self.mcfg))
    plan = collectives.BucketPlan.create(params, num_shards, self.plan.bucket_bytes)
    local = jax.eval_shape(lambda p: self.tx.init(plan.local_pieces(p, 0)), params)
    # Each saved device's state lands on this mesh split over "data" when the counts
    # divide, else replicated (it is re-cut below either way).
    spec = P("data") if num_shards % self.num_devices == 0 else P()
    opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (num_shards,) + x.shape, x.dtype, sharding=NamedSharding(self.mesh, spec)), local)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=self.replicated), params)
    return {"params": params, "opt_state": opt}, plan

  def restore_state(self, ckpt: checkpoint.Checkpointer, step: int, num_shards: int) -> dict:
    """The train state at `step`, saved on `num_shards` devices, on this mesh."""
    abstract, plan = self.abstract_state(num_shards)
    try:
      restored = ckpt.restore(step, abstract)
    except (ValueError, TypeError) as e:
      raise ConfigError(f"checkpoint step {step} does not fit this model: {e}") from None
    opt_state = restored["opt_state"]
    if num_shards != self.num_devices:
      opt_state = jax.jit(functools.partial(checkpoint.relayout_opt_state, plan_old=plan,
                                            plan_new=self.plan),
                          out_shardings=NamedSharding(self.mesh, P("data")))(opt_state)
    return {"params": restored["params"], "opt_state": opt_state,
            "step": jax.device_put(jnp.asarray(step, jnp.int32), self.replicated)}

  def check_replicas(self, params) -> None:
    """Raises if any device's copy of the replicated params differs from the others."""
    sums = _to_host(self._checksums(params))
    if (sums != sums[0]).any():
      raise RuntimeError(f"replicas diverged: per-device param checksums {sums.tolist()}")

  def put_batch(self, batch: dict) -> dict:
    """Host `[2B, T]` arrays of the global batch -> device `[2, B, T]`, pairs split over
    "data". Each process hands over only the pairs of its own devices."""
    out = {}
    n, p = jax.process_count(), jax.process_index()
    for k, v in batch.items():
      pairs = v.reshape((2, -1) + v.shape[1:])
      B = pairs.shape[1]
      local = pairs[:, p * B // n:(p + 1) * B // n]
      out[k] = jax.make_array_from_process_local_data(self.pairs, local, pairs.shape)
    return out


def _to_host(x: jax.Array) -> np.ndarray:
  """The global value of `x` as NumPy, also when other processes hold some shards."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _data_hash(dataset: data_lib.PreferenceDataset, ref_params) -> str:
  h = hashlib.sha256()
  for a in (dataset.tokens, dataset.targets, dataset.attention_mask):
    h.update(np.ascontiguousarray(a).tobytes())
  for leaf in jax.tree.leaves(ref_params):
    h.update(np.asarray(jax.device_get(leaf)).tobytes())
  return h.hexdigest()[:20]


def precompute_ref_logps(trainer: Trainer, ref_params, dataset: data_lib.PreferenceDataset,
                         cache_dir: str) -> np.ndarray:
  """Reference log-probs of every pair, float32 `[num_pairs, 2, T]`, cached on disk.

  The cache file name is a hash of the encoded data and the reference params (and the
  model config), so a change to either recomputes instead of reusing stale values.
  """
  key = _data_hash(dataset, ref_params) + hashlib.sha256(
      repr((trainer.mcfg, trainer.cfg.logprob_impl)).encode()).hexdigest()[:8]
  path = os.path.join(cache_dir, f"ref_logps_{key}.npy")
  if os.path.exists(path):
    return np.load(path)
  n, B = len(dataset), trainer.cfg.batch_size
  out = np.zeros(dataset.tokens.shape, np.float32)
  for start in range(0, n, B):
    idx = np.arange(start, start + B) % n  # wrap the last batch; extra rows are discarded
    batch = trainer.put_batch(data_lib.take_pairs(dataset, idx))
    logps = _to_host(trainer.ref_logps(ref_params, batch))  # [2, B, T]
    keep = min(B, n - start)
    out[start:start + keep] = logps[:, :keep].swapaxes(0, 1)
  os.makedirs(cache_dir, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp.npy"  # processes sharing the directory never collide
  np.save(tmp, out)
  os.replace(tmp, path)  # a crash never leaves a half-written cache behind
  return out


def with_ref(batch: dict, ref_table: np.ndarray | None, idx: np.ndarray) -> dict:
  if ref_table is None:
    return batch
  return dict(batch, ref_logps=np.concatenate([ref_table[idx, 0], ref_table[idx, 1]]))


def _fmt_duration(seconds: float) -> str:
  seconds = int(seconds)
  return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else \
      f"{seconds // 60}m{seconds % 60:02d}s"


class MetricsWriter:
  """Appends one JSON object per row to `{output_dir}/metrics.jsonl`.

  A fresh run (`resume_step=0`) starts the file anew; a resumed run keeps the rows up
  to its checkpoint step and drops later ones, which the resumed run writes again.
  """

  def __init__(self, output_dir: str, resume_step: int = 0):
    self.path = os.path.join(output_dir, "metrics.jsonl")
    kept = []
    if resume_step and os.path.exists(self.path):
      with open(self.path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
    self._file = open(self.path, "w", encoding="utf-8")
    self._file.writelines(kept)

  def write(self, row: dict) -> None:
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def evaluate(trainer: Trainer, params, ref_params, dataset, ref_table) -> dict:
  """Metric means over the eval set's full batches (every batch has the same size)."""
  totals, count = {}, 0
  B = trainer.cfg.batch_size
  for start, batch in zip(range(0, len(dataset), B),
                          data_lib.eval_batches(dataset, B)):
    batch = with_ref(batch, ref_table, np.arange(start, start + B))
    m = jax.device_get(trainer.eval_step(params, ref_params, trainer.put_batch(batch)))
    for k, v in m.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    count += 1
  return {f"eval/{k}": v / count for k, v in totals.items()}


class Preempted(Exception):
  """Raised after a SIGTERM/SIGINT: `step` was saved and committed."""

  def __init__(self, step: int):
    super().__init__(f"preempted: saved step {step}")
    self.step = step


class _StopSignal:
  """Turns SIGTERM/SIGINT into a flag the loop polls between steps (single process).

  With several processes JAX's preemption sync point decides instead, so that every
  process stops after the same step.
  """

  def __init__(self):
    self.received = None
    self._previous = {}

  def __enter__(self):
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signum

  def should_stop(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.received is not None

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _restore(trainer: Trainer, ckpt: checkpoint.Checkpointer, cfg: TrainConfig, log):
  """(state, meta) of the checkpoint to resume from, or (None, None) for a fresh start."""
  existing = ckpt.steps()
  if cfg.resume == "never":
    if existing:
      raise ConfigError(f"--resume=never but {ckpt.directory} already holds checkpoints "
                        f"(steps {existing}); use --resume=auto or another --output_dir")
    return None, None
  step, meta = checkpoint.find_restorable(ckpt, required=cfg.resume == "required")
  if step is None:
    if cfg.resume == "required":
      raise checkpoint.CheckpointError(f"--resume=required but {ckpt.directory} holds no "
                                       "complete checkpoint")
    return None, None
  mismatch = (checkpoint.config_mismatch(meta["model_config"],
                                         dataclasses.asdict(trainer.mcfg),
                                         [f.name for f in dataclasses.fields(trainer.mcfg)])
              or checkpoint.config_mismatch(meta["config"], dataclasses.asdict(cfg),
                                            RESUME_FIELDS))
  if mismatch:
    raise ConfigError(f"cannot resume from step {step}: {mismatch}")
  state = trainer.restore_state(ckpt, step, meta["num_shards"])
  if cfg.verify_checkpoint:
    got = checkpoint.fingerprints({k: state[k] for k in ("params", "opt_state")}) \
        if meta["num_shards"] == trainer.num_devices else \
        checkpoint.fingerprints({"params": state["params"]})
    want = {k: v for k, v in meta["fingerprints"].items() if k in got}
    bad = [k for k in got if got[k] != want.get(k)]
    if bad:
      raise checkpoint.CheckpointError(f"checkpoint step {step} fails verification: "
                                       f"{len(bad)} arrays differ, e.g. {bad[0]}")
    log(f"checkpoint step {step}: {len(got)} array fingerprints verified")
  log(f"resumed from step {step} ({ckpt.directory}), data position {meta['data_state']}")
  return state, meta


# Settings that must not change across a resume (the model's own fields are checked
# separately): they decide the data order or the meaning of the optimizer state.
RESUME_FIELDS = ("max_length", "max_prompt_length", "seed", "batch_size", "optimizer",
                 "train_data")


def train(cfg: TrainConfig, log=print, devices=None) -> dict:
  """Runs DPO training on `devices` (default: all), resuming from and writing
  checkpoints in `{output_dir}/checkpoints`; returns the last logged train metrics, the
  last eval metrics and the final state. Raises `Preempted` after saving on SIGTERM."""
  devices = devices or jax.devices()
  cfg.validate(len(devices))
  mesh = Mesh(np.array(devices), ("data",))
  primary = jax.process_index() == 0
  log = log if primary else (lambda *_: None)
  try:
    os.makedirs(cfg.output_dir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"--output_dir={cfg.output_dir!r} cannot be created: {e}") from None
  tok = data_lib.ByteTokenizer()
  mcfg = cfg.model_config()
  if tok.vocab_size > mcfg.vocab_size:
    raise ConfigError(f"tokenizer vocabulary ({tok.vocab_size}) exceeds the model's "
                      f"({mcfg.vocab_size})")

  train_set = data_lib.load_dataset(cfg.train_data, tok, cfg.max_length,
                                    cfg.max_prompt_length, cfg.skip_bad_lines)
  eval_set = (data_lib.load_dataset(cfg.eval_data, tok, cfg.max_length, cfg.max_prompt_length,
                                    cfg.skip_bad_lines) if cfg.eval_data else None)
  log(f"data: {len(train_set)} train pairs ({train_set.num_dropped} dropped, "
      f"{train_set.num_skipped_lines} bad lines skipped)"
      + (f", {len(eval_set)} eval pairs" if eval_set else ""))
  if eval_set is not None and len(eval_set) < cfg.batch_size:
    raise ConfigError(f"--eval_data has {len(eval_set)} pairs, fewer than --batch_size")

  trainer = Trainer(cfg, mesh)
  key = jax.random.PRNGKey(cfg.seed)
  ckpt = checkpoint.Checkpointer(os.path.join(cfg.output_dir, "checkpoints"), keep=cfg.keep,
                                 keep_period=cfg.keep_period or None)
  state, meta = _restore(trainer, ckpt, cfg, log)
  start = 0 if state is None else meta["step"]
  # The reference is the frozen initial policy (rebuilt from the seed on a resume), in
  # its own buffers, so donating the train state never invalidates it.
  if state is None:
    state = trainer.init_state(key)
    ref_params = jax.tree.map(jnp.copy, state["params"])
  else:
    ref_params = trainer.init_params(key)
  num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  log(f"model: {cfg.model} ({num_params:,} params) on {len(devices)} "
      f"{devices[0].platform} device(s) in {jax.process_count()} process(es)")

  train_ref = eval_ref = None
  if cfg.precompute_ref_logps:
    cache_dir = os.path.join(cfg.output_dir, "ref_cache")
    train_ref = precompute_ref_logps(trainer, ref_params, train_set, cache_dir)
    if eval_set is not None:
      eval_ref = precompute_ref_logps(trainer, ref_params, eval_set, cache_dir)
    ref_params = None  # the step never runs the reference forward
    log(f"reference log-probs precomputed (cache: {cache_dir})")

  it = data_lib.BatchIterator(train_set, cfg.batch_size, cfg.seed,
                              state=meta["data_state"] if meta else None)
  writer = MetricsWriter(cfg.output_dir, resume_step=start) if primary else None
  last, last_eval = {}, {}
  t_start = t_last = time.perf_counter()
  total_tokens = tokens_at_last = 0
  pending = None

  def report(step, metrics, tokens):
    """Logs one step; `tokens` is the count of real tokens trained on up to that step."""
    nonlocal t_last, tokens_at_last, last
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    row = {"step": step, **m, "tokens_per_sec": (tokens - tokens_at_last) / (now - t_last)}
    tokens_at_last, t_last = tokens, now
    if writer:
      writer.write(row)
    eta = (now - t_start) / (step - start) * (cfg.steps - step)
    log(f"step {step}/{cfg.steps} | loss {m['loss']:.4f} | acc {m['rewards/accuracies']:.3f} "
        f"| margin {m['rewards/margins']:.3f} | {row['tokens_per_sec']:,.0f} tok/s "
        f"| ETA {_fmt_duration(eta)}")
    last = row

  def save(step):
    to_save = {"params": state["params"], "opt_state": state["opt_state"]}
    prints = checkpoint.fingerprints(to_save)
    ckpt.save(step, to_save, {
        "step": step, "data_state": it.get_state(), "num_shards": trainer.num_devices,
        "rng_key": np.asarray(jax.random.key_data(key)).tolist(),
        "config": dataclasses.asdict(cfg), "model_config": dataclasses.asdict(mcfg),
        "fingerprints": prints})
    digest = hashlib.sha256(json.dumps(prints, sort_keys=True).encode()).hexdigest()[:16]
    log(f"checkpoint step {step}: saving asynchronously (content digest {digest})")

  try:
    with _StopSignal() as stop:
      for step in range(start + 1, cfg.steps + 1):
        idx = it.next_indices()
        batch = with_ref(data_lib.take_pairs(train_set, idx), train_ref, idx)
        total_tokens += int(batch["attention_mask"].sum())
        state, metrics = trainer.train_step(state, ref_params, trainer.put_batch(batch))
        if step == start + 1 or cfg.check_replicas_every and step % cfg.check_replicas_every == 0:
          trainer.check_replicas(state["params"])
        # Read the previous step's metrics only now, with this step already queued, so
        # the host never makes the device wait.
        if pending is not None:
          report(*pending)
        logged = step % cfg.log_every == 0 or step == cfg.steps
        pending = (step, metrics, total_tokens) if logged else None
        if eval_set is not None and cfg.eval_every and (step % cfg.eval_every == 0
                                                        or step == cfg.steps):
          if pending is not None:
            report(*pending)
            pending = None
          last_eval = evaluate(trainer, state["params"], ref_params, eval_set, eval_ref)
          if writer:
            writer.write({"step": step, **last_eval})
          log(f"eval @ {step} | loss {last_eval['eval/loss']:.4f} | "
              f"acc {last_eval['eval/rewards/accuracies']:.3f} | "
              f"margin {last_eval['eval/rewards/margins']:.3f}")
        if stop.should_stop(step):
          if pending is not None:
            report(*pending)
          save(step)
          ckpt.wait()
          log(f"stop signal: step {step} saved and committed")
          raise Preempted(step)
        if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
          save(step)
      if pending is not None:
        report(*pending)
    ckpt.wait()
  finally:
    ckpt.close()
    if writer:
      writer.close()
  log(f"done: steps {start + 1}-{cfg.steps} in {_fmt_duration(time.perf_counter() - t_start)}")
  return {"train": last, "eval": last_eval, "state": state}
