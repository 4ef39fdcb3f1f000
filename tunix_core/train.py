"""The DPO training loop: config, optimizer, jitted data-parallel step, eval and logging.

Data parallelism here is `jax.jit` over a one-axis mesh `("data",)`: params and
optimizer state are replicated, batch rows are split over devices, and XLA inserts the
gradient all-reduce.
"""

import dataclasses
import hashlib
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kernels
from tunix_core import data as data_lib
from tunix_core import model as model_lib


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
  log_every: int = 10
  eval_every: int = 0
  save_every: int = 0
  keep: int = 3
  resume: str = "auto"

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


OPTIMIZERS = {"adamw", "rmsprop"}


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Linear warmup to `learning_rate`, then constant; optional global-norm clipping.

  Weight decay (adamw) skips the norm scales.
  """
  if cfg.warmup_steps > 0:
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  else:
    schedule = optax.constant_schedule(cfg.learning_rate)
  if cfg.optimizer == "adamw":
    def decay_mask(params):
      return jax.tree_util.tree_map_with_path(
          lambda path, _: not str(path[-1].key).endswith("norm"), params)
    tx = optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask)
  else:
    tx = optax.rmsprop(schedule)
  if cfg.max_grad_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), tx)
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


class Trainer:
  """Builds the jitted step functions for one config on one mesh."""

  def __init__(self, cfg: TrainConfig, mesh: Mesh,
               model_config: model_lib.ModelConfig | None = None):
    self.cfg, self.mesh = cfg, mesh
    self.mcfg = model_config or cfg.model_config()
    self.tx, self.schedule = make_optimizer(cfg)
    self.replicated = NamedSharding(mesh, P())
    self.rows = NamedSharding(mesh, P("data"))
    self.train_step = jax.jit(self._train_step, donate_argnums=(0,))
    self.eval_step = jax.jit(self._eval_step)
    self.ref_logps = jax.jit(self._ref_logps)

  def init_state(self, key: jax.Array) -> dict:
    def init(key):
      params = model_lib.init_params(key, self.mcfg)
      return {"params": params, "opt_state": self.tx.init(params),
              "step": jnp.zeros((), jnp.int32)}
    return jax.jit(init, out_shardings=self.replicated)(key)

  def _ref_logps(self, ref_params, batch):
    return jax.lax.stop_gradient(
        sequence_logps(ref_params, batch, self.mcfg, self.cfg.logprob_impl))

  def _resolve_ref(self, ref_params, batch):
    if self.cfg.reference_free:
      return None
    if "ref_logps" in batch:
      return batch["ref_logps"]
    return self._ref_logps(ref_params, batch)

  def _train_step(self, state, ref_params, batch):
    ref_logps = self._resolve_ref(ref_params, batch)
    grad_fn = jax.value_and_grad(dpo_objective, has_aux=True)
    (loss, metrics), grads = grad_fn(state["params"], ref_logps, batch, self.cfg, self.mcfg)
    updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads),
                   learning_rate=self.schedule(state["step"]))
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

  def _eval_step(self, params, ref_params, batch):
    loss, metrics = dpo_objective(params, self._resolve_ref(ref_params, batch), batch,
                                  self.cfg, self.mcfg)
    return dict(metrics, loss=loss)

  def put_batch(self, batch: dict) -> dict:
    return {k: jax.device_put(v, self.rows) for k, v in batch.items()}


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
    logps = np.asarray(jax.device_get(trainer.ref_logps(ref_params, batch)))
    keep = min(B, n - start)
    out[start:start + keep, 0] = logps[:keep]
    out[start:start + keep, 1] = logps[B:B + keep]
  os.makedirs(cache_dir, exist_ok=True)
  tmp = path + ".tmp.npy"
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
  """Writes one JSON object per row to `{output_dir}/metrics.jsonl` (a fresh file per run)."""

  def __init__(self, output_dir: str):
    self.path = os.path.join(output_dir, "metrics.jsonl")
    self._file = open(self.path, "w", encoding="utf-8")

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


def train(cfg: TrainConfig, log=print) -> dict:
  """Runs DPO training; returns the last logged train metrics and last eval metrics."""
  devices = jax.devices()
  cfg.validate(len(devices))
  mesh = Mesh(np.array(devices), ("data",))
  os.makedirs(cfg.output_dir, exist_ok=True)
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
  state = trainer.init_state(jax.random.PRNGKey(cfg.seed))
  # The reference is the frozen initial policy: its own buffers, so donating the train
  # state never invalidates it.
  ref_params = jax.tree.map(jnp.copy, state["params"])
  num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  log(f"model: {cfg.model} ({num_params:,} params) on {len(devices)} "
      f"{devices[0].platform} device(s)")

  train_ref = eval_ref = None
  if cfg.precompute_ref_logps:
    cache_dir = os.path.join(cfg.output_dir, "ref_cache")
    train_ref = precompute_ref_logps(trainer, ref_params, train_set, cache_dir)
    if eval_set is not None:
      eval_ref = precompute_ref_logps(trainer, ref_params, eval_set, cache_dir)
    ref_params = None  # the step never runs the reference forward
    log(f"reference log-probs precomputed (cache: {cache_dir})")

  it = data_lib.BatchIterator(train_set, cfg.batch_size, cfg.seed)
  writer = MetricsWriter(cfg.output_dir)
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
    writer.write(row)
    eta = (now - t_start) / step * (cfg.steps - step)
    log(f"step {step}/{cfg.steps} | loss {m['loss']:.4f} | acc {m['rewards/accuracies']:.3f} "
        f"| margin {m['rewards/margins']:.3f} | {row['tokens_per_sec']:,.0f} tok/s "
        f"| ETA {_fmt_duration(eta)}")
    last = row

  try:
    for step in range(1, cfg.steps + 1):
      idx = it.next_indices()
      batch = with_ref(data_lib.take_pairs(train_set, idx), train_ref, idx)
      total_tokens += int(batch["attention_mask"].sum())
      state, metrics = trainer.train_step(state, ref_params, trainer.put_batch(batch))
      # Read the previous step's metrics only now, with this step already queued, so
      # the host never makes the device wait.
      if pending is not None:
        report(*pending)
      pending = (step, metrics, total_tokens) if step % cfg.log_every == 0 or step == cfg.steps else None
      if eval_set is not None and cfg.eval_every and (step % cfg.eval_every == 0
                                                      or step == cfg.steps):
        if pending is not None:
          report(*pending)
          pending = None
        last_eval = evaluate(trainer, state["params"], ref_params, eval_set, eval_ref)
        writer.write({"step": step, **last_eval})
        log(f"eval @ {step} | loss {last_eval['eval/loss']:.4f} | "
            f"acc {last_eval['eval/rewards/accuracies']:.3f} | "
            f"margin {last_eval['eval/rewards/margins']:.3f}")
    if pending is not None:
      report(*pending)
  finally:
    writer.close()
  log(f"done: {cfg.steps} steps in {_fmt_duration(time.perf_counter() - t_start)}")
  return {"train": last, "eval": last_eval, "state": state}
