"""The jitted `shard_map` step functions of a run, and how batches reach the devices.

`StepFunctions` compiles, for one config on a mesh `("data",)` or `("data", "model")`
(`make_mesh`): the train step, the eval step, the frozen reference's log-probs and the
replica checksum. Under ZeRO-1
(the default) params are replicated; each device runs the model on its own pairs, then
`zero.ShardedOptimizer` reduce-scatters the gradients in buckets, updates its 1/N of the
params and optimizer state, and all-gathers the params. Under `--fsdp` params and the
reference are in `tunix_core.fsdp`'s sharded layout (`[N, ...]` pieces split over
"data"): each layer is gathered inside the layer scan, its gradient reduce-scattered in
the backward, and the update stays local. `logical_params` / `place_params` convert
between a run's layout and logical arrays. The train state is
`{"params", "opt_state", "step"}`, with optimizer-state leaves `[N, piece]` split over
"data" (see `tunix_core.zero`), and `"nonfinite"`: int32 `[3]` (count of non-finite
steps so far, the first such step, a bit set of what was non-finite in it, bits in
`health.NONFINITE_KEYS` order). A step whose loss, metrics or gradient norm is not finite
leaves params and optimizer state as they were; the loop decides whether to stop.

With `--model_parallel=K` the mesh gets an inner "model" axis of K devices and the model
runs Megatron-style (`tunix_core.tensor_parallel`): each device holds a slice of the
heads, MLP columns and vocabulary. Everything above then applies to each slice over the
"data" axis: ZeRO-1 params are the logical arrays split by `model.param_specs`, and the
pieces of the optimizer state (and of FSDP params) are `tensor_parallel.Stacked` rows
split over both axes.

Pair batches are `[B, 2, T]` (chosen, rejected) everywhere; on device they are split over
"data" on the pair axis (replicated over "model"), so each device holds both rows of each
of its pairs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_core import collectives
from tunix_core import fsdp as fsdp_lib
from tunix_core import health as health_lib
from tunix_core import model as model_lib
from tunix_core import objective
from tunix_core import optim
from tunix_core import packing
from tunix_core import scored
from tunix_core import tensor_parallel as tp_lib
from tunix_core import zero
from tunix_core.config import TrainConfig

def to_host(x: jax.Array) -> np.ndarray:
  """The global value of `x` as NumPy, also when other processes hold some shards."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


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


