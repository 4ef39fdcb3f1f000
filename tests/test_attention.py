"""`tunix_kernels.attention`: the Pallas kernels (interpret mode) against a float64 NumPy oracle
on random row layouts; the tiles they visit; the model's shared and packed rows through
the kernels for every family of `tests/fixtures/hf`; dispatch and tiles; and, with
libtpu, the kernels and a shared-prefix train step compiled by the real TPU compiler."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import runs
from tunix_kernels import attention
from tunix_kernels import dispatch
from tunix_kernels.attention import blocks as attention_blocks
from tunix_kernels.attention import visits as attention_visits
from tunix_kernels import tpu
from tunix_kernels import tuned
from tunix_kernels import aot_tpu
from oracles import numpy_attention
from oracles import numpy_attention_mask
from oracles import rel_error
from tunix_core import data as data_lib
from tunix_core import hf
from tunix_core.aot import compile as aot
from tunix_core.data import packing
from tunix_core.training import objective
from tunix_core.training import plan as plan_lib

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
needs_libtpu = pytest.mark.skipif(not aot_tpu.has_libtpu(), reason="needs libtpu (.[tpu] extra)")


def _layout(rng, B, T, sequences=3, pad=0.1):
  """Random rows as the trainer builds them: each row holds `sequences` sequences at
  random cuts (segment ids 1, 2, ...), each a prompt (branch 0) then two response
  branches 1 and 2 whose rope positions both continue from the prompt; a random `pad`
  share of the keys is padding, and so is a tail of the last row."""
  seg, br, pos = (np.zeros((B, T), np.int32) for _ in range(3))
  valid = (rng.random((B, T)) >= pad).astype(np.int32)
  valid[-1, -T // 5:] = 0
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), sequences - 1, replace=False))
    seg[b] = 1 + np.searchsorted(cuts, np.arange(T), side="right")
    for s in range(1, sequences + 1):
      idx = np.flatnonzero(seg[b] == s)
      p = rng.integers(1, max(2, len(idx)))
      chosen = (len(idx) - p) // 2
      pos[b, idx[:p]] = np.arange(p)
      pos[b, idx[p:p + chosen]] = p + np.arange(chosen)
      pos[b, idx[p + chosen:]] = p + np.arange(len(idx) - p - chosen)
      br[b, idx[p:p + chosen]], br[b, idx[p + chosen:]] = 1, 2
  return pos, valid, seg, br


CASES = {  # T, H, KV, K, softcap, window, dtype, blocks
    "ragged-gqa": (250, 2, 1, 64, 0.0, 0, np.float32, (128, 128)),
    "cap-window-mqa": (256, 4, 1, 128, 20.0, 6, np.float32, (128, 256)),
    "short-row": (72, 2, 2, 64, 0.0, 0, np.float32, (128, 128)),
    "bf16": (200, 2, 1, 64, 30.0, 9, jnp.bfloat16, (128, 128)),
    "full-tiles": (512, 2, 1, 64, 0.0, 0, np.float32, (128, 128)),  # unmasked tiles too
}


@pytest.mark.parametrize("impl,case", [
    pytest.param(i, c, marks=() if c == "ragged-gqa" or (i, c) == ("interpret", "full-tiles")
                 else pytest.mark.slow)
    for i in ("interpret", "interpret-split", "auto", "naive") for c in CASES])
def test_attention_matches_the_float64_oracle(impl, case, monkeypatch):
  """The Pallas kernels (interpret mode) in the case's tiles, their backward fused (the
  default at these sizes) and split ("interpret-split"), the blockwise XLA path that
  `impl="auto"` takes off TPU in 128 x 128 tiles (several per row, the last one padded)
  and the naive oracle (whole scores), in values and in the gradients of q, k and v."""
  T, H, KV, K, softcap, window, dtype, blocks = CASES[case]
  fused = impl != "interpret-split"
  impl = impl.split("-")[0]
  if impl == "auto":
    blocks = (128, 128)
  elif case == "bf16":  # visit lists over the scalar-memory budget: one row per call
    monkeypatch.setattr(attention, "_SMEM_LIST_BYTES", 4 * 2 * 2)
  rng = np.random.default_rng(len(case))
  B = 2
  pos, valid, seg, br = _layout(rng, B, T, **(dict(sequences=2, pad=0.0)
                                              if case == "full-tiles" else {}))
  vis = attention.Visibility(*map(jnp.asarray, (pos, valid, seg, br)))
  q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
             for s in ((B, T, H, K), (B, T, KV, K), (B, T, KV, K)))
  g = rng.standard_normal((B, T, H, K)).astype(np.float32)
  scale = K ** -0.5 * 2.0

  @jax.jit
  def run(q, k, v):
    f = lambda q, k, v: attention.attention(
        q, k, v, vis, scale=scale, softcap=softcap, window=window, impl=impl,
        block_sizes=attention.BlockSizes(*blocks, fused_backward=fused))
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(jnp.asarray(g, dtype))

  got, grads = run(q, k, v)
  mask = numpy_attention_mask(pos, valid, seg, br, window)
  assert 0 < mask.sum() < mask.size / 3
  n = T // blocks[0]  # "full-tiles": some 128 x 128 tiles run unmasked
  assert case != "full-tiles" or mask.reshape(B, n, 128, n, 128).all(axis=(2, 4)).sum() >= 4
  want = numpy_attention(q, k, v, g, mask, scale, softcap)
  tol = 1e-5 if dtype == np.float32 else 3e-2
  for name, a, w in zip(("out", "dq", "dk", "dv"), (got, *grads), want):
    assert a.dtype == dtype, name
    assert rel_error(np.asarray(a, np.float32), w) < tol, name


def _xla_temporaries(T, H=32, KV=8, K=128):
  """Compiled temporaries of `impl="auto"` on CPU, forward and backward, for one
  shared-prefix row of `T` bf16 tokens: prompt T/2, chosen and rejected T/4 each."""
  p, r = T // 2, T // 4
  br = np.repeat(np.array([0, 1, 2], np.int32), (p, r, T - p - r))[None]
  pos = np.concatenate([np.arange(p + r), p + np.arange(T - p - r)]).astype(np.int32)[None]

  def grads(q, k, v, g):
    vis = attention.Visibility(jnp.asarray(pos), jnp.ones((1, T), jnp.int32), None,
                               jnp.asarray(br))
    f = lambda q, k, v: attention.attention(q, k, v, vis, scale=K ** -0.5, impl="auto")
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(g)

  S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  compiled = jax.jit(grads).lower(S(1, T, H, K), S(1, T, KV, K), S(1, T, KV, K),
                                  S(1, T, H, K)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # two compiles of rows of 2,048 and 8,192 tokens
def test_attention_off_tpu_holds_no_t_by_t_array():
  """The blockwise XLA path's temporaries grow linearly in the row (quadratic scores
  would grow them 16-fold over 4x the length): at 8,192 tokens 1/8 of the 32.3 GiB the
  dense scores of the path before it took (measured on this CPU)."""
  temps = {T: _xla_temporaries(T) for T in (2048, 8192)}
  assert temps[8192] <= 32.3 * 2**30 / 8, temps
  assert temps[8192] <= 4.4 * temps[2048], temps


def _decoded(index, count, outer, inner):
  """`{(b, i): set of listed blocks}` of a `Visits` list."""
  B = count.size // outer
  index, count = np.asarray(index).reshape(B, outer, inner), np.asarray(count).reshape(B, outer)
  return {(b, i): set(index[b, i, :count[b, i]].tolist()) for b in range(B)
          for i in range(outer)}


def _decoded_kind(index, count, kinds, outer, inner, kind=attention_visits.FULL):
  """`{(b, i): set of listed blocks marked kind}` of a `Visits` list."""
  B = count.size // outer
  index, kinds = (np.asarray(x).reshape(B, outer, inner) for x in (index, kinds))
  count = np.asarray(count).reshape(B, outer)
  return {(b, i): {int(x) for x, f in zip(index[b, i, :count[b, i]], kinds[b, i])
                   if f == kind} for b in range(B) for i in range(outer)}


def test_only_tiles_with_a_visible_entry_are_visited():
  """From both sides (the forward/dq lists and the dk/dv lists): on rows of contiguous
  sequences and branches every listed tile has a visible entry and every tile with one
  is listed; a rejected branch never visits the chosen branch's own tiles."""
  rng = np.random.default_rng(0)
  B, T, b = 2, 512, 128
  pos, valid, seg, br = _layout(rng, B, T, sequences=2, pad=0.0)
  mask = numpy_attention_mask(pos, valid, seg, br, 0)
  n = T // b
  tiles = mask.reshape(B, n, b, n, b).any(axis=(2, 4))             # [B, nq, nk]
  visits = jax.jit(attention_visits.visits, static_argnums=(5, 6))
  got = visits(*map(jnp.asarray, (seg, br, pos, valid)), attention_visits.NO_WINDOW, b, b)
  assert _decoded(got.kv_index, got.kv_count, n, n) == {
      (r, i): set(np.flatnonzero(tiles[r, i]).tolist()) for r in range(B) for i in range(n)}
  assert _decoded(got.q_index, got.q_count, n, n) == {
      (r, j): set(np.flatnonzero(tiles[r, :, j]).tolist()) for r in range(B) for j in range(n)}
  # A tile marked full is visible everywhere, and here every such tile is marked; one
  # marked causal is its causal triangle exactly.
  full = mask.reshape(B, n, b, n, b).all(axis=(2, 4))
  assert _decoded_kind(got.kv_index, got.kv_count, got.kv_kind, n, n) == {
      (r, i): set(np.flatnonzero(full[r, i]).tolist()) for r in range(B) for i in range(n)}
  assert _decoded_kind(got.q_index, got.q_count, got.q_kind, n, n) == {
      (r, j): set(np.flatnonzero(full[r, :, j]).tolist()) for r in range(B) for j in range(n)}
  triangle = np.tril(np.ones((b, b), bool))
  causal = _decoded_kind(got.kv_index, got.kv_count, got.kv_kind, n, n, attention_visits.CAUSAL)
  assert all((mask[r, i * b:(i + 1) * b, j * b:(j + 1) * b] == triangle).all()
             for (r, i), js in causal.items() for j in js)
  assert sum(map(len, causal.values())) > 0
  # By hand: one shared row of a 512-token prompt and two 512-token responses in
  # 128-token tiles. The prompt's 4 query blocks visit 1 + 2 + 3 + 4 tiles; each response
  # block visits the 4 prompt tiles and its own branch's causal ones: 62 of the 78 causal
  # tiles, and no rejected block ever visits a chosen one (key blocks 4 to 7).
  ones = np.ones((1, 1536), np.int32)
  br = np.repeat(np.array([[0, 1, 2]], np.int32), 512, axis=1)
  pos = np.concatenate([np.arange(1024), np.arange(512, 1024)])[None].astype(np.int32)
  got = visits(*map(jnp.asarray, (ones, br, pos, ones)), attention_visits.NO_WINDOW, b, b)
  listed = _decoded(got.kv_index, got.kv_count, 12, 12)
  assert int(got.kv_count.sum()) == 62
  # Of them only the 12 on the diagonal need a mask, the causal comparison alone: 6
  # below it in the prompt, and in each branch 16 prompt tiles and 6 of its own below
  # the diagonal, need none.
  kinds = np.asarray(got.kv_kind).reshape(12, 12)
  counts = lambda kind: sum((kinds[i, :c] == kind).sum()
                            for i, c in enumerate(np.asarray(got.kv_count)))
  assert (counts(attention_visits.FULL), counts(attention_visits.CAUSAL)) == (50, 12)
  assert listed[0, 8] == {0, 1, 2, 3, 8} and listed[0, 11] == {0, 1, 2, 3, 8, 9, 10, 11}
  # Padding keys and windows only ever remove tiles; the lists stay a superset.
  pos, valid, seg, br = _layout(rng, B, T)
  mask = numpy_attention_mask(pos, valid, seg, br, 100)
  got = visits(*map(jnp.asarray, (seg, br, pos, valid)), 100, b, b)
  listed = _decoded(got.kv_index, got.kv_count, n, n)
  needed = mask.reshape(B, n, b, n, b).any(axis=(2, 4))
  assert all(set(np.flatnonzero(needed[r, i])) <= listed[r, i] for r, i in listed)
  full = mask.reshape(B, n, b, n, b).all(axis=(2, 4))
  marked = _decoded_kind(got.kv_index, got.kv_count, got.kv_kind, n, n)
  assert all(marked[r, i] <= set(np.flatnonzero(full[r, i])) for r, i in marked)


