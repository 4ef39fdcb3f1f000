"""`kernels.attention`: the flash path's glue (head repeat, segment ids, layout) against
the model's XLA attention on padded rows, and which path "auto" picks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from kernels import attention
from kernels import tpu
from oracles import rel_error
from tunix_core import model as model_lib


def _reference_kernel(q, k, v, *, segment_ids, causal, sm_scale):
  """The flash op's contract with materialised scores (JAX's own jnp twin of it), so the
  flash path runs on CPU with everything around the kernel unchanged."""
  from jax.experimental.pallas.ops.tpu import flash_attention  # pylint: disable=g-import-not-at-top
  return flash_attention.mha_reference_no_custom_vjp(q, k, v, None, segment_ids,
                                                     causal=causal, sm_scale=sm_scale)


@pytest.mark.parametrize("kv_heads,dtype,tol", [
    pytest.param(4, jnp.float32, 1e-5, marks=pytest.mark.slow), (2, jnp.float32, 1e-5),
    pytest.param(2, jnp.bfloat16, 2e-2, marks=pytest.mark.slow)])
def test_flash_path_matches_xla_attention_on_real_tokens(monkeypatch, kv_heads, dtype, tol):
  monkeypatch.setattr(attention.jax_flash, "flash_attention", _reference_kernel)
  H, K, T = 4, 16, 128
  cfg = model_lib.ModelConfig(d_model=64, num_heads=H, num_kv_heads=kv_heads, head_dim=K,
                              qk_norm=True, query_pre_attn_scalar=24.0)
  layer = jax.tree.map(lambda x: x[0].astype(dtype),
                       model_lib.init_params(jax.random.PRNGKey(0), cfg)["layers"])
  setting = jax.tree.map(lambda x: x[0], model_lib.layer_settings(cfg))
  mask = np.ones((2, T), np.int32)
  mask[0, :37] = 0   # left padding
  mask[1, 90:] = 0   # right padding
  mask = jnp.asarray(mask)
  positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, T, 64), dtype)
  cot = jax.random.normal(jax.random.PRNGKey(2), (2, T, 64), jnp.float32) * mask[..., None]

  def loss(impl, x, layer):
    c = model_lib.ModelConfig(**{**cfg.__dict__, "attention_impl": impl})
    out = model_lib.attention(x, layer, setting, positions, mask, c)
    return jnp.sum(out.astype(jnp.float32) * cot), out  # real query positions only

  # Jitted: op-by-op dispatch of the interpreted kernel's grid costs seconds on CPU.
  grad = lambda impl: jax.jit(jax.value_and_grad(lambda *a: loss(impl, *a), argnums=(0, 1),
                                                 has_aux=True))
  (_, got), g_got = grad("pallas")(x, layer)
  (_, want), g_want = grad("xla")(x, layer)
  real = np.asarray(mask, bool)
  f32 = lambda a: np.asarray(a, np.float32)
  assert rel_error(f32(got)[real], f32(want)[real]) < tol
  for g, w in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    assert rel_error(f32(g), f32(w)) < tol


def test_auto_picks_flash_only_on_tpu_where_exact():
  assert attention.resolve("auto", 1024, False, 0.0) == "xla"  # CPU here
  with pytest.raises(ValueError, match="multiple of 128"):
    attention.resolve("pallas", 100, False, 0.0)
  with pytest.raises(ValueError, match="unknown attention impl"):
    attention.resolve("flash", 128, False, 0.0)
  if not tpu.has_libtpu():
    pytest.skip("needs libtpu for a TPU mesh")
  _, devices = tpu.topology_devices("v5e-8")
  mesh = Mesh(np.array(devices), ("data",))
  picked = {}

  def body(x):
    picked["long"] = attention.resolve("auto", 1024, False, 0.0)
    picked["window"] = attention.resolve("auto", 1024, True, 0.0)
    picked["capped"] = attention.resolve("auto", 1024, False, 50.0)
    picked["short"] = attention.resolve("auto", 40, False, 0.0)
    return x

  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))).lower(
      jax.ShapeDtypeStruct((8,), jnp.float32))
  assert picked == {"long": "pallas", "window": "xla", "capped": "xla", "short": "xla"}
