"""Rotary position embeddings and the other per-layer constants of the decoder's scan.

`rope_frequencies` implements each `ModelConfig.rope_type` (default, linear, Llama 3's
smoothed scaling) and Gemma 3's unscaled local theta; `layer_settings` stacks, per layer,
the sliding window and the frequencies, the arrays that let one `lax.scan` body serve
every layer.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tunix_core.model.config import ModelConfig


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> np.ndarray:
  """Float32 `[head_dim / 2]` rotary frequencies: `cfg.rope_type`'s scaling of
  `rope_theta`, or for a local (sliding) layer with `rope_local_theta` set, that theta
  unscaled."""
  half = cfg.head_dim // 2
  theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
  freqs_K = (theta ** (-np.arange(half, dtype=np.float64) * 2 / cfg.head_dim)
             ).astype(np.float32)
  if local and cfg.rope_local_theta or cfg.rope_type == "default":
    return freqs_K
  if cfg.rope_type == "linear":
    return freqs_K / np.float32(cfg.rope_factor)
  wavelen_K = 2 * np.pi / freqs_K
  low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  orig = cfg.rope_original_max_positions
  smooth_K = (orig / wavelen_K - low) / (high - low)
  blended_K = (1 - smooth_K) * freqs_K / cfg.rope_factor + smooth_K * freqs_K
  return np.where(wavelen_K > orig / low, freqs_K / cfg.rope_factor,
                  np.where(wavelen_K < orig / high, freqs_K, blended_K)).astype(np.float32)


def layer_settings(cfg: ModelConfig) -> dict:
  """What differs between layers, as arrays scanned with the layer params:
  `window` int32 `[L]` (keys each query may see; 0: all) and `freqs` float32
  `[L, head_dim / 2]` (rotary frequencies). Constants, not params."""
  sliding = cfg.sliding_layers()
  return {"window": np.array([cfg.sliding_window if s else 0 for s in sliding], np.int32),
          "freqs": np.stack([rope_frequencies(cfg, local=s) for s in sliding])}


def apply_rope(x_BxTxHxK: jax.Array, positions_BxT: jax.Array, freqs_K: jax.Array
               ) -> jax.Array:
  """Rotary embedding on the last axis, rotating its two halves against each other."""
  angles_BxTxK = positions_BxT[..., None].astype(jnp.float32) * freqs_K
  sin, cos = jnp.sin(angles_BxTxK)[:, :, None, :], jnp.cos(angles_BxTxK)[:, :, None, :]
  x1, x2 = jnp.split(x_BxTxHxK.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxK.dtype)
