"""The LM head on scored positions only (`--head_on_scored`).

DPO scores only response tokens (and their end token): in a row `BOS prompt response PAD`
they are one contiguous span whose length is at most the longest response in the data,
often far less than `max_length`. Since the LM head is most of a small model's FLOPs at
a 32k vocabulary, `window` cuts each row's hidden states down to a static block of
`size` positions that starts at the row's first scored position, the head runs on that
block, and `unwindow` puts the log-probs back at their row positions. Every per-token
log-prob is the one the full row would give (unscored positions stay 0), so losses,
metrics and gradients are unchanged.

`size` is static (part of the compiled step): `block_size` derives it on the host from
the data (`max_span` over every split the run uses), and `check_batch` refuses a batch
whose span would not fit, rather than dropping its tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np

# Block sizes are rounded up to this, so a few extra positions do not recompile anything
# and the head's row tiles stay full.
ROUND = 16


def max_span(loss_mask: np.ndarray) -> int:
  """Longest scored span (first to last scored position, inclusive) of any row of a
  `[..., T]` 0/1 mask; 0 when nothing is scored."""
  mask = np.asarray(loss_mask).reshape(-1, loss_mask.shape[-1]) > 0
  rows = mask.any(-1)
  if not rows.any():
    return 0
  T = mask.shape[-1]
  first = mask.argmax(-1)
  last = T - 1 - mask[:, ::-1].argmax(-1)
  return int((last - first + 1)[rows].max())


def block_size(span: int, max_length: int) -> int:
  """The static block for scored spans of up to `span` positions: rounded up to `ROUND`,
  at most `max_length` (then the block is the whole row and nothing is cut)."""
  return min(max_length, max(ROUND, -(-span // ROUND) * ROUND))


def check_batch(loss_mask: np.ndarray, size: int) -> None:
  """ValueError if a row of the host batch has a scored span longer than `size`."""
  span = max_span(loss_mask)
  if span > size:
    raise ValueError(f"a batch has a scored span of {span} positions but the step was "
                     f"compiled for {size} (--head_on_scored measured the data it was "
                     f"given; pass every split to it, or --head_on_scored=false)")


def window(hidden_RxTxD, targets_RxT, size: int, ignore_index: int):
  """`(hidden [R, S, D], targets [R, S], positions [R, S])`: each row's `S = size`
  positions from its first scored one (moved back to stay inside the row). Positions
  in the block that are not scored keep `ignore_index` targets. Differentiable in
  `hidden` (its gradient is scattered back)."""
  T = targets_RxT.shape[1]
  scored_RxT = targets_RxT != ignore_index
  start_R = jnp.minimum(jnp.argmax(scored_RxT, axis=1), T - size)
  positions_RxS = start_R[:, None] + jnp.arange(size)[None]
  hidden_RxSxD = jnp.take_along_axis(hidden_RxTxD, positions_RxS[..., None], axis=1)
  return hidden_RxSxD, jnp.take_along_axis(targets_RxT, positions_RxS, axis=1), positions_RxS


def unwindow(values_RxS, positions_RxS, T: int):
  """Float32 `[R, T]`: `values_RxS` at their row positions, 0 elsewhere."""
  R = values_RxS.shape[0]
  rows_Rx1 = jnp.arange(R)[:, None]
  return jnp.zeros((R, T), values_RxS.dtype).at[rows_Rx1, positions_RxS].set(
      values_RxS, unique_indices=True)


def scored_logprobs(logprobs_fn, hidden_RxTxD, targets_RxT, size: int | None,
                    ignore_index: int) -> jax.Array:
  """`logprobs_fn(hidden, targets) -> [R, S]` on the scored block of each row (the whole
  row when `size` is None or not smaller than T), as `[R, T]`."""
  T = targets_RxT.shape[1]
  if size is None or size >= T:
    return logprobs_fn(hidden_RxTxD, targets_RxT)
  hidden_RxSxD, targets_RxS, positions_RxS = window(hidden_RxTxD, targets_RxT, size,
                                                    ignore_index)
  return unwindow(logprobs_fn(hidden_RxSxD, targets_RxS), positions_RxS, T)
