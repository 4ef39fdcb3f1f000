"""Sampling from the decoder with a KV cache, for every model family `decoder` runs.

Prompts are left-padded to one length P, so every row writes its next token to the same
cache slot; rope positions count each row's real tokens (`decoder.default_positions`), so
padding changes nothing. The cache keeps each layer's keys and values `[L, B, S, KV, K]`
for S = P + max_new_tokens slots, the slots' 0/1 mask and their positions. A query at
slot i sees the written slots j <= i that are real and, in a sliding-window layer, within
the window of positions, with the decoder's soft-cap and scale: the same visibility as
training's attention. `generate` is one jitted function (a `while_loop` of one-token steps
after one prefill); it is not differentiable.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tunix_core.model.config import DTYPES
from tunix_core.model.config import ModelConfig
# Names, not the module: the package exports the function `decoder` under the module's name.
from tunix_core.model.decoder import attention_scale
from tunix_core.model.decoder import block
from tunix_core.model.decoder import default_positions
from tunix_core.model.decoder import embed
from tunix_core.model import quant
from tunix_core.model.rope import layer_settings
from tunix_core.model.decoder import lm_head
from tunix_core.model.decoder import project
from tunix_core.model.decoder import qkv
from tunix_core.model.decoder import rms_norm
from tunix_core.model.decoder import softcap


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is picked: greedy (`temperature == 0`), or from the softmax at
  `temperature` restricted to the `top_k` most likely tokens (0: all) and to the smallest
  set whose probability reaches `top_p`, as `transformers` filters them. Generation stops
  after `max_new_tokens` or when every row has produced one of `eos_ids`."""
  max_new_tokens: int = 32
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  eos_ids: tuple = ()

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
    if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
      raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got "
                       f"{self.temperature}, {self.top_k}, {self.top_p}")


class Cache(NamedTuple):
  k: jax.Array          # [L, B, S, KV, K] compute dtype
  v: jax.Array          # [L, B, S, KV, K]
  mask: jax.Array       # [B, S] int32: 1 where a real token was written
  positions: jax.Array  # [B, S] int32 rope positions of the written slots


def init_cache(cfg: ModelConfig, batch: int, slots: int) -> Cache:
  shape = (cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim)
  zeros = jnp.zeros(shape, DTYPES[cfg.compute_dtype])
  empty = jnp.zeros((batch, slots), jnp.int32)
  return Cache(zeros, zeros, empty, empty)


def _attend(q_BxTxHxK, k_BxSxVxK, v_BxSxVxK, visible_BxTxS, cfg: ModelConfig):
  """Grouped-query attention of T queries over the cache's S slots, in float32."""
  B, T, H, K = q_BxTxHxK.shape
  KV = k_BxSxVxK.shape[2]
  q = q_BxTxHxK.reshape(B, T, KV, H // KV, K).astype(jnp.float32)
  s = jnp.einsum("btvgk,bsvk->bvgts", q, k_BxSxVxK.astype(jnp.float32))
  s = softcap(s * attention_scale(cfg), cfg.attn_softcap)
  s = jnp.where(visible_BxTxS[:, None, None], s, -1e30)
  p = jax.nn.softmax(s, axis=-1)
  out = jnp.einsum("bvgts,bsvk->btvgk", p, v_BxSxVxK.astype(jnp.float32))
  return out.reshape(B, T, H, K).astype(q_BxTxHxK.dtype)


def extend(params, tokens_BxT, mask_BxT, positions_BxT, cache: Cache, start,
           cfg: ModelConfig):
  """Runs T new tokens, written to cache slots `[start, start + T)`: returns the final
  hidden states `[B, T, D]` and the updated cache."""
  B, T = tokens_BxT.shape
  S = cache.mask.shape[1]
  put = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype),
                                                             start, axis=1)
  cache_mask, cache_pos = put(cache.mask, mask_BxT), put(cache.positions, positions_BxT)
  slot_S, query_slot_T = jnp.arange(S), start + jnp.arange(T)
  causal_TxS = slot_S[None, :] <= query_slot_T[:, None]
  base_BxTxS = causal_TxS[None] & (cache_mask[:, None, :] > 0)
  gap_BxTxS = positions_BxT[:, :, None] - cache_pos[:, None, :]
  compute = DTYPES[cfg.compute_dtype]

  def layer_fn(x_BxTxD, xs):
    layer, setting, k_BxSxVxK, v_BxSxVxK = xs
    layer = quant.cast_floats(layer, compute)
    window = setting["window"]
    visible = base_BxTxS & ((window == 0) | (gap_BxTxS < window))

    def attend(h_BxTxD):
      q, k, v = qkv(h_BxTxD, layer, setting, positions_BxT, cfg)
      k_all, v_all = put(k_BxSxVxK, k), put(v_BxSxVxK, v)
      out_NxHK = _attend(q, k_all, v_all, visible, cfg).reshape(B * T, -1)
      return project(out_NxHK, layer, "wo", cfg).reshape(B, T, -1), (k_all, v_all)

    return block(x_BxTxD, layer, attend, cfg)

  x_BxTxD = embed(params, tokens_BxT, cfg)
  x_BxTxD, (k, v) = jax.lax.scan(
      layer_fn, x_BxTxD, (params["layers"], layer_settings(cfg), cache.k, cache.v))
  hidden = rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps, cfg.norm_offset)
  return hidden, Cache(k, v, cache_mask, cache_pos)


