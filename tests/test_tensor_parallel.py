"""Tensor parallelism (`tunix_core.parallel.tensor_parallel`) on 2 and 4 devices against one
device: log-probs and every param's gradient, for a Llama-style and a Qwen3/Gemma-style
config, with the vocabulary-parallel embedding and LM head."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import tunix_kernels
from oracles import rel_error
from tunix_core import model as model_lib
from tunix_core.parallel import tensor_parallel as tp

LLAMA = model_lib.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4,
                              num_kv_heads=4, head_dim=8, mlp_dim=48)
GEMMA = dataclasses.replace(LLAMA, num_kv_heads=2, qk_norm=True, qkv_bias=True,
                            tie_embeddings=True, post_norms=True, norm_offset=1.0,
                            embed_scale=True, mlp_activation="gelu_tanh", final_softcap=5.0)


def _inputs(cfg):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
  mask = jnp.asarray(np.r_[[[0] * 3 + [1] * 9], [[1] * 12]], jnp.int32)
  targets = jnp.where(mask > 0, jnp.roll(tokens, -1, axis=1), tunix_kernels.IGNORE_INDEX)
  weight = jnp.asarray(rng.normal(size=(2, 12)), jnp.float32)
  return tokens, mask, targets, weight


def _loss(forward, head_kw, cfg, tokens, mask, targets, weight):
  def loss(params):
    h = forward(params)
    logp = tunix_kernels.fused_logprobs(h, model_lib.lm_head(params, cfg).astype(h.dtype), targets,
                                  impl="xla", logit_softcap=cfg.final_softcap or None,
                                  **head_kw)
    return jnp.sum(logp * weight), logp
  return loss


@pytest.mark.slow  # 20 s each
@pytest.mark.parametrize("cfg", [LLAMA, GEMMA], ids=["llama", "gemma"])
@pytest.mark.parametrize("k", [2, 4])
def test_tensor_parallel_matches_one_device(cfg, k):
  if cfg.num_kv_heads % k:
    cfg = dataclasses.replace(cfg, num_kv_heads=k)
  params = model_lib.init_params(jax.random.PRNGKey(1), cfg)
  params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(2), x.shape),
                        params)  # norms away from 1 so their gradients matter
  tokens, mask, targets, weight = _inputs(cfg)
  one = _loss(lambda p: model_lib.forward(p, tokens, mask, cfg), {}, cfg, tokens, mask,
              targets, weight)
  (_, want_logp), want_grads = jax.value_and_grad(one, has_aux=True)(params)

  def per_device(params):
    fn = _loss(lambda p: tp.forward(p, tokens, mask, cfg, "model"), {"vocab_axis": "model"},
               cfg, tokens, mask, targets, weight)
    (_, logp), grads = jax.value_and_grad(fn, has_aux=True)(params)
    return logp, tp.sync_replicated_grads(grads, "model")

  specs = model_lib.param_specs(cfg, "model")
  mesh = Mesh(np.array(jax.devices()[:k]), ("model",))
  logp, grads = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs,),
                                      out_specs=(P(), specs), check_vma=False))(params)
  assert rel_error(logp, want_logp) < 1e-5
  flat_got = jax.tree_util.tree_leaves_with_path(grads)
  flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
  for path, g in flat_got:
    assert rel_error(g, flat_want[path]) < 1e-5, jax.tree_util.keystr(path)


def test_indivisible_sizes_are_one_line_errors():
  with pytest.raises(ValueError, match="does not divide num_kv_heads=4"):
    tp.local_config(dataclasses.replace(LLAMA, num_heads=8), 8)
  with pytest.raises(ValueError, match="does not divide vocab_size=259"):
    tp.local_config(model_lib.preset("tiny", num_kv_heads=4), 4)