# The fixture families whose attention differs: Qwen2 and Qwen3 attend as Llama does and
# Mistral's sliding window is Gemma 2's and 3's (their other differences: test_hf).
ATTENTION_FAMILIES = ("gemma", "gemma2", "gemma3_text", "llama3", "llama_tied")


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow)
                                    for f in ATTENTION_FAMILIES])
def test_shared_and_packed_rows_through_the_kernels_equal_plain_rows(family):
  """The model's log-probs on shared, packed and shared+packed rows with the kernels
  (interpret mode) equal those of each response's own row on the XLA path."""
  d = os.path.join(FIXTURES, family)
  mcfg = hf.read_config(d)
  params = hf.load_params(d, mcfg)
  ds = data_lib.load_dataset(runs.TRAIN, data_lib.ByteTokenizer(), 40, 20)
  host = data_lib.take_pairs(ds, np.arange(4))
  real = host["targets"] != -100
  host["tokens"] %= mcfg.vocab_size
  host["targets"] = np.where(real, host["targets"] % mcfg.vocab_size, host["targets"])
  logps = jax.jit(lambda p, b, spec, c: objective.sequence_logps(p, b, c, "xla", spec),
                  static_argnums=(2, 3))

  def run(share, pack, impl):
    spec = packing.make_spec(packing.pair_sizes(host, share), 4, share, pack)
    c = dataclasses.replace(mcfg, attention_impl=impl)
    return logps(params, jax.tree.map(jnp.asarray, packing.pack(host, spec)), spec, c)

  want = run(False, False, "xla")
  assert float(jnp.abs(want).sum()) > 0
  for share, pack in ((True, False), (False, True), (True, True)):
    assert rel_error(run(share, pack, "interpret"), want) < 1e-5, (share, pack)


