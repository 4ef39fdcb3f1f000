"""Bucketed reduce-scatter / all-gather and the ZeRO optimizer on 8 CPU devices."""

import dataclasses
import functools
import itertools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from tunix_core.parallel import collectives
from tunix_core.parallel import mesh as mesh_lib
from tunix_core.parallel import zero

N = 8


def _mesh():
  assert len(jax.devices()) >= N
  return Mesh(np.array(jax.devices()[:N]), ("data",))


def _tree(key, integer_valued):
  """Per-device trees stacked on a leading [8] axis: a scalar, odd sizes, bf16 + f32."""
  shapes = {"scalar": ((), jnp.float32), "odd": ((3, 5), jnp.float32),
            "big": ((37, 11), jnp.float32), "half": ((13,), jnp.bfloat16),
            "nest": {"a": ((9,), jnp.float32), "b": ((2, 2, 3), jnp.bfloat16)}}
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple) and
                                     len(x) == 2 and isinstance(x[0], tuple))
  keys = jax.random.split(key, len(leaves))
  out = []
  for k, (shape, dtype) in zip(keys, leaves):
    x = jax.random.normal(k, (N,) + shape)
    x = jnp.round(x * 8) if integer_valued else x
    out.append(x.astype(dtype))
  return jax.tree.unflatten(treedef, out)


def _sync(plan, impl, comm_dtype=None):
  @functools.partial(jax.shard_map, mesh=_mesh(), check_vma=False, in_specs=P("data"), out_specs=P())
  def f(stacked):
    local = jax.tree.map(lambda x: x[0], stacked)
    shards = collectives.reduce_scatter(local, plan, "data", impl=impl, mean=True,
                                        comm_dtype=comm_dtype)
    return collectives.all_gather(shards, plan, "data", impl=impl)
  return jax.jit(f)


def _psum_mean(plan):
  @functools.partial(jax.shard_map, mesh=_mesh(), check_vma=False, in_specs=P("data"), out_specs=P())
  def f(stacked):
    return jax.tree.map(lambda x: jax.lax.pmean(x[0].astype(jnp.float32), "data").astype(x.dtype),
                        stacked)
  return jax.jit(f)


@pytest.mark.parametrize("impl,bucket_bytes", [
    pytest.param(impl, b, marks=pytest.mark.slow)
    if b == 64 or (impl, b) in (("xla", 4096), ("ring", 2**20), ("all_to_all", 2**20))
    else (impl, b) for impl in collectives.SYNC_IMPLS for b in (64, 4096, 2**20)])
def test_sync_equals_psum_mean(impl, bucket_bytes):
  # Both trees have the same leaves' shapes and dtypes: one plan, one compile of each side.
  local0 = jax.tree.map(lambda x: x[0], _tree(jax.random.PRNGKey(0), True))
  plan = collectives.BucketPlan.create(local0, N, bucket_bytes)
  sync, psum_mean = _sync(plan, impl), _psum_mean(plan)
  for integer_valued, tol in ((True, 0.0), (False, 1e-6)):
    stacked = _tree(jax.random.PRNGKey(0), integer_valued)
    got = sync(stacked)
    want = psum_mean(stacked)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert g.dtype == w.dtype and g.shape == w.shape
      # A bf16 mean is rounded to bf16 once in both, but from f32 sums taken in another
      # order, so random values may land one bf16 ulp apart.
      t = tol if g.dtype == jnp.float32 or integer_valued else 2**-8
      np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                 rtol=t, atol=t)


def test_single_leaf_and_bf16_wire():
  stacked = {"w": jax.random.normal(jax.random.PRNGKey(1), (N, 1000))}
  plan = collectives.BucketPlan.create({"w": stacked["w"][0]}, N, 256)
  assert plan.num_buckets == 1  # larger than a bucket: a bucket of its own
  x = np.asarray(stacked["w"], np.float64)
  want = x.mean(0)
  # At most N roundings to bf16 (relative 2^-9) of values bounded by sum |x_i|, then / N.
  bound = np.abs(x).sum(0) * 2.0**-9
  for impl in collectives.SYNC_IMPLS:
    got = np.asarray(_sync(plan, impl, comm_dtype=jnp.bfloat16)(stacked)["w"])
    assert (np.abs(got - want) <= bound).all()
    assert np.abs(got - want).max() > 0  # the wire really was bf16


