"""Model tests: shapes, a float64 NumPy forward, causality, padding, remat and dtypes."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_core import model

CFG = model.ModelConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=8, mlp_dim=48)


# One compile per shape and config instead of XLA compiling each op of an eager forward.
forward = jax.jit(model.forward, static_argnums=3)


def _tokens(key, B=2, T=10, V=50):
  return jax.random.randint(key, (B, T), 0, V)


def numpy_forward(params, tokens, cfg):
  """Float64 NumPy forward of one unpadded batch: the independent oracle."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  B, T = tokens.shape
  H, KV, K = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def norm(x, s):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.norm_eps) * s

  def rope(x):  # x [B, T, heads, K]
    half = K // 2
    freqs = cfg.rope_theta ** (-np.arange(half) / half)
    ang = np.arange(T)[:, None] * freqs[None]  # [T, half]
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

  x = p["embed"][tokens]
  for l in range(cfg.num_layers):
    w = {k: v[l] for k, v in p["layers"].items()}
    h = norm(x, w["attn_norm"])
    q = rope((h @ w["wq"]).reshape(B, T, H, K))
    k = rope((h @ w["wk"]).reshape(B, T, KV, K))
    v = (h @ w["wv"]).reshape(B, T, KV, K)
    out = np.zeros((B, T, H, K))
    for head in range(H):
      kv = head // (H // KV)
      s = np.einsum("btk,bsk->bts", q[:, :, head], k[:, :, kv]) / np.sqrt(K)
      s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
      a = np.exp(s - s.max(-1, keepdims=True))
      a /= a.sum(-1, keepdims=True)
      out[:, :, head] = np.einsum("bts,bsk->btk", a, v[:, :, kv])
    x = x + out.reshape(B, T, H * K) @ w["wo"]
    h = norm(x, w["mlp_norm"])
    g = h @ w["w_gate"]
    x = x + (g / (1 + np.exp(-g)) * (h @ w["w_up"])) @ w["w_down"]
  return norm(x, p["final_norm"])


@pytest.mark.parametrize("tie", [False, True])
def test_shapes_and_specs(tie):
  cfg = dataclasses.replace(CFG, tie_embeddings=tie)
  params = model.init_params(jax.random.PRNGKey(0), cfg)
  hidden = forward(params, _tokens(jax.random.PRNGKey(1)), None, cfg)
  chex.assert_shape(hidden, (2, 10, cfg.d_model))
  assert model.lm_head(params, cfg).shape == (cfg.d_model, cfg.vocab_size)
  assert ("lm_head" in params) == (not tie)
  specs = model.param_specs(cfg, model_axis="model")
  assert jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)) \
      == jax.tree.structure(params)
  for spec, leaf in zip(jax.tree.leaves(specs, is_leaf=lambda s: isinstance(
      s, jax.sharding.PartitionSpec)), jax.tree.leaves(params)):
    assert len(spec) == leaf.ndim


def test_matches_float64_numpy():
  params = model.init_params(jax.random.PRNGKey(0), CFG)
  tokens = _tokens(jax.random.PRNGKey(1))
  got = forward(params, tokens, None, CFG)
  want = numpy_forward(params, np.asarray(tokens), CFG)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_causal():
  params = model.init_params(jax.random.PRNGKey(0), CFG)
  tokens = _tokens(jax.random.PRNGKey(1))
  changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % CFG.vocab_size)
  a = forward(params, tokens, None, CFG)
  b = forward(params, changed, None, CFG)
  np.testing.assert_array_equal(np.asarray(a[:, :6]), np.asarray(b[:, :6]))
  assert np.abs(np.asarray(a[:, 6:] - b[:, 6:])).max() > 1e-3


@pytest.mark.parametrize("side", [pytest.param("left", marks=pytest.mark.slow), "right"])
def test_padding_leaves_real_positions_unchanged(side):
  params = model.init_params(jax.random.PRNGKey(0), CFG)
  tokens = _tokens(jax.random.PRNGKey(1), B=1, T=7)
  pad = jnp.full((1, 5), 3, jnp.int32)  # any id: padding must not matter
  if side == "left":
    padded = jnp.concatenate([pad, tokens], 1)
    mask = jnp.concatenate([jnp.zeros((1, 5), jnp.int32), jnp.ones((1, 7), jnp.int32)], 1)
    real = slice(5, 12)
  else:
    padded = jnp.concatenate([tokens, pad], 1)
    mask = jnp.concatenate([jnp.ones((1, 7), jnp.int32), jnp.zeros((1, 5), jnp.int32)], 1)
    real = slice(0, 7)
  want = forward(params, tokens, None, CFG)
  got = forward(params, padded, mask, CFG)
  np.testing.assert_allclose(np.asarray(got[:, real]), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()


# "full" stays in the fast tier; the other policies differ only in what they save. Through
# the Pallas kernels (interpret mode) `dots` and `attention` keep the kernels' q, k and v
# (`attention.INPUTS`) instead of recomputing the rope and layouts that lead to them.
@pytest.mark.parametrize("remat,impl", [
    ("full", "auto"), pytest.param("dots", "auto", marks=pytest.mark.slow),
    pytest.param("dots_no_batch", "auto", marks=pytest.mark.slow),
    pytest.param("attention", "auto", marks=pytest.mark.slow),
    pytest.param("dots", "interpret", marks=pytest.mark.slow),
    pytest.param("attention", "interpret", marks=pytest.mark.slow)])
def test_remat_same_gradients(remat, impl):
  cfg = dataclasses.replace(CFG, attention_impl=impl)
  params = model.init_params(jax.random.PRNGKey(0), cfg)
  tokens = _tokens(jax.random.PRNGKey(1))

  def loss(p, cfg):
    return jnp.sum(model.forward(p, tokens, None, cfg) ** 2)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  want = grad(params, cfg)
  got = grad(params, dataclasses.replace(cfg, remat=remat))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_compute_close_to_f32():
  params = model.init_params(jax.random.PRNGKey(0), CFG)
  tokens = _tokens(jax.random.PRNGKey(1))
  f32 = forward(params, tokens, None, CFG)
  bf16 = forward(params, tokens, None, dataclasses.replace(CFG, compute_dtype="bfloat16"))
  assert bf16.dtype == jnp.bfloat16 and params["embed"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(bf16, np.float32), np.asarray(f32), atol=0.15)


def test_presets_and_bad_configs():
  assert model.preset("1b").num_kv_heads < model.preset("1b").num_heads
  shapes = jax.eval_shape(lambda k: model.init_params(k, model.preset("125m")),
                          jax.random.PRNGKey(0))
  n = sum(np.prod(s.shape) for s in jax.tree.leaves(shapes))
  assert 100e6 < n < 150e6
  with pytest.raises(ValueError, match="unknown model preset"):
    model.preset("7x")
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    model.ModelConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="remat"):
    model.ModelConfig(remat="some")