def test_dispatch_tiles_and_errors():
  assert dispatch.resolve_impl("attention", "auto") == "xla"  # CPU here
  with pytest.raises(ValueError, match="unknown attention impl"):
    attention.attention(jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 2, 4)),
                        jnp.zeros((1, 8, 2, 4)), None, scale=1.0, impl="flash")
  with pytest.raises(ValueError, match="multiple of 128"):
    attention.BlockSizes(100, 128)
  with pytest.raises(ValueError, match="MiB of VMEM"):
    attention.BlockSizes(2048, 2048).check(256, jnp.float32)
  assert attention.BlockSizes.get_default(128, jnp.bfloat16, seq_len=300) == \
      attention.BlockSizes(384, 384)
  assert attention.BlockSizes.get_default(256, jnp.float32).vmem_bytes(256, jnp.float32) <= \
      0.9 * tpu.MIN_SCOPED_VMEM_BYTES
  q = jnp.zeros((1, 8, 3, 4))
  with pytest.raises(ValueError, match="multiple of KV"):
    attention.attention(q, q[:, :, :2], q[:, :, :2], None, scale=1.0)
  if not aot_tpu.has_libtpu():
    pytest.skip("needs libtpu for a TPU mesh")
  _, devices = aot_tpu.topology_devices("v5e-8")
  picked = []
  jax.jit(jax.shard_map(lambda x: picked.append(
      dispatch.resolve_impl("attention", "auto")) or x,
                        mesh=Mesh(np.array(devices), ("data",)), in_specs=P("data"),
                        out_specs=P("data"))).lower(jax.ShapeDtypeStruct((8,), jnp.float32))
  assert picked == ["pallas"]