def test_a_leaf_of_whole_tiles_moves_as_its_rows():
  """A bucket of one `[n r, c]` leaf, r a multiple of 16 and c of 128, is reduce-scattered
  and gathered as its `[n, r, c]` view (`leaf_rows`: on TPU the flat `[n, piece]` rows
  are a relayout copy of the whole leaf), in column chunks too: each device's shard is
  its piece of the flat layout, and the gather gives back the mean."""
  x = np.round(np.asarray(jax.random.normal(jax.random.PRNGKey(3), (N, N * 16, 384))) * 8)
  plan = collectives.BucketPlan.create({"w": jnp.zeros(x.shape[1:])}, N, 256)
  assert plan.leaf_rows(0) == (16, 384)
  for shape in ((N * 16, 200), (N * 8, 384), (N * 16 + 1, 384), (N * 16, 2, 128)):
    assert collectives.BucketPlan.create({"w": jnp.zeros(shape)}, N).leaf_rows(0) is None
  want = x.mean(0)
  for impl in ("xla", "all_to_all"):  # "ring" moves flat rows
    for chunk_bytes in (None, N * 16 * 128 * 4):  # three chunks of 128 columns
      @functools.partial(jax.shard_map, mesh=_mesh(), check_vma=False, in_specs=P("data"),
                         out_specs=(P("data"), P()))
      def f(stacked):
        shards = collectives.reduce_scatter({"w": stacked[0]}, plan, "data", impl=impl,
                                            chunk_bytes=chunk_bytes)  # pylint: disable=cell-var-from-loop
        return shards[0][None], collectives.all_gather(shards, plan, "data", impl=impl)["w"]  # pylint: disable=cell-var-from-loop
      shards, gathered = jax.jit(f)(jnp.asarray(x, jnp.float32))
      np.testing.assert_array_equal(np.asarray(shards), want.reshape(N, -1))
      np.testing.assert_array_equal(np.asarray(gathered), want)


@pytest.mark.parametrize("stages", [(2, 4), (2, 2, 2)])
def test_a_gather_in_stages_equals_one_gather(stages):
  """FSDP's weight gather in stages of groups (`mesh.stage_groups`: torus rows, then the
  next dimension, ...) leaves every shard where one gather over the axis does, and the
  groups of each stage partition the devices."""
  for i, groups in enumerate(mesh_lib.stage_groups(stages, N)):
    assert sorted(p for g in groups for p in g) == list(range(N))
    assert {len(g) for g in groups} == {stages[i]}
  stacked = _tree(jax.random.PRNGKey(2), False)
  plan = collectives.BucketPlan.create(jax.tree.map(lambda x: x[0], stacked), N, 256)

  def gather(stages_or_none):
    @functools.partial(jax.shard_map, mesh=_mesh(), check_vma=False, in_specs=P("data"),
                       out_specs=P())
    def f(stacked):
      local = jax.tree.map(lambda x: x[0], stacked)
      shards = collectives.reduce_scatter(local, plan, "data", mean=True)
      return collectives.all_gather(shards, plan, "data", stages=stages_or_none)
    return jax.jit(f)(stacked)

  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                          np.asarray(b, np.float32)),
               gather(stages), gather(None))
  with pytest.raises(ValueError, match="do not multiply to the axis size 8"):
    mesh_lib.stage_groups((2, 3), N)


@dataclasses.dataclass(frozen=True)
class _Chip:
  coords: tuple[int, int, int]


