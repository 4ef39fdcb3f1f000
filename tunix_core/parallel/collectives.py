"""Hand-written data-parallel gradient sync: bucketed reduce-scatter and all-gather.

Call these inside `jax.shard_map` over a mesh axis of `num_shards` devices.

A `BucketPlan` packs the leaves of a pytree, last leaf first (the order backward
produces gradients), into flat buckets of one dtype and at most `bucket_bytes` (a leaf
larger than that gets a bucket of its own). Inside a bucket the layout is interleaved
by shard: each leaf is zero-padded to a multiple of `num_shards`, cut into
`num_shards` equal pieces, and the bucket is

    [leaf_a piece 0 | leaf_b piece 0 | ... | leaf_a piece 1 | leaf_b piece 1 | ...]

so shard `i` of a bucket (what a tiled reduce-scatter leaves on device `i`) holds
piece `i` of every leaf in it. That lets the ZeRO optimizer present its local shard as
a pytree with the structure of the params, so per-leaf optax masks still work.

On the wire each shard is padded to whole TPU tiles (`TILE` elements, the reduce-scatter
viewing its rows as `[n, 16, w / 16]`): the TPU compiler emits a reduce-scatter (an
all-gather) only for shards it can tile, and turns any other into an all-reduce, which
moves twice a ring reduce-scatter's bytes (found by compiling for a v5e-8:
`tests/test_aot.py`). The padding never reaches the buckets' layout or a checkpoint.
A bucket of one 2-D leaf whose pieces are whole rows of tiles travels as the leaf's
`[n, r, c]` view instead (`BucketPlan.leaf_rows`): the same pieces, without the copy of
the whole leaf that its flat rows are on TPU (the 70B head's 2 GiB gradient).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from tunix_core.parallel import mesh as mesh_lib
from tunix_core.parallel import ring

SYNC_IMPLS = ("xla", "ring", "all_to_all")
# Dtypes gradients may travel in (`comm_dtype=`).
COMM_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}
# Elements of a shard on the wire are a multiple of this: 16 sublanes x 128 lanes, whole
# (8, 128) float32 and (16, 128) bfloat16 tiles.
TILE = 2048
_SUBLANES = 16


def _pad_to_tile(x):
  """`x` zero-padded on its last axis to a multiple of `TILE`."""
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % TILE)])


@dataclasses.dataclass(frozen=True)
class BucketPlan:
  """Static layout of a pytree in flat buckets; hashable, usable as a jit static arg.

  Attributes:
    treedef: structure of the planned tree.
    shapes, dtypes: per leaf (in `jax.tree.leaves` order), dtypes as names.
    num_shards: devices the buckets are split over.
    buckets: per bucket, the indices of its leaves in packing order.
    bucket_bytes: the size limit the plan was built with.
  """

  treedef: jax.tree_util.PyTreeDef
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  num_shards: int
  buckets: tuple[tuple[int, ...], ...]
  bucket_bytes: int

  @classmethod
  def create(cls, tree, num_shards: int, bucket_bytes: int = 25 * 2**20) -> "BucketPlan":
    """Plans `tree` (arrays or `jax.ShapeDtypeStruct`s) for `num_shards` devices."""
    if num_shards < 1:
      raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if bucket_bytes < 1:
      raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      raise ValueError("cannot plan an empty tree")
    shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
    dtypes = tuple(jnp.dtype(x.dtype).name for x in leaves)
    buckets, open_bucket = [], {}  # dtype -> (leaf indices, bytes)
    for i in reversed(range(len(leaves))):
      nbytes = _padded_size(shapes[i], num_shards) * jnp.dtype(dtypes[i]).itemsize
      members, used = open_bucket.get(dtypes[i], ([], 0))
      if members and used + nbytes > bucket_bytes:
        buckets.append(tuple(members))
        members, used = [], 0
      open_bucket[dtypes[i]] = (members + [i], used + nbytes)
    buckets.extend(tuple(m) for m, _ in open_bucket.values())
    return cls(treedef, shapes, dtypes, num_shards, tuple(buckets), bucket_bytes)

  @property
  def num_buckets(self) -> int:
    return len(self.buckets)

  def piece_size(self, leaf: int) -> int:
    """Elements of `leaf` in each shard (its padded size / num_shards)."""
    return _padded_size(self.shapes[leaf], self.num_shards) // self.num_shards

  def shard_size(self, bucket: int) -> int:
    return sum(self.piece_size(i) for i in self.buckets[bucket])

  def bucket_size(self, bucket: int) -> int:
    return self.shard_size(bucket) * self.num_shards

  def bucket_dtype(self, bucket: int) -> str:
    return self.dtypes[self.buckets[bucket][0]]

  def leaf_rows(self, bucket: int) -> tuple[int, int] | None:
    """`(r, c)` when `bucket` is one 2-D leaf `[n r, c]` of whole TPU tiles per piece (r a
    multiple of 16 sublanes, c of 128 lanes): piece s is then rows `[s r, (s + 1) r)` as
    they lie, and the collectives move the leaf as `[n, r, c]`, a view of it, where the
    flat `[n, piece]` rows are a relayout copy of the whole leaf on TPU (2 GiB for a
    Llama-3-70B head). None otherwise."""
    members = self.buckets[bucket]
    shape = self.shapes[members[0]]
    if len(members) != 1 or len(shape) != 2:
      return None
    r, c = shape[0] // self.num_shards, shape[1]
    return (r, c) if r * self.num_shards == shape[0] and r % _SUBLANES == 0 and c % 128 == 0 \
        else None

  def pack(self, tree) -> list[jax.Array]:
    """The tree as flat buckets `[bucket_size(b)]`, in the interleaved layout."""
    return [rows.reshape(-1) for rows in self.bucket_rows(tree, views=False)]

  def bucket_rows(self, tree, *, views=True) -> list[jax.Array]:
    """Per bucket, what its collectives move: the flat bucket as `[num_shards,
    shard_size(b)]` rows, row s being shard s's pieces; with `views`, a bucket of whole
    tiles (`leaf_rows`) as its leaf's `[num_shards, r, c]` view instead (no copy)."""
    leaves = self._leaves(tree)
    out = []
    for b, members in enumerate(self.buckets):
      view = self.leaf_rows(b) if views else None
      out.append(leaves[members[0]].reshape(self.num_shards, *view) if view else
                 jnp.concatenate([self.leaf_pieces(leaves[i], i) for i in members], axis=1))
    return out

  def unpack(self, buckets) -> object:
    """Inverse of `pack`: the tree, each leaf cast back to its planned dtype."""
    leaves = [None] * len(self.shapes)
    for b, members in enumerate(self.buckets):
      rows = buckets[b].reshape(self.num_shards, -1)
      offset = 0
      for i in members:
        k = self.piece_size(i)
        flat = rows[:, offset:offset + k].reshape(-1)[:math.prod(self.shapes[i])]
        leaves[i] = flat.reshape(self.shapes[i]).astype(self.dtypes[i])
        offset += k
    return jax.tree.unflatten(self.treedef, leaves)

  def shards_to_tree(self, shards) -> object:
    """Local shards (one per bucket) as a tree of 1-D pieces `[piece_size(leaf)]`."""
    leaves = [None] * len(self.shapes)
    for b, members in enumerate(self.buckets):
      offset = 0
      for i in members:
        leaves[i] = shards[b][offset:offset + self.piece_size(i)]
        offset += self.piece_size(i)
    return jax.tree.unflatten(self.treedef, leaves)

  def tree_to_shards(self, pieces) -> list[jax.Array]:
    """Inverse of `shards_to_tree`."""
    leaves = self._leaves(pieces, check_shapes=False)
    return [jnp.concatenate([leaves[i] for i in members]) for members in self.buckets]

  def local_pieces(self, tree, shard_index) -> object:
    """Piece `shard_index` (may be traced) of every leaf: a tree of 1-D arrays."""
    leaves = self._leaves(tree)
    return jax.tree.unflatten(self.treedef, [
        jax.lax.dynamic_index_in_dim(self.leaf_pieces(x, i), shard_index, keepdims=False)
        for i, x in enumerate(leaves)])

  def leaf_pieces(self, leaf, i):
    """Leaf `i` (an array of its planned shape) flattened, zero-padded and cut into
    `[num_shards, piece_size(i)]` rows, row s being shard s's piece."""
    # The barrier keeps XLA from fusing the two reshapes into one `[L, D, F]` (8 x 128
    # tiles) -> `[n, piece]` relayout: for some shapes the TPU compiler's code
    # generation of that one op takes minutes (SmolLM2's `[30, 576, 1536]`: 51 s, and
    # 360M's `[32, 960, 2560]`: 160 s, where the 1-D flatten then the rows take 0.4 s).
    flat = jax.lax.optimization_barrier(leaf.reshape(-1))
    pad = self.piece_size(i) * self.num_shards - flat.size
    return jnp.pad(flat, (0, pad)).reshape(self.num_shards, -1)

  def _leaves(self, tree, check_shapes=True):
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != self.treedef:
      raise ValueError(f"tree structure {treedef} does not match the plan's {self.treedef}")
    if check_shapes:
      for i, x in enumerate(leaves):
        if tuple(x.shape) != self.shapes[i]:
          raise ValueError(f"leaf {i} has shape {tuple(x.shape)}, the plan says "
                           f"{self.shapes[i]}")
    return leaves