def test_the_backward_is_fused_where_a_rows_dq_fits_vmem():
  """`BlockSizes.backward_plan`: one kernel where the tiles and the row's dq of each
  query head of a group (its float32 accumulator and double-buffered output block,
  counted by hand here) fit the chip's VMEM, the kernel's limit raised past the default
  scoped VMEM only as far as it needs; the split kernels where they do not fit, or when
  asked."""
  bf16, v5e, bs = jnp.bfloat16, tpu.get_chip("v5e"), attention.BlockSizes(512, 512)
  row = 8192 * 128 * 4 + 2 * 8192 * 128 * 2  # 8 MiB per query head of the group
  assert bs.fused_backward_bytes(128, bf16, 8192) == bs.vmem_bytes(128, bf16) + row
  need = bs.vmem_bytes(128, bf16) + 4 * row
  assert bs.fused_backward_bytes(128, bf16, 8192, groups=4) == need
  fused, limit = bs.backward_plan(128, bf16, 8192, v5e, groups=4)
  assert fused and v5e.scoped_vmem_bytes < limit < v5e.vmem_bytes
  assert need <= limit * tpu.VMEM_HEADROOM <= need + (1 << 20)
  assert bs.backward_plan(128, bf16, 8192, v5e, groups=16) == (False, None)  # 128 MiB
  assert bs.backward_plan(64, bf16, 1024, v5e) == (True, None)     # the default suffices
  assert bs.backward_plan(128, jnp.float32, 131072, v5e) == (False, None)  # 192 MiB of dq
  assert bs.backward_plan(128, bf16, 8192, None) == (False, None)  # chip unknown: 16 MiB
  split = attention.BlockSizes(512, 512, fused_backward=False)
  assert split.backward_plan(64, bf16, 1024, v5e) == (False, None)
  with pytest.raises(ValueError, match="fused backward of 131072-token rows"):
    attention.BlockSizes(512, 512, fused_backward=True).backward_plan(128, bf16, 131072, v5e)