@pytest.mark.parametrize("extents", [(4, 4, 4), (2, 2, 4), (8, 8, 8)])
def test_every_gather_stage_is_a_line_of_the_torus(extents):
  """On the mesh `make_mesh` lays a 3-D slice's chips out in (given scrambled), each
  group of gather stage i is a whole line of the torus along coordinate i (the chips
  sharing every other coordinate), and gathering the stages in order (each group
  concatenating its members' blocks in its listed order, as XLA's all-gather does)
  leaves every position holding all positions in order. A mesh in another order (rows
  not snaked) gathers in one stage."""
  chips = [_Chip(c) for c in itertools.product(*map(range, extents))]
  np.random.default_rng(0).shuffle(chips)
  mesh = mesh_lib.make_mesh(chips)
  assert mesh_lib.gather_stages(mesh) == extents
  order = list(mesh.devices.reshape(-1))
  n = len(order)
  held = [[p] for p in range(n)]
  for i, groups in enumerate(mesh_lib.stage_groups(extents, n)):
    assert sorted(p for g in groups for p in g) == list(range(n))
    for group in groups:
      coords = [order[p].coords for p in group]
      assert {c[:i] + c[i + 1:] for c in coords} == {coords[0][:i] + coords[0][i + 1:]}
      assert sorted(c[i] for c in coords) == list(range(extents[i]))
    joined = {p: [q for m in g for q in held[m]] for g in groups for p in g}
    held = [joined[p] for p in range(n)]
  assert all(h == list(range(n)) for h in held)
  raster = sorted(chips, key=lambda c: c.coords[::-1])
  assert mesh_lib.gather_stages(Mesh(np.array(raster), ("data",))) is None


def test_bucket_plan_covers_every_element_once():
  tree = jax.tree.map(lambda x: x[0], _tree(jax.random.PRNGKey(0), True))
  plan = collectives.BucketPlan.create(tree, N, 100)
  members = [i for b in plan.buckets for i in b]
  assert sorted(members) == list(range(len(plan.shapes)))
  assert len(members) == len(set(members))
  for b in range(plan.num_buckets):
    assert plan.bucket_size(b) % N == 0
    assert len({plan.dtypes[i] for i in plan.buckets[b]}) == 1
  # Tag every element with its own index: unpack(pack(.)) puts each back exactly once.
  sizes = [int(np.prod(s)) for s in plan.shapes]
  starts = np.cumsum([0] + sizes)
  tagged = jax.tree.unflatten(plan.treedef, [
      jnp.arange(starts[i], starts[i] + n, dtype=jnp.float32).reshape(plan.shapes[i])
      for i, n in enumerate(sizes)])
  flat = np.concatenate([np.asarray(b) for b in plan.pack(tagged)])
  real = np.sort(flat[flat > 0])
  np.testing.assert_array_equal(real, np.arange(1, starts[-1]))
  assert (flat == 0).sum() == 1 + sum(plan.bucket_size(b) for b in range(plan.num_buckets)) \
      - starts[-1]
  # the last leaf comes first: backward produces it first
  assert plan.buckets[0][0] == len(plan.shapes) - 1
  assert hash(plan) == hash(collectives.BucketPlan.create(tree, N, 100))


def test_hlo_has_one_collective_pair_per_bucket():
  stacked = _tree(jax.random.PRNGKey(0), False)
  plan = collectives.BucketPlan.create(jax.tree.map(lambda x: x[0], stacked), N, 64)
  assert plan.num_buckets > 2
  hlo = _sync(plan, "xla").lower(stacked).compile().as_text()
  assert len(re.findall(r"= \S+ reduce-scatter\(", hlo)) == plan.num_buckets
  assert len(re.findall(r"= \S+ all-gather\(", hlo)) == plan.num_buckets


def _params(key):
  k = jax.random.split(key, 3)
  return {"w": jax.random.normal(k[0], (7, 5)), "b": jax.random.normal(k[1], (5,)),
          "norm": 1 + 0.1 * jax.random.normal(k[2], (11,))}


def _decay_mask(params):
  return jax.tree_util.tree_map_with_path(lambda p, _: p[-1].key != "norm", params)