def next_logits(params, hidden_BxD, cfg: ModelConfig):
  """Float32 `[B, V]` logits of the next token, final soft-cap applied."""
  head_DxV = lm_head(params, cfg).astype(hidden_BxD.dtype)
  return softcap(jnp.dot(hidden_BxD, head_DxV, preferred_element_type=jnp.float32),
                         cfg.final_softcap)


def sample(logits_BxV, key, s: Sampling):
  """One token id per row, `[B]` int32, as `Sampling` says."""
  if s.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits = logits_BxV / s.temperature
  if s.top_k:
    kth_Bx1 = jax.lax.top_k(logits, min(s.top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth_Bx1, -jnp.inf, logits)
  if s.top_p < 1:
    desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    # Keep the tokens whose preceding mass is below top_p (the most likely always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p
    floor_Bx1 = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < floor_Bx1, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"))
def generate(params, prompt_BxP, prompt_mask_BxP, key, *, cfg: ModelConfig,
             sampling: Sampling):
  """Completions of left-padded prompts.

  Args:
    params: the model's params pytree (any placement; not differentiated).
    prompt_BxP: int32 prompt ids, left-padded; prompt_mask_BxP: 1 on real tokens.
    key: a PRNG key (unused when greedy); the same key gives the same samples.
  Returns:
    `(tokens_BxN, lengths_B)`: N = `max_new_tokens` int32 ids per row, valid up to
    `lengths` (which counts an EOS that ended the row; the rest is 0).
  """
  B, P = prompt_BxP.shape
  N = sampling.max_new_tokens
  mask = prompt_mask_BxP.astype(jnp.int32)
  positions = default_positions(mask)
  hidden, cache = extend(params, prompt_BxP, mask, positions, init_cache(cfg, B, P + N),
                         0, cfg)
  eos = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)

  def body(carry):
    i, logits, cache, key, tokens, lengths, done, pos = carry
    key, sub = jax.random.split(key)
    token = sample(logits, sub, sampling)
    tokens = tokens.at[:, i].set(jnp.where(done, 0, token))
    lengths = lengths + (~done).astype(jnp.int32)
    done = done | jnp.isin(token, eos)
    pos = pos + 1
    hidden, cache = extend(params, token[:, None], jnp.ones((B, 1), jnp.int32), pos[:, None],
                           cache, P + i, cfg)
    return i + 1, next_logits(params, hidden[:, 0], cfg), cache, key, tokens, lengths, done, pos

  def cond(carry):
    i, done = carry[0], carry[6]
    return (i < N) & ~jnp.all(done)

  init = (jnp.int32(0), next_logits(params, hidden[:, -1], cfg), cache, key,
          jnp.zeros((B, N), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool),
          positions[:, -1])
  out = jax.lax.while_loop(cond, body, init)
  return out[4], out[5]
