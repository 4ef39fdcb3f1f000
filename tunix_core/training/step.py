"""The jitted `shard_map` step functions of a step plan, and how batches reach the devices.

`StepFunctions(plan, mesh)` compiles, for a `plan.StepPlan` on a mesh `("data",)` or
`("data", "model")`, with a `"slice"` axis in front on several TPU slices
(`parallel.mesh.make_mesh`): the train step, the eval step, the
frozen reference's log-probs and the replica checksum. Where params and optimizer
state live and how they are gathered, synced and updated is the plan's parameter
layout (`parallel.layout`: ZeRO-1, FSDP, either under tensor parallelism); the step
only calls it. The train state is `{"params", "opt_state", "step", "nonfinite"}`:
params in the layout's step form, optimizer-state leaves `[num_shards, ...]` rows,
and `nonfinite`, int32 `[3]` (count of non-finite steps so far, the first such step, a
bit set of what was non-finite in it, bits in `health.NONFINITE_KEYS` order). A step
whose loss, metrics or gradient norm is not finite leaves params and optimizer state as
they were; the loop decides whether to stop.

Pair batches are `[B, 2, T]` (chosen, rejected) everywhere; on device they are split over
"data" (`("slice", "data")` on several slices: every data-parallel device of every slice)
on the pair axis (replicated over "model"), each device holding whole groups of the
plan's model rows (`data.packing`). The layout runs within a slice and is replicated
across slices; its update averages the gradients across them once per step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_core import model as model_lib
from tunix_core.data import packing
from tunix_core.model import lora as lora_lib
from tunix_core.model import quant
from tunix_core.parallel import collectives
from tunix_core.parallel import layout as layout_lib
from tunix_core.parallel import lora as lora_layout
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.parallel import zero
from tunix_core.training import accumulate
from tunix_core.training import health as health_lib
from tunix_core.training import objective
from tunix_core.training import offload
from tunix_core.training import optim
from tunix_core.training.plan import StepPlan


class StepFunctions:
  """The compiled step functions of `plan` on `mesh`.

  - `train_step(state, frozen, batch) -> (state, metrics)`; donates `state`.
  - `eval_step(params, frozen, batch) -> metrics`.
  - `ref_logps(frozen, batch) -> [B, 2, T]` float32, the reference's log-probs.
  `frozen` is the step's frozen input: the reference params when the plan's reference
  runs in the step (None otherwise), or under LoRA the frozen base (`parallel.lora`).
  Metrics are device-mean scalars: the `dpo_loss` keys, `loss`, `grad_norm`, `learning_rate`
  (this step's); the train step's also carry `nonfinite`, the state's `[3]` health after
  the step (read with the metrics: checking it costs no extra host sync)."""

  def __init__(self, plan: StepPlan, mesh: Mesh):
    self.plan, self.mesh = plan, mesh
    self.mcfg = mcfg = plan.model
    self.num_devices = mesh.shape["data"]  # data-parallel shards of one slice
    self.model_parallel = dict(mesh.shape).get("model", 1)
    self.tx, self.schedule = optim.make_optimizer(plan.optimizer)
    layout_kw = dict(data_shards=self.num_devices, model_parallel=self.model_parallel,
                     fsdp=plan.fsdp, bucket_bytes=plan.bucket_bytes,
                     sync_impl=plan.sync_impl, max_grad_norm=plan.max_grad_norm,
                     comm_dtype=collectives.COMM_DTYPES[plan.grad_sync_dtype],
                     slice_axis=mesh_lib.slice_axis(mesh),
                     gather_stages=mesh_lib.gather_stages(mesh))
    if plan.lora is None:
      self.layout = layout_lib.make(mcfg, self.tx, **layout_kw)
    else:  # the adapters train over a frozen base in the base's own layout
      self.layout = lora_layout.make(mcfg, plan.lora, self.tx, quantize=plan.quantize_base,
                                     **layout_kw)
    self.base_layout = getattr(self.layout, "base", self.layout)
    self.param_shapes = self.layout.param_shapes  # logical
    self.replicated = NamedSharding(mesh, P())
    self.batch_axes = mesh_lib.batch_axes(mesh)
    self.pairs = NamedSharding(mesh, P(self.batch_axes))
    self.rows = NamedSharding(mesh, self.layout.row_spec)
    # Where the optimizer state lives between steps: on the devices, or in host memory
    # (--offload_optimizer), brought to them for the update only.
    self.opt_sharding = offload.host(self.rows) if plan.offload_optimizer else self.rows
    pspec = self.layout.param_specs
    self.param_sharding = self._shardings(pspec)
    self.base_sharding = self._shardings(self.base_layout.param_specs)
    # The step's frozen input (the class docstring) and the reference pass's.
    if plan.lora is not None:
      frozen_spec = ref_spec = self.layout.frozen_specs(plan.ref_adapters)
    else:  # reference log-probs are computed from the reference params in any mode
      frozen_spec, ref_spec = (pspec if plan.reference == "step" else P()), pspec
    self.frozen_sharding = self._shardings(frozen_spec)
    state_specs = {"params": pspec, "opt_state": self.layout.row_spec, "step": P(),
                   "nonfinite": P()}
    smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    # --tpu_flags on TPU (`training.tpu_flags`), for every program of the step.
    jit = functools.partial(jax.jit, compiler_options=dict(plan.compiler_options) or None)
    train = smap(self._train_step, in_specs=(state_specs, frozen_spec, self.pairs.spec),
                 out_specs=(state_specs, P()))
    placed = {}
    if plan.offload_optimizer:
      train, placed = offload.offloaded(
          train, self.rows, dict(self._shardings(state_specs), opt_state=self.opt_sharding),
          self.replicated)
    self.train_step = jit(train, donate_argnums=(0,), **placed)
    self.eval_step = jit(smap(self._eval_step, in_specs=(pspec, frozen_spec, self.pairs.spec),
                              out_specs=P()))
    self.ref_logps = jit(smap(self._ref_logps, in_specs=(ref_spec, self.pairs.spec),
                              out_specs=self.pairs.spec))
    self._init_opt = jit(smap(
        lambda params: jax.tree.map(lambda x: x[None], self.layout.init_opt(params)),
        in_specs=(pspec,), out_specs=self.layout.row_spec),
        # As a restore places it: the step's executable is then the same either way
        # (one mesh device would otherwise leave the rows unannotated: a cache miss).
        out_shardings=self.opt_sharding)
    self._checksums = jit(smap(health_lib.checksum, in_specs=(pspec,),
                               out_specs=P(tuple(mesh.axis_names))))

  def _shardings(self, specs) -> dict:
    """A tree of PartitionSpecs as NamedShardings on this mesh."""
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))

  def init_params(self, key: jax.Array) -> dict:
    """Trained params initialised from `key`, directly in this run's layout and
    shardings: the model's, or with LoRA fresh adapters (PEFT's init)."""
    if self.plan.lora is not None:
      return jax.jit(lambda k: lora_lib.init_adapters(
          k, self.mcfg, self.plan.lora, model_lib.DTYPES[self.mcfg.param_dtype]),
                     out_shardings=self.param_sharding)(jax.random.fold_in(key, 1))
    return self.init_base(key)

  def init_base(self, key: jax.Array, dtype=None) -> dict:
    """The model's params initialised from `key` in the base's layout (the run's own
    without LoRA), float leaves in `dtype` (default `--param_dtype`; QLoRA's projections
    quantized, `model.quant`)."""
    def init(k):
      params = model_lib.init_params(k, self.mcfg, self.plan.quantize_base)
      return self.base_layout.to_step(quant.cast_floats(params, dtype) if dtype else params)
    return jax.jit(init, out_shardings=self.base_sharding)(key)

  def base_logical_shardings(self) -> dict:
    """Where the model's logical params live outside the step, in the base's layout."""
    return self._shardings(self.base_layout.logical_specs())

  def base_read_shardings(self) -> dict:
    """Where the model's float weights are read (a quantized base's before each leaf is
    quantized; `base_logical_shardings` otherwise)."""
    return self._shardings(getattr(self.layout, "read", self.base_layout).logical_specs())

  def place_base(self, logical: dict) -> dict:
    """The model's logical params -> the base's layout and shardings."""
    return self.base_layout.place(logical, self.base_sharding)

  def abstract_frozen(self, dtype) -> dict | None:
    """ShapeDtypeStructs of the step's frozen input (the model params' leaves in
    `dtype`): None when it has none."""
    if self.plan.lora is not None:
      return jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
          self.layout.abstract_frozen(dtype, self.plan.ref_adapters), self.frozen_sharding)
    return self.abstract_params(dtype) if self.plan.reference == "step" else None

  def logical_shardings(self) -> dict:
    """Where logical params live outside the step (`layout.logical_specs`): as in the
    step under ZeRO-1, split on their largest dimension "data" divides under FSDP."""
    return self._shardings(self.layout.logical_specs())

  def logical_params(self, params: dict) -> dict:
    """This run's params (or a tree shaped like them) as logical arrays (no copy where
    the step holds logical arrays, ZeRO-1)."""
    return self.layout.logical(params, self.logical_shardings())

  def policy_params(self, params: dict, frozen) -> dict:
    """The policy as the model runs it outside the step (generation): `params` as
    logical arrays, under LoRA the adapters attached to the logical frozen base (no
    merge, no copy where the layouts hold logical arrays)."""
    logical = self.logical_params(params)
    if self.plan.lora is None:
      return logical
    base = self.base_layout.logical(frozen["base"], self.base_logical_shardings())
    return lora_lib.attach(base, logical)

  def place_params(self, logical: dict) -> dict:
    """Logical params -> this run's layout and shardings (inverse of `logical_params`)."""
    return self.layout.place(logical, self.param_sharding)

  def abstract_params(self, dtype=None) -> dict:
    """ShapeDtypeStructs of this run's params in its layout and shardings (leaves in
    `dtype`, default the params'): the reference params' too."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        self.layout.abstract_params(dtype), self.param_sharding)

  def abstract_opt_state(self):
    """ShapeDtypeStructs of this run's optimizer state (`layout`'s rows, placed where it
    lives between steps)."""
    return zero.abstract_opt_state(self.layout.cut, self.tx, self.opt_sharding)

  def init_state(self, key: jax.Array, params: dict | None = None) -> dict:
    """A fresh train state around `params` (default: initialised from `key`)."""
    params = self.init_params(key) if params is None else params
    return {"params": params, "opt_state": self._init_opt(params),
            "step": jax.device_put(jnp.zeros((), jnp.int32), self.replicated),
            "nonfinite": self.put_nonfinite([0, 0, 0])}

  def put_nonfinite(self, health) -> jax.Array:
    """`[count, first step, bits]` (host ints) as the state's replicated int32 `[3]`."""
    return jax.device_put(jnp.asarray(health, jnp.int32), self.replicated)

  def _objective(self, params, frozen, ref_logps, batch, drift=False):
    p = self.plan
    return objective.dpo_objective(self.layout.policy(params, frozen), ref_logps, batch, p.loss,
                                   p.model, p.rows, self.layout, drift,
                                   logprob_impl=p.logprob_impl, loss_impl=p.loss_impl)

  @jax.named_scope("reference")  # a part of benchmarks/step_profile.py's breakdown
  def _ref_logps(self, frozen, batch):
    return jax.lax.stop_gradient(objective.sequence_logps(
        self.layout.reference(frozen), batch, self.mcfg, self.plan.logprob_impl,
        self.plan.rows, self.layout))

  def _resolve_ref(self, frozen, batch):
    """Reference log-probs `[b, 2, T]` of a local batch, as the plan's reference mode
    says: computed in the step, carried by the batch, or None."""
    return {"step": lambda: self._ref_logps(frozen, batch),
            "precomputed": lambda: batch["ref_logps"],
            "none": lambda: None}[self.plan.reference]()

  def _train_step(self, state, frozen, batch):
    params = state["params"]
    grads, metrics, pairs = accumulate.pair_means(
        lambda p, mb: self._objective(p, frozen, self._resolve_ref(frozen, mb), mb), params,
        batch, self.plan.micro_batches, self.batch_axes, self.layout.sync_grads,
        self.plan.padded_pairs)
    # A batch without a valid pair (online DPO, every prompt tied) updates nothing.
    metrics, scored = dict(metrics, pairs=pairs), pairs > 0
    step = state["step"] + 1
    check = lambda grad_norm: health_lib.update(state["nonfinite"],
                                                dict(metrics, grad_norm=grad_norm), step)
    with jax.named_scope("optimizer"):  # a non-finite or unscored step changes nothing
      update = self.layout.update(grads, jax.tree.map(lambda x: x[0], state["opt_state"]),
                                  params, accept=lambda norm: check(norm)[0] & scored)
    _, health = check(update.grad_norm)
    new_state = {"params": update.params,
                 "opt_state": jax.tree.map(lambda x: x[None], update.state),
                 "step": step, "nonfinite": health}
    return new_state, dict(metrics, grad_norm=update.grad_norm,
                           learning_rate=self.schedule(state["step"]), nonfinite=health)

  def _eval_step(self, params, frozen, batch):
    loss, metrics = self._objective(params, frozen, self._resolve_ref(frozen, batch), batch,
                                    drift=True)
    return jax.lax.pmean(dict(metrics, loss=loss), self.batch_axes)

  def check_replicas(self, params) -> None:
    """Raises if any device's copy of params replicated over the layout's
    `replica_axis` (and across slices) differs from the others holding the same model
    slice (a layout with no replicas, FSDP, has nothing to check)."""
    if self.layout.replica_axis is None:
      return
    sums = mesh_lib.to_host(self._checksums(params)).reshape(-1, self.model_parallel)
    if (sums != sums[0]).any():
      raise RuntimeError(f"replicas diverged: per-device param checksums {sums.tolist()}")

  def local_positions(self, B: int | None = None) -> np.ndarray:
    """Positions in a global batch of `B` pairs (default `--batch_size`) of the pairs
    this process's devices get: all its host needs to read (`put_batch` writes only
    those)."""
    B = B or self.plan.batch_size
    index = self.pairs.addressable_devices_indices_map((B,))
    return np.unique(np.concatenate([np.arange(B)[i] for i in index.values()]))

  def abstract_inputs(self) -> tuple:
    """`(state, frozen, batch)` of `train_step` as sharded ShapeDtypeStructs, exactly as
    the loop passes them (so compiling these is compiling the run's step): the batch
    with its plan's model rows and head slots (`data.packing`)."""
    plan, rows = self.plan, self.plan.rows
    scalar = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.replicated)
    state = {"params": self.abstract_params(), "opt_state": self.abstract_opt_state(),
             "step": scalar(()), "nonfinite": scalar((3,))}
    frozen = self.abstract_frozen(model_lib.DTYPES[plan.ref_dtype])
    groups, pair = plan.batch_size // rows.pairs, (plan.batch_size, 2, plan.max_length)
    shapes = {k: pair for k in ("tokens", "targets", "loss_mask", "attention_mask")}
    shapes.update({k: (groups * rows.rows, rows.length) for k in packing.ROW_KEYS})
    shapes.update({k: (groups * rows.head,) for k in packing.HEAD_KEYS})
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.pairs)
             for k, shape in shapes.items()}
    if self.plan.reference == "precomputed":
      batch["ref_logps"] = jax.ShapeDtypeStruct(shapes["tokens"], jnp.float32, sharding=self.pairs)
    return state, frozen, batch

  def put_batch(self, batch: dict) -> dict:
    """Host arrays `[B, 2, T]` of the global batch, with the plan's model rows and head
    slots added (`packing.pack`; a batch that does not fit the plan is a ValueError) ->
    device arrays split over the data-parallel devices of every slice on the pair axis,
    each getting the pairs the mesh assigns it wherever its process sits (a topology-
    ordered data axis may interleave hosts): only this process's devices are written."""
    batch = packing.pack(batch, self.plan.rows,
                         self.local_positions(batch["tokens"].shape[0]))
    return {k: jax.make_array_from_callback(v.shape, self.pairs, lambda index, v=v: v[index])
            for k, v in batch.items()}


def make_steps(plan: StepPlan, devices) -> StepFunctions:
  """`StepFunctions` of `plan` on a mesh of `devices` (`parallel.mesh.make_mesh`)."""
  return StepFunctions(plan, mesh_lib.make_mesh(devices, plan.model_parallel,
                                                plan.num_slices))