def test_sharded_adamw_matches_replicated_chain():
  params = _params(jax.random.PRNGKey(0))
  steps = 5
  grads = [jax.tree.map(lambda x: 3 * jax.random.normal(k, (N,) + x.shape), params)
           for k in jax.random.split(jax.random.PRNGKey(1), steps)]
  max_norm = 0.5
  tx = optax.adamw(1e-2, weight_decay=0.1, mask=_decay_mask)
  plan = collectives.BucketPlan.create(params, N, 64)
  opt = zero.ShardedOptimizer(tx, plan, "data", max_grad_norm=max_norm)

  @functools.partial(jax.shard_map, mesh=_mesh(), check_vma=False, in_specs=(P(),), out_specs=P("data"))
  def init(params):
    return jax.tree.map(lambda x: x[None], opt.init(params))

  @functools.partial(jax.shard_map, mesh=_mesh(), check_vma=False, in_specs=(P("data"), P("data"), P()),
                     out_specs=(P(), P("data"), P()))
  def step(g, state, params):
    state = jax.tree.map(lambda x: x[0], state)
    params, state, norm = opt.update(jax.tree.map(lambda x: x[0], g), state, params)
    return params, jax.tree.map(lambda x: x[None], state), norm

  ref_tx = optax.chain(optax.clip_by_global_norm(max_norm), tx)
  ref_params, ref_state = params, ref_tx.init(params)
  state = jax.jit(init)(params)
  norms = []
  for g in grads:
    params, state, norm = jax.jit(step)(g, state, params)
    mean_g = jax.tree.map(lambda x: x.mean(0), g)
    norms.append(float(optax.tree.norm(mean_g)))
    np.testing.assert_allclose(float(norm), norms[-1], rtol=1e-6)
    updates, ref_state = ref_tx.update(mean_g, ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-6, atol=1e-6)
  assert min(norms) > max_norm  # clipping was active at every step

  # Each device holds adam's mu and nu for its 1/8 piece of every leaf (+ a step count);
  # the replicated optimizer holds them for every element.
  full = sum(x.size for x in jax.tree.leaves(params))
  per_device = sum(x.size for x in jax.tree.leaves(state)) // N
  pieces = sum(plan.piece_size(i) for i in range(len(plan.shapes)))
  assert per_device == 2 * pieces + 1
  assert sum(x.size for x in jax.tree.leaves(ref_state)) == 2 * full + 1
  assert full <= N * pieces < full + N * len(plan.shapes)  # 1/8, up to padding


@pytest.mark.parametrize("n", [1, N])
def test_an_update_matches_the_chain_and_a_rejected_one_changes_nothing(n):
  """On one device (`SingleShardOptimizer`, the leaves whole) and on 8 (ZeRO-1's flat
  pieces): an accepted step equals replicated `clip_by_global_norm + adamw`; a step
  whose `accept(grad_norm)` is False (a NaN gradient here) leaves params and every
  leaf of the optimizer state, adam's count included, bit for bit as they were."""
  params = _params(jax.random.PRNGKey(0))
  tx = optax.adamw(1e-2, weight_decay=0.1, mask=_decay_mask)
  plan = collectives.BucketPlan.create(params, n, 64)
  optimizer = zero.SingleShardOptimizer if n == 1 else zero.ShardedOptimizer
  opt = optimizer(tx, plan, "data", max_grad_norm=0.5)
  mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
  rows = lambda t: jax.tree.map(lambda x: x[None], t)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, check_vma=False, in_specs=(P("data"), P()),
                     out_specs=(P(), P("data"), P("data")))
  def init_and_step(g, params):
    state = opt.init(params)
    new, new_state, _ = opt.update(jax.tree.map(lambda x: x[0], g), state, params,
                                   accept=jnp.isfinite)
    return new, rows(new_state), rows(state)

  g = jax.tree.map(lambda x: 3 * jax.random.normal(jax.random.PRNGKey(1), (n,) + x.shape),
                   params)
  new, _, _ = init_and_step(g, params)
  ref_tx = optax.chain(optax.clip_by_global_norm(0.5), tx)
  updates, _ = ref_tx.update(jax.tree.map(lambda x: x.mean(0), g), ref_tx.init(params), params)
  chex.assert_trees_all_close(new, optax.apply_updates(params, updates), rtol=1e-6, atol=1e-6)
  g = jax.tree.map(lambda x: x.at[0].set(jnp.nan), g)
  kept, kept_state, state = init_and_step(g, params)
  chex.assert_trees_all_equal(kept, params)
  chex.assert_trees_all_equal(kept_state, state)
  if n == 1:  # the state in the params' own shapes: nothing flattened
    assert jax.tree.map(jnp.shape, kept_state[0].mu) == jax.tree.map(
        lambda x: (1,) + x.shape, params)