class StepFunctions:
  """The compiled step functions of `cfg` on `mesh` (see `make_mesh`).

  - `train_step(state, ref_params, batch) -> (state, metrics)`; donates `state`.
  - `eval_step(params, ref_params, batch) -> metrics`.
  - `ref_logps(ref_params, batch) -> [B, 2, T]` float32, the reference's log-probs.
  `ref_params` is None when the batch carries precomputed `ref_logps` or the run is
  reference-free. Metrics are device-mean scalars: the `dpo_loss` keys, `loss`,
  `grad_norm` and `learning_rate` (the one this step used); the train step's also carry
  `nonfinite`, the state's `[3]` health after the step (read with the metrics, so
  checking it costs no extra host sync).
  """

  def __init__(self, cfg: TrainConfig, mesh: Mesh,
               model_config: model_lib.ModelConfig | None = None,
               scored_size: int | None = None, packed: packing.Spec | None = None):
    self.cfg, self.mesh = cfg, mesh
    # The LM head's block of positions per row (`tunix_core.scored`); None: whole rows.
    self.scored_size = scored_size if cfg.head_on_scored else None
    # Prefix sharing / packing (`tunix_core.packing`): the static shapes of a device's
    # micro-batch of packed rows; None: the pairs' own `[2B, T]` rows.
    self.packed = packed
    self.mcfg = model_config or cfg.model_config()
    self.num_devices = mesh.shape["data"]  # data-parallel shards
    k = self.model_parallel = dict(mesh.shape).get("model", 1)
    self.tx, self.schedule = optim.make_optimizer(cfg)
    shapes = lambda mcfg: jax.eval_shape(lambda: model_lib.init_params(jax.random.PRNGKey(0),
                                                                       mcfg))
    self.param_shapes = shapes(self.mcfg)
    # What one device computes with: its model slice (all of the model without TP).
    self.model_axis = "model" if k > 1 else None
    local_shapes = shapes(tp_lib.local_config(self.mcfg, k)) if k > 1 else self.param_shapes
    split = None
    if k > 1:
      split = jax.tree.map(lambda d: d is not None, tp_lib.split_dims(self.mcfg),
                           is_leaf=lambda x: x is None)
    self.plan = collectives.BucketPlan.create(local_shapes, self.num_devices,
                                              int(cfg.bucket_mb * 2**20))
    comm_dtype = collectives.COMM_DTYPES[cfg.grad_sync_dtype]
    self.fsdp = None
    if cfg.fsdp:
      self.fsdp = fsdp_lib.Layout(
          local_shapes, self.num_devices, "data",
          compute_dtype=model_lib.DTYPES[self.mcfg.compute_dtype], impl=cfg.sync_impl,
          comm_dtype=comm_dtype)
    self.opt = zero.ShardedOptimizer(
        self.tx, self.plan, "data", max_grad_norm=cfg.max_grad_norm or None,
        impl=cfg.sync_impl, comm_dtype=comm_dtype, model_axis=self.model_axis, split=split)
    inner = self.fsdp or zero.Zero1Layout(self.plan)
    self.layout = tp_lib.Stacked(inner, self.mcfg, k) if k > 1 else inner
    self.replicated = NamedSharding(mesh, P())
    self.pairs = NamedSharding(mesh, P("data"))
    rows = P(("data", "model")) if k > 1 else P("data")  # of `self.layout`'s pieces
    self.rows = NamedSharding(mesh, rows)
    # Of params and reference params: one spec for all, or per param under TP + ZeRO-1.
    pspec = rows if self.fsdp else P()
    ref_spec = pspec
    if k > 1 and not self.fsdp:
      pspec = model_lib.param_specs(self.mcfg, "model")
      uses_ref = not (cfg.reference_free or cfg.precompute_ref_logps)
      ref_spec = pspec if uses_ref else P()  # no reference params at all
    # In the run's layout, a tree with the params' structure.
    spec_tree = pspec if isinstance(pspec, dict) else jax.tree.map(lambda _: pspec,
                                                                   self.param_shapes)
    self.param_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree,
                                       is_leaf=lambda x: isinstance(x, P))
    state_specs = {"params": pspec, "opt_state": rows, "step": P(), "nonfinite": P()}
    smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    self.train_step = jax.jit(
        smap(self._train_step, in_specs=(state_specs, ref_spec, P("data")),
             out_specs=(state_specs, P())), donate_argnums=(0,))
    self.eval_step = jax.jit(smap(self._eval_step, in_specs=(pspec, ref_spec, P("data")),
                                  out_specs=P()))
    self.ref_logps = jax.jit(smap(self._ref_logps, in_specs=(pspec, P("data")),
                                  out_specs=P("data")))
    init_local = (lambda p: self.opt.tx.init(self.fsdp.local(p))) if self.fsdp else self.opt.init
    self._init_opt = jax.jit(smap(lambda params: jax.tree.map(lambda x: x[None], init_local(params)),
                                  in_specs=(pspec,), out_specs=rows))
    self._checksums = jax.jit(smap(self._checksum, in_specs=(pspec,), out_specs=rows))

  def init_params(self, key: jax.Array) -> dict:
    """Params initialised from `key`, directly in this run's layout and shardings."""
    init = lambda k: model_lib.init_params(k, self.mcfg)
    if self.fsdp:
      return jax.jit(lambda k: self.layout.to_pieces(init(k)),
                     out_shardings=self.param_sharding)(key)
    return jax.jit(init, out_shardings=self.param_sharding)(key)

  def logical_shardings(self) -> dict:
    """Where logical params live outside the step: as in the step under ZeRO-1
    (replicated, or split over "model"), split on their largest dimension "data" divides
    under FSDP (`fsdp.logical_sharding`)."""
    if not self.fsdp:
      return self.param_sharding
    return jax.tree.map(lambda x: fsdp_lib.logical_sharding(x.shape, self.mesh),
                        self.param_shapes)

  def logical_params(self, params: dict) -> dict:
    """This run's params (or a tree shaped like them) as logical arrays."""
    if not self.fsdp:
      return params
    return jax.jit(self.layout.to_logical, out_shardings=self.logical_shardings())(params)

  def place_params(self, logical: dict) -> dict:
    """Logical params -> this run's layout and shardings (inverse of `logical_params`)."""
    if not self.fsdp:
      return jax.device_put(logical, self.param_sharding)
    return jax.jit(self.layout.to_pieces, out_shardings=self.param_sharding)(logical)

  def abstract_params(self, dtype=None) -> dict:
    """ShapeDtypeStructs of this run's params in its layout and shardings (leaves in
    `dtype`, default the params'): the reference params' too."""
    shapes = self.param_shapes
    if self.fsdp:
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.layout.num_shards,) + x.shape,
                                                           x.dtype), self.layout.local_shapes())
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s),
                        shapes, self.param_sharding)

  def abstract_opt_state(self):
    """ShapeDtypeStructs of this run's optimizer state (`layout`'s rows over `rows`)."""
    return zero.abstract_opt_state(self.layout, self.tx, self.rows)

  def _local(self, params):
    return self.fsdp.local(params) if self.fsdp else params

  def init_state(self, key: jax.Array, params: dict | None = None) -> dict:
    """A fresh train state around `params` (default: initialised from `key`)."""
    params = self.init_params(key) if params is None else params
    return {"params": params, "opt_state": self._init_opt(params),
            "step": jax.device_put(jnp.zeros((), jnp.int32), self.replicated),
            "nonfinite": self.put_nonfinite([0, 0, 0])}

  def put_nonfinite(self, health) -> jax.Array:
    """`[count, first step, bits]` (host ints) as the state's replicated int32 `[3]`."""
    return jax.device_put(jnp.asarray(health, jnp.int32), self.replicated)

  def _ref_logps(self, ref_params, batch):
    return jax.lax.stop_gradient(objective.sequence_logps(
        self._local(ref_params), batch, self.mcfg, self.cfg.logprob_impl, self.fsdp,
        self.model_axis, self.scored_size, self.packed))

  def _resolve_ref(self, ref_params, batch):
    """Reference log-probs `[b, 2, T]` of a local batch: precomputed, in-step or None."""
    if self.cfg.reference_free:
      return None
    if "ref_logps" in batch:
      return batch["ref_logps"]
    return self._ref_logps(ref_params, batch)

  def _train_step(self, state, ref_params, batch):
    k = self.cfg.grad_accum_steps
    params = self._local(state["params"])

    def micro_step(mb):
      ref = self._resolve_ref(ref_params, mb)
      (loss, metrics), grads = jax.value_and_grad(objective.dpo_objective, has_aux=True)(
          params, ref, mb, self.cfg, self.mcfg, self.fsdp, self.model_axis, self.scored_size,
          self.packed)
      if self.model_axis:
        grads = tp_lib.sync_replicated_grads(grads, self.model_axis)
      return grads, dict(metrics, loss=loss)

    def accumulate(carry, mb):
      return jax.tree.map(jnp.add, carry, micro_step(mb)), None

    if k == 1:  # no accumulator: one fewer gradient-sized buffer
      grads, metrics = micro_step(batch)
    else:
      micro = jax.tree.map(lambda x: x.reshape((k, -1) + x.shape[1:]), batch)  # [k, b/k, ..]
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                           jax.eval_shape(micro_step, jax.tree.map(lambda x: x[0], micro)))
      (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
      # Means over micro-batches; ZeRO-1 then averages over devices once per step (under
      # FSDP each micro-batch's gradient was reduce-scattered already).
      grads, metrics = jax.tree.map(lambda x: x / k, (grads, metrics))
    opt_state = jax.tree.map(lambda x: x[0], state["opt_state"])
    if self.fsdp:
      update = self.opt.update_sharded(grads, opt_state, params)
      new_params = jax.tree.map(lambda x: x[None], update.params)
    else:
      update = self.opt.update(grads, opt_state, params)
      new_params = update.params
    metrics = jax.lax.pmean(metrics, "data")
    metrics = dict(metrics, grad_norm=update.grad_norm,
                   learning_rate=self.schedule(state["step"]))
    ok, health = health_lib.update(state["nonfinite"], metrics, state["step"] + 1)
    # A non-finite step keeps the old params and optimizer state (no update applied).
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = {"params": keep(new_params, state["params"]),
                 "opt_state": keep(jax.tree.map(lambda x: x[None], update.state),
                                   state["opt_state"]),
                 "step": state["step"] + 1, "nonfinite": health}
    return new_state, dict(metrics, nonfinite=health)

  def _eval_step(self, params, ref_params, batch):
    loss, metrics = objective.dpo_objective(
        self._local(params), self._resolve_ref(ref_params, batch), batch, self.cfg, self.mcfg,
        self.fsdp, self.model_axis, self.scored_size, self.packed)
    return jax.lax.pmean(dict(metrics, loss=loss), "data")

  @staticmethod
  def _checksum(params):
    """This device's params as one uint32: the wrapping sum of their bit patterns."""
    total = jnp.zeros((), jnp.uint32)
    for x in jax.tree.leaves(params):
      bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
      total = total + jnp.sum(bits, dtype=jnp.uint32)
    return total[None]

  def check_replicas(self, params) -> None:
    """Raises if any device's copy of the replicated params differs from the others
    holding the same model slice (nothing to check under FSDP: no param is replicated)."""
    if self.fsdp:
      return
    sums = to_host(self._checksums(params)).reshape(self.num_devices, self.model_parallel)
    if (sums != sums[0]).any():
      raise RuntimeError(f"replicas diverged: per-device param checksums {sums.tolist()}")

  def put_batch(self, batch: dict) -> dict:
    """Host arrays `[B, 2, T]` of the global batch -> device arrays split over "data" on
    the pair axis. Each process hands over only the pairs of its own devices. Under
    `packed` the batch's packed rows and head slots go along (`packing.pack`); under a
    scored block (`scored_size`) or `packed`, a batch that does not fit is a ValueError."""
    if self.packed is not None:
      batch = packing.pack(batch, self.packed)
    elif self.scored_size is not None:
      scored.check_batch(batch["loss_mask"], self.scored_size)
    n, p = jax.process_count(), jax.process_index()
    out = {}
    for k, v in batch.items():
      B = v.shape[0]
      out[k] = jax.make_array_from_process_local_data(
          self.pairs, v[p * B // n:(p + 1) * B // n], v.shape)
    return out
