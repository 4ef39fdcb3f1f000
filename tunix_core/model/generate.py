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
  set whose probability reaches `top_p`, as `transformers` filters them, but a nucleus
  of more than `NUCLEUS_CANDIDATES` tokens (top-p without top-k) is cut there. Generation stops
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
           cfg: ModelConfig, unroll: bool = False):
  """Runs T new tokens, written to cache slots `[start, start + T)`: returns the final
  hidden states `[B, T, D]` and the updated cache (its buffers written in place).

  `unroll`: the layers as a Python loop (each layer's weights a static slice of the
  stacked params), for the one-id steps of `generate`, whose loop body a layer scan
  made slow (slicing every layer's weights at every id; docs/results/tpu_v5e.md); else
  a scan (the prefill: compiles once per layer shape, not per layer)."""
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

  def layer_fn(carry, xs):
    x_BxTxD, k_cache, v_cache = carry
    layer, setting, i = xs
    layer = quant.cast_floats(layer, compute)
    window = setting["window"]
    visible = base_BxTxS & ((window == 0) | (gap_BxTxS < window))

    def attend(h_BxTxD):
      q, k, v = qkv(h_BxTxD, layer, setting, positions_BxT, cfg)
      at = (i, 0, start, 0, 0)
      k_all = jax.lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), at)
      v_all = jax.lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), at)
      out_NxHK = _attend(q, k_all[i], v_all[i], visible, cfg).reshape(B * T, -1)
      return project(out_NxHK, layer, "wo", cfg).reshape(B, T, -1), (k_all, v_all)

    x_BxTxD, (k_cache, v_cache) = block(x_BxTxD, layer, attend, cfg)
    return (x_BxTxD, k_cache, v_cache), None

  carry = (embed(params, tokens_BxT, cfg), cache.k, cache.v)
  xs = (params["layers"], layer_settings(cfg), jnp.arange(cfg.num_layers))
  if unroll:
    for i in range(cfg.num_layers):
      carry, _ = layer_fn(carry, jax.tree.map(lambda a, i=i: a[i], xs[:2]) + (i,))
  else:
    carry, _ = jax.lax.scan(layer_fn, carry, xs)
  x_BxTxD, k_cache, v_cache = carry
  hidden = rms_norm(x_BxTxD, params["final_norm"], cfg.norm_eps, cfg.norm_offset)
  return hidden, Cache(k_cache, v_cache, cache_mask, cache_pos)


def next_logits(head_DxV, hidden_BxD, cfg: ModelConfig):
  """Float32 `[B, V]` logits of the next token under the LM head `head_DxV` (in the
  compute dtype), final soft-cap applied."""
  return softcap(jnp.dot(hidden_BxD, head_DxV, preferred_element_type=jnp.float32),
                 cfg.final_softcap)


# The nucleus (`top_p`) is drawn from the most likely tokens found by `lax.top_k`, at
# most this many (or `top_k`): no sort of the whole vocabulary at every id.
NUCLEUS_CANDIDATES = 256


def candidates(logits_BxV, s: Sampling) -> tuple[jax.Array, jax.Array]:
  """`(logits [B, C], ids [B, C])`: the tokens `s` may draw (temperature > 0) and their
  tempered logits, `-inf` where top-p drops one. top-k and top-p read the
  `C = min(top_k or NUCLEUS_CANDIDATES, V)` most likely tokens (`lax.top_k`, no sort of
  the vocabulary): exact, but a nucleus that would hold more than `NUCLEUS_CANDIDATES`
  tokens is cut there. Without either, every token (C = V)."""
  logits = logits_BxV / s.temperature
  if not s.top_k and s.top_p >= 1:
    return logits, jnp.broadcast_to(jnp.arange(logits.shape[-1]), logits.shape)
  top_BxC, ids_BxC = jax.lax.top_k(logits, min(s.top_k or NUCLEUS_CANDIDATES,
                                               logits.shape[-1]))  # descending
  if s.top_p < 1:
    # Probabilities as `transformers` filters them: after top-k when it is set (the
    # softmax over the k kept), else over the whole vocabulary.
    norm_Bx1 = jax.nn.logsumexp(top_BxC if s.top_k else logits, axis=-1, keepdims=True)
    probs_BxC = jnp.exp(top_BxC - norm_Bx1)
    # Keep the tokens whose preceding mass is below top_p (the most likely always stays).
    keep_BxC = (jnp.cumsum(probs_BxC, axis=-1) - probs_BxC) < s.top_p
    top_BxC = jnp.where(keep_BxC, top_BxC, -jnp.inf)
  return top_BxC, ids_BxC


def sample(logits_BxV, key, s: Sampling):
  """One token id per row, `[B]` int32, as `Sampling` says (`candidates`)."""
  if s.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxC, ids_BxC = candidates(logits_BxV, s)
  choice_B = jax.random.categorical(key, logits_BxC, axis=-1)
  return jnp.take_along_axis(ids_BxC, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32)


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
  head_DxV = lm_head(params, cfg).astype(DTYPES[cfg.compute_dtype])  # once, not per id
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
                           cache, P + i, cfg, unroll=True)
    return i + 1, next_logits(head_DxV, hidden[:, 0], cfg), cache, key, tokens, lengths, done, pos

  def cond(carry):
    i, done = carry[0], carry[6]
    return (i < N) & ~jnp.all(done)

  init = (jnp.int32(0), next_logits(head_DxV, hidden[:, -1], cfg), cache, key,
          jnp.zeros((B, N), jnp.int32), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool),
          positions[:, -1])
  out = jax.lax.while_loop(cond, body, init)
  return out[4], out[5]
