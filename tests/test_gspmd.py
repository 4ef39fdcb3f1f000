"""Both Pallas ops under plain `jax.jit` with sharded inputs (`tunix_kernels.gspmd`): on 8 CPU
devices in interpret mode, values and gradients against the same op on unsharded inputs
and the shardings they come back with, for Explicit mesh axes (a derived `shard_map`)
and Auto axes (`custom_partitioning`); with libtpu, both compiled for a v5e-8 by the
real TPU compiler, against the same op inside a `shard_map`; and the embedding example
of docs/embedding.md run as written.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tunix_kernels
import runs
from tunix_kernels import attention as attn
from tunix_kernels import aot_tpu

B, T, D, V = 8, 8, 128, 512          # log-probs: 64 tokens, 256 ids per vocabulary slice
AB, AT, H, KV, K = 4, 256, 4, 2, 128  # attention: two query tiles per row, GQA


def _mesh(devices, axis_type):
  return Mesh(np.array(devices).reshape(4, 2), ("data", "model"), axis_types=(axis_type,) * 2)


def _logprobs_loss(impl):
  def loss(h, w, t):
    logp = tunix_kernels.fused_logprobs(h, w, t, impl=impl, logit_softcap=30.0)
    return (logp * jnp.arange(1.0, T + 1)).sum(), logp
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _attention_loss(impl):
  def loss(q, k, v, vis):
    out = attn.attention(q, k, v, vis, scale=K ** -0.5, window=96, impl=impl)
    return (out * jnp.cos(jnp.arange(K))).sum(), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _logprobs_inputs():
  kh, kw, kt = jax.random.split(jax.random.key(0), 3)
  targets = jax.random.randint(kt, (B, T), 0, V).at[0, :3].set(tunix_kernels.IGNORE_INDEX)
  return (jax.random.normal(kh, (B, T, D)), 0.1 * jax.random.normal(kw, (D, V)), targets)


def _attention_inputs():
  kq, kk, kv = jax.random.split(jax.random.key(1), 3)
  pos = jnp.broadcast_to(jnp.arange(AT, dtype=jnp.int32), (AB, AT))
  vis = attn.Visibility(positions=pos,
                        valid=(pos < jnp.array([AT, AT - 30, AT, 100])[:, None]).astype(jnp.int32),
                        segments=(pos >= 128).astype(jnp.int32))
  return (jax.random.normal(kq, (AB, AT, H, K)), jax.random.normal(kk, (AB, AT, KV, K)),
          jax.random.normal(kv, (AB, AT, KV, K)), vis)


def _close(got, want, rtol=1e-6):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert np.max(np.abs(g - w)) <= rtol * np.max(np.abs(w)), np.max(np.abs(g - w))


def _assert_sharding(x, sharding):
  assert x.sharding.is_equivalent_to(sharding, x.ndim), (x.sharding, sharding)


@pytest.mark.parametrize("axis_type", [pytest.param(AxisType.Explicit, marks=pytest.mark.slow),
                                       AxisType.Auto], ids=str)
def test_both_ops_partition_under_jit_and_keep_the_shardings(axis_type):
  mesh = _mesh(jax.devices()[:8], axis_type)
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))

  h, w, t = _logprobs_inputs()
  step = _logprobs_loss("interpret")
  want = step(h, w, t)
  args = (put(h, "data"), put(w, None, "model"), put(t, "data"))
  got = step(*args)
  _close(got, want)
  (_, logp), (dh, dw) = got
  _assert_sharding(logp, NamedSharding(mesh, P("data")))
  _assert_sharding(dh, args[0].sharding)
  _assert_sharding(dw, args[1].sharding)
  assert "all-gather" not in step.lower(*args).compile().as_text()

  q, k, v, vis = _attention_inputs()
  step = _attention_loss("interpret")
  want = step(q, k, v, vis)
  heads = lambda x: put(x, "data", None, "model")
  args = (heads(q), heads(k), heads(v), jax.tree.map(lambda x: put(x, "data"), vis))
  got = step(*args)
  _close(got, want)
  (_, out), grads = got
  _assert_sharding(out, args[0].sharding)
  for g, a in zip(grads, args):
    _assert_sharding(g, a.sharding)
  assert "all-gather" not in step.lower(*args).compile().as_text()
  # And the kernels themselves against the XLA path (unsharded).
  _close(want, _attention_loss("xla")(q, k, v, vis), rtol=2e-6)


def _stats(compiled):
  text = compiled.as_text()
  return dict(temp=compiled.memory_analysis().temp_size_in_bytes,
              gathers=re.findall(r"all-gather\(", text),
              kernels=text.count("tpu_custom_call"))


@pytest.mark.slow
@pytest.mark.skipif(not aot_tpu.has_libtpu(), reason="needs libtpu (.[tpu] extra)")
def test_compiled_for_a_v5e_8_without_gathers_and_with_shard_map_temporaries():
  _, devices = aot_tpu.topology_devices("v5e-8")
  mesh = _mesh(devices, AxisType.Explicit)
  sds = lambda shape, dtype, *spec: jax.ShapeDtypeStruct(
      shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
  bf16 = jnp.bfloat16
  n, d, vocab = (8, 2048), 2048, 32768
  lp_args = (sds(n + (d,), bf16, "data"), sds((d, vocab), bf16, None, "model"),
             sds(n, jnp.int32, "data"))
  qkv = dict(b=8, t=2048, h=16, kv=8, k=128)
  at_args = (sds((qkv["b"], qkv["t"], qkv["h"], qkv["k"]), bf16, "data", None, "model"),
             sds((qkv["b"], qkv["t"], qkv["kv"], qkv["k"]), bf16, "data", None, "model"),
             sds((qkv["b"], qkv["t"], qkv["kv"], qkv["k"]), bf16, "data", None, "model"),
             sds((qkv["b"], qkv["t"]), jnp.int32, "data"),
             sds((qkv["b"], qkv["t"]), jnp.int32, "data"))
  heads = P("data", None, "model")

  def lp(h, w, t, vocab_axis=None):
    return tunix_kernels.fused_logprobs(h, w, t, impl="pallas", vocab_axis=vocab_axis)

  def at(q, k, v, pos, valid):
    return attn.attention(q, k, v, attn.Visibility(pos, valid), scale=qkv["k"] ** -0.5,
                          impl="pallas")

  cases = {
      "logprobs": (lp, jax.shard_map(lambda *a: lp(*a, vocab_axis="model"), mesh=mesh,
                                     in_specs=(P("data"), P(None, "model"), P("data")),
                                     out_specs=P("data")), lp_args, (0, 1)),
      "attention": (at, jax.shard_map(at, mesh=mesh, in_specs=(heads,) * 3 + (P("data"),) * 2,
                                      out_specs=heads), at_args, (0, 1, 2)),
  }
  for name, (plain, mapped, args, argnums) in cases.items():
    grad = lambda f: jax.value_and_grad(lambda *a: f(*a).astype(jnp.float32).sum(),
                                        argnums=argnums)  # pylint: disable=cell-var-from-loop
    with jax.set_mesh(mesh):
      ours = _stats(jax.jit(grad(plain)).lower(*args).compile())
      theirs = _stats(jax.jit(grad(mapped)).lower(*args).compile())
    print(name, ours, theirs)
    # logprobs and attention: the forward and the fused backward
    assert ours["kernels"] == {"logprobs": 2, "attention": 2}[name], (name, ours)
    assert not ours["gathers"], (name, ours)
    assert ours["temp"] <= 1.1 * theirs["temp"] + (1 << 20), (name, ours, theirs)


@pytest.mark.slow  # the docs' example end to end
def test_the_embedding_example_runs_as_written():
  with open(os.path.join(runs.REPO, "docs", "embedding.md"), encoding="utf-8") as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  scope = {}
  exec(compile("\n".join(blocks), "docs/embedding.md", "exec"), scope)  # pylint: disable=exec-used
  losses = scope["losses"]
  assert len(losses) == 3 and losses[-1] < losses[0], losses
  for leaf, sharding in zip(jax.tree.leaves(scope["params"]),
                            jax.tree.leaves(scope["param_shardings"])):
    _assert_sharding(leaf, sharding)
