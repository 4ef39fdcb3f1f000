"""`tunix_kernels.next_token_logps` and `dpo_loss_from_hidden` on other people's models:
a plain-JAX causal LM and (where flax is installed) a Flax NNX Llama. Their values and
gradients equal the models' own logits path (`log_softmax` of the `[B, T, V]` logits)
within float32 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tunix_kernels

B, T, D, V = 4, 12, 32, 96  # 2 pairs: chosen rows 0-1, rejected rows 2-3


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, V, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.int32)
  for b, (start, stop) in enumerate([(5, 12), (4, 9), (5, 10), (6, 12)]):
    mask[b, start:stop] = 1  # each row's response; the prompt before it
  return jnp.asarray(ids), jnp.asarray(mask)


def _logits_path(logits_BxTxV, ids, mask):
  """The models' own path: every logit, `log_softmax`, the next id's entry, masked."""
  logp = jax.nn.log_softmax(logits_BxTxV[:, :-1].astype(jnp.float32), axis=-1)
  got = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
  return got * mask[:, 1:]


def _plain_params():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  return {"embed": jax.random.normal(k[0], (V, D)), "mix": jax.random.normal(k[1], (D, D)) / 6,
          "head": jax.random.normal(k[2], (D, V)) / 6}


def _plain_hidden(params, ids):
  """A causal toy LM: each position the running mean of the embeddings so far, mixed."""
  x = jnp.cumsum(params["embed"][ids], axis=1) / jnp.arange(1, ids.shape[1] + 1)[:, None]
  h = jnp.tanh(x @ params["mix"])
  return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_plain_jax_model_equals_its_logits_path(impl):
  params, (ids, mask) = _plain_params(), _batch()
  w = jax.random.normal(jax.random.PRNGKey(1), (B, T - 1))  # a cotangent for every entry

  def ours(p):
    return tunix_kernels.next_token_logps(_plain_hidden(p, ids), p["head"], ids, mask,
                                          impl=impl)

  def theirs(p):
    return _logits_path(_plain_hidden(p, ids) @ p["head"], ids, mask)

  np.testing.assert_allclose(ours(params), theirs(params), rtol=1e-5, atol=1e-5)
  g_ours = jax.grad(lambda p: jnp.sum(ours(p) * w))(params)
  g_theirs = jax.grad(lambda p: jnp.sum(theirs(p) * w))(params)
  for k in params:
    np.testing.assert_allclose(g_ours[k], g_theirs[k], rtol=1e-4, atol=1e-5, err_msg=k)

  # The DPO loss of the batch: against `dpo_loss` of the logits path's log-probs, and
  # its gradient in every param.
  ref = theirs(jax.tree.map(lambda x: x * 0.9, params))
  m = mask[:, 1:]

  def loss_ours(p):
    return tunix_kernels.dpo_loss_from_hidden(_plain_hidden(p, ids), p["head"], ids, mask,
                                              ref, impl=impl, beta=0.5)[0]

  def loss_theirs(p):
    lp = theirs(p)
    return tunix_kernels.dpo_loss(lp[:2], lp[2:], ref[:2], ref[2:], chosen_mask=m[:2],
                                  rejected_mask=m[2:], beta=0.5, impl="naive")[0]

  np.testing.assert_allclose(loss_ours(params), loss_theirs(params), rtol=1e-5)
  g_ours, g_theirs = jax.grad(loss_ours)(params), jax.grad(loss_theirs)(params)
  for k in params:
    np.testing.assert_allclose(g_ours[k], g_theirs[k], rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_flax_nnx_llama_equals_its_logits_path():
  nnx = pytest.importorskip("flax.nnx")

  class Block(nnx.Module):
    """Pre-norm causal self-attention and a gated MLP, as Llama's."""

    def __init__(self, rngs):
      self.attn_norm, self.mlp_norm = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=D, decode=False,
                                         use_bias=False, rngs=rngs)
      self.gate, self.up = nnx.Linear(D, 64, use_bias=False, rngs=rngs), nnx.Linear(
          D, 64, use_bias=False, rngs=rngs)
      self.down = nnx.Linear(64, D, use_bias=False, rngs=rngs)

    def __call__(self, x):
      x = x + self.attn(self.attn_norm(x), mask=nnx.make_causal_mask(x[..., 0]))
      h = self.mlp_norm(x)
      return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))

  class Llama(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(V, D, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(2)])
      self.norm = nnx.RMSNorm(D, rngs=rngs)
      self.lm_head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def hidden(self, ids):  # what a model exposes to take part: its last hidden states
      x = self.embed(ids)
      for block in self.blocks:
        x = block(x)
      return self.norm(x)

    def __call__(self, ids):  # the model's own path: every logit
      return self.lm_head(self.hidden(ids))

  model = Llama(nnx.Rngs(0))
  ids, mask = _batch(1)
  w = jax.random.normal(jax.random.PRNGKey(2), (B, T - 1))
  ours = lambda m: tunix_kernels.next_token_logps(m.hidden(ids), m.lm_head.kernel[...], ids,
                                                  mask, impl="xla")
  theirs = lambda m: _logits_path(m(ids), ids, mask)
  np.testing.assert_allclose(ours(model), theirs(model), rtol=1e-5, atol=1e-5)
  g_ours = nnx.grad(lambda m: jnp.sum(ours(m) * w))(model)
  g_theirs = nnx.grad(lambda m: jnp.sum(theirs(m) * w))(model)
  flat_ours, flat_theirs = jax.tree.leaves(g_ours), jax.tree.leaves(g_theirs)
  assert len(flat_ours) == len(flat_theirs) > 10
  for a, b in zip(flat_ours, flat_theirs):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", [False, True])
def test_tunix_dpo_trainer_served_by_the_kernels(attention):
  """benchmarks/tunix_fused.py on Tunix 0.1.7 (where it is installed): a small Tunix
  Llama 3's sequence log-probs through the served `compute_logps` (and attention) equal
  Tunix's own in float32."""
  pytest.importorskip("tunix.sft.dpo.dpo_trainer")
  import os  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", "tunix_fused.py")
  proc = subprocess.run([sys.executable, script, "--model", "tiny", "--tokens", "64"]
                        + (["--attention"] if attention else []), capture_output=True,
                        text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-2000:]
  diff = float(re.search(r"largest difference (\S+)", proc.stdout)[1])
  assert diff <= 1e-4, proc.stdout