def test_get_default_takes_a_generations_measured_tiles(tmp_path, monkeypatch):
  """A table in `tuned/` decides `get_default` for its generation at the nearest
  measured row length (capped at the row); another generation, or no chip, keeps the
  largest tiles that fit."""
  (tmp_path / "v5e.json").write_text(json.dumps({"entries": [
      dict(head_dim=64, dtype="bfloat16", seq_len=1280, block_q=256, block_k=128),
      dict(head_dim=64, dtype="bfloat16", seq_len=8192, block_q=512, block_k=256),
      dict(head_dim=128, dtype="bfloat16", seq_len=2048, block_q=128, block_k=128),
      dict(head_dim=128, dtype="bfloat16", seq_len=8192, block_q=1024, block_k=1024)]}))
  monkeypatch.setattr(attention_blocks, "TUNED_DIR", str(tmp_path))
  tuned.load.cache_clear()
  try:
    get = attention.BlockSizes.get_default
    assert get(64, jnp.bfloat16, "v5e", seq_len=1000) == attention.BlockSizes(256, 128)
    assert get(64, jnp.bfloat16, "v5e", seq_len=6000) == attention.BlockSizes(512, 256)
    assert get(64, jnp.bfloat16, "v5e") == attention.BlockSizes(512, 256)  # the longest
    assert get(64, jnp.bfloat16, "v5e", seq_len=700) == attention.BlockSizes(256, 128)
    # More than 2x from every measured length: the largest tiles that fit, capped.
    assert get(64, jnp.bfloat16, "v5e", seq_len=300) == attention.BlockSizes(384, 384)
    # Measured tiles past the default scoped VMEM (16 MiB on v5e): the limit raised as
    # far as they, and the fused backward of 8,192-token rows, need (hand-sized: 24 MiB of
    # float32 score temporaries, a row's dq of 4 MiB in float32 and 2 x 2 MiB in bf16).
    big = get(128, jnp.bfloat16, "v5e", seq_len=8192)
    assert (big.block_q, big.block_k) == (1024, 1024) and big.vmem_limit_bytes
    need = big.fused_backward_bytes(128, jnp.bfloat16, 8192)
    assert 32 << 20 < need <= big.vmem_limit_bytes * tpu.VMEM_HEADROOM
    assert big.vmem_limit_bytes <= need / tpu.VMEM_HEADROOM + (1 << 20)
    assert big.backward_plan(128, jnp.bfloat16, 8192, tpu.get_chip("v5e"))[0]  # fused
    # Rows of unknown length: the whole VMEM, so tiles chosen once keep longer rows fused.
    anywhere = get(128, jnp.bfloat16, "v5e")
    assert (anywhere.block_q, anywhere.block_k) == (1024, 1024)
    assert anywhere.vmem_limit_bytes == tpu.get_chip("v5e").vmem_bytes
    assert anywhere.backward_plan(128, jnp.bfloat16, 32768, tpu.get_chip("v5e"))[0]
    # Equally near two measured lengths: the longer one's, whatever the file's order.
    for entries in ([dict(t=2048), dict(t=8192)], [dict(t=8192), dict(t=2048)]):
      assert tuned.nearest(entries, "t", 4096) == dict(t=8192)
    untuned = attention.BlockSizes(512, 512)  # today's rule: the largest that fits
    assert get(64, jnp.float32, "v5e", seq_len=1280) == untuned  # no float32 entry
    assert get(64, jnp.bfloat16, "v4", seq_len=1280) == untuned
    assert get(64, jnp.bfloat16, seq_len=1280) == untuned
  finally:
    tuned.load.cache_clear()