def _padded_size(shape, num_shards):
  return -(-max(math.prod(shape), 1) // num_shards) * num_shards


def _check(plan, axis_name, impl):
  if impl not in SYNC_IMPLS:
    raise ValueError(f"unknown collective impl {impl!r}; choose one of {SYNC_IMPLS}")
  size = jax.lax.axis_size(axis_name)
  if size != plan.num_shards:
    raise ValueError(f"mesh axis {axis_name!r} has {size} devices but the plan was made "
                     f"for {plan.num_shards} shards")


def reduce_scatter(tree, plan: BucketPlan, axis_name, *, impl="xla", mean=True,
                   comm_dtype=None, chunk_bytes=None) -> list[jax.Array]:
  """Sums (or averages) `tree` over `axis_name`; returns this device's shard per bucket.

  Args:
    tree: local values (e.g. gradients) with the plan's structure; leaves may be in a
      narrower dtype than the plan's (bf16 cotangents of float32 params): each bucket is
      cast to its planned dtype before it is summed.
    impl: "xla" (one tiled `lax.psum_scatter` per bucket), "ring" (`num_shards - 1`
      `lax.ppermute` steps per bucket, accumulating in float32) or "all_to_all" (one
      `lax.all_to_all` per bucket and a float32 sum of the rows each device receives).
    mean: divide by the number of devices.
    comm_dtype: dtype on the wire, e.g. `jnp.bfloat16` to halve the bytes: "xla"
      reduce-scatters in it (the compiler's reduction sums in that dtype), "ring" sends
      it and accumulates in float32, "all_to_all" sends it and sums in float32.
    chunk_bytes: if set, each bucket is reduced in column chunks whose operand (all
      devices' rows, in the planned dtype) is at most this many bytes, so the cast copy
      of a large bucket never exists whole: a bf16 layer of a 7B model would otherwise
      need two float32 copies of the full layer. The chunks are chained by
      `optimization_barrier`s so the scheduler cannot cast them all at once. The sums
      are the same.

  Returns:
    `[plan.shard_size(b)]` arrays in each bucket's dtype.
  """
  _check(plan, axis_name, impl)
  n = plan.num_shards
  out = []
  # `[n, w]` rows of the flat bucket, or the leaf's `[n, r, c]` view (`leaf_rows`).
  for b, rows in enumerate(plan.bucket_rows(tree, views=impl != "ring")):
    dtype = jnp.dtype(plan.bucket_dtype(b))
    width, align = rows.shape[-1], (TILE if rows.ndim == 2 else 128)
    column = rows.size // width * dtype.itemsize  # bytes of one column of every row
    step = width if chunk_bytes is None else max(
        align, chunk_bytes // column // align * align)  # whole tiles per chunk
    parts = []
    for a in range(0, width, step):
      chunk = rows[..., a:a + step]
      if parts:  # cast this chunk only once the last one is summed: one copy at a time
        parts[-1], chunk = jax.lax.optimization_barrier((parts[-1], chunk))
      parts.append(_reduce_scatter_rows(chunk.astype(dtype), axis_name, n, impl, comm_dtype))
    shard = (parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)).reshape(-1)
    if mean:
      shard = shard.astype(jnp.float32) / n
    out.append(shard.astype(dtype))
  return out


def _reduce_scatter_rows(rows, axis_name, n, impl, comm_dtype):
  """`[n, w]` local rows -> row `axis_index` summed over the axis, `[w]`; `[n, r, w]`
  rows of whole tiles (`BucketPlan.leaf_rows`) -> `[r, w]`."""
  wire = rows if comm_dtype is None else rows.astype(comm_dtype)
  if rows.ndim == 3:
    if impl == "all_to_all":
      got = jax.lax.all_to_all(wire, axis_name, 0, 0, tiled=True)
      return got.astype(jnp.float32).sum(0)
    return jax.lax.psum_scatter(wire, axis_name, scatter_dimension=0, tiled=True)[0]
  if impl == "ring":
    return ring.reduce_scatter(rows.astype(jnp.float32), axis_name, n, wire.dtype)
  if impl == "all_to_all":
    # Row j goes to device j, which sums the n rows it receives in float32: a
    # reduce-scatter's bytes, where the TPU compiler makes `psum_scatter` an all-reduce.
    got = jax.lax.all_to_all(_pad_to_tile(wire), axis_name, 0, 0, tiled=True)
    return got.astype(jnp.float32).sum(0)[:rows.shape[1]]
  tiles = _pad_to_tile(wire).reshape(n, _SUBLANES, -1)
  return jax.lax.psum_scatter(tiles, axis_name, scatter_dimension=0,
                              tiled=True).reshape(-1)[:rows.shape[1]]


def all_gather(shards, plan: BucketPlan, axis_name, *, impl="xla", stages=None):
  """Gathers every device's shard of every bucket and unpacks them into a tree.

  `stages` (impl "xla"): gather in stages along the lines of a torus of these extents,
  x first (`parallel.mesh.stage_groups`), the axis being its chips in `ici_order`: a
  3-D TPU slice, on which the compiler turns one gather over the whole axis into an
  all-reduce (`parallel.mesh.gather_stages`).
  """
  _check(plan, axis_name, impl)
  if len(shards) != plan.num_buckets:
    raise ValueError(f"got {len(shards)} shards for a plan of {plan.num_buckets} buckets")
  buckets = []
  for b, shard in enumerate(shards):
    if impl == "ring":
      buckets.append(ring.all_gather(shard, axis_name, plan.num_shards))
    else:  # the flat shard, or the leaf's rows (`leaf_rows`: the gather is the leaf)
      view = plan.leaf_rows(b)
      whole = _pad_to_tile(shard) if view is None else shard.reshape(view)
      for groups in mesh_lib.stage_groups(stages, plan.num_shards) if stages else [None]:
        whole = jax.lax.all_gather(whole, axis_name, tiled=True, axis_index_groups=groups)
      buckets.append(whole.reshape(plan.num_shards, -1)[:, :shard.shape[0]].reshape(-1))
  return plan.unpack(buckets)