def test_shipped_tables_fit_their_chips():
  """Every shipped entry is what `get_default` gives at its own row length: valid tiles
  within its generation's VMEM (its scoped limit raised where they need it)."""
  names = (os.listdir(attention_blocks.TUNED_DIR)
           if os.path.isdir(attention_blocks.TUNED_DIR) else [])
  for name in sorted(names):
    chip = tpu.get_chip(name.removesuffix(".json"))
    for e in tuned.load(attention_blocks.TUNED_DIR, chip.name):
      bs = attention.BlockSizes.get_default(e["head_dim"], e["dtype"], chip,
                                            seq_len=e["seq_len"])
      assert (bs.block_q, bs.block_k) == (e["block_q"], e["block_k"]), (name, e)
      limit = bs.vmem_limit_bytes or chip.scoped_vmem_bytes
      assert bs.vmem_bytes(e["head_dim"], e["dtype"]) <= limit * tpu.VMEM_HEADROOM
      assert limit <= chip.vmem_bytes, (name, e)


def _compile_grads(chip, T, K, H=8, KV=2, dtype=jnp.bfloat16, softcap=0.0, window=0,
                   block_sizes=None):
  """The kernels' forward and backward for one row, compiled ahead of time for `chip`."""
  def grads(q, k, v, g, pos, valid, seg, br):
    vis = attention.Visibility(pos, valid, seg, br)
    f = lambda q, k, v: attention.attention(q, k, v, vis, scale=K ** -0.5, softcap=softcap,
                                            window=window, impl="pallas",
                                            block_sizes=block_sizes)
    out, pullback = jax.vjp(f, q, k, v)
    return out, pullback(g)

  S = jax.ShapeDtypeStruct
  rows = [S((1, T), jnp.int32)] * 4
  return aot_tpu.compile_for(chip, grads, S((1, T, H, K), dtype), *[S((1, T, KV, K), dtype)] * 2,
                         S((1, T, H, K), dtype), *rows)


@needs_libtpu
@pytest.mark.slow
def test_kernels_compile_for_tpu_with_memory_linear_in_the_row():
  """A CI subset of the benchmark's grid (every generation, T up to 8192, head dims 64 to
  256): Mosaic compiles forward and backward (fused, and split where asked), and the
  compiled peak grows linearly in T (quadratic scores would grow it 16-fold over 4x the
  length)."""
  split = attention.BlockSizes(256, 256, fused_backward=False)
  for chip, T, K, bs, kernels in (("v4", 1024, 64, None, ("fwd", "bwd")),
                                  ("v5p", 1024, 256, None, ("fwd", "bwd")),
                                  ("v5e", 100, 64, None, ("fwd", "bwd")),  # one short tile
                                  ("v6e", 1000, 128, split, ("fwd", "dq", "dkv"))):
    text = _compile_grads(chip, T, K, softcap=30.0, window=256, block_sizes=bs).as_text()
    assert all(f"attention_{k}" in text for k in kernels), chip
  peak = {T: aot_tpu.compiled_stats(_compile_grads("v5e", T, 128))["peak"] for T in (2048, 8192)}
  assert peak[8192] <= 4.4 * peak[2048], peak


@needs_libtpu
@pytest.mark.slow
def test_shared_prefix_train_step_for_v5e_runs_the_kernels_without_t_by_t_scores(tmp_path):
  """The plan's step with prefix sharing (the default rows), compiled for a v5e-8: its
  HLO holds the kernels (the backward fused) and no float array with two row-length axes, where the
  XLA attention's step holds its `[T, T]` scores."""
  cfg = runs.config(tmp_path, model="tiny", batch_size=16, max_length=160,
                    max_prompt_length=80)
  _, devices = aot_tpu.topology_devices("v5e-8")
  scores = {}
  for impl in ("auto", "xla"):
    plan = plan_lib.make_plan(dataclasses.replace(cfg, attention_impl=impl), devices)
    assert plan.rows.share and plan.rows.band is None
    T = plan.rows.length
    text = aot.lower(plan, devices)[1].compile().as_text()
    scores[plan.model.attention_impl] = bool(re.search(rf"(f32|bf16)\[[0-9,]*\b{T},{T}\b",
                                                       text))
    if impl == "auto":
      for kernel in ("attention_fwd", "attention_bwd"):
        assert kernel in text, kernel
  assert scores == {"pallas": False, "xla": True}
