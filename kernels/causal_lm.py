"""The ops for any causal LM: next-token log-probs and the DPO loss from a model's last
hidden states and its LM head's weight, never its `[B, T, V]` logits.

A model of any framework (Flax NNX or Linen, Equinox, plain JAX) takes part by exposing
two arrays: `hidden_BxTxD`, the final norm's output (what its head multiplies), and
`head_DxV`, the head's weight (a tied embedding `[V, D]` passes as its `.T`). Both ops
are differentiable in both, as the logits path is, and partition under plain `jit` as
`fused_logprobs` does (docs/embedding.md shows Tunix's DPO trainer served by them).

Layouts follow TRL's and Tunix's DPO batches: `input_ids_BxT` is the whole sequence,
prompt and response, and `mask_BxT` is 1 on the ids to score (the response's); the DPO
batch is `[chosen rows; rejected rows]` along B.
"""

import jax.numpy as jnp

from tunix_kernels.dispatch import IGNORE_INDEX
from tunix_kernels.dpo_loss import dpo_loss
from tunix_kernels.logprobs import fused_logprobs


def next_token_logps(hidden_BxTxD, head_DxV, input_ids_BxT, mask_BxT=None, *, impl="auto",
                     block_sizes=None, logit_softcap=None):
  """`logps[b, t] = log softmax(hidden[b, t] @ head)[input_ids[b, t + 1]]`, where
  `mask[b, t + 1]` is 1, else 0: each next token's log-prob under the model.

  Args:
    hidden_BxTxD: the last hidden states (after the final norm), bf16 or f32;
      differentiable.
    head_DxV: the LM head's weight; differentiable.
    input_ids_BxT: int ids, in `[0, V)` where scored.
    mask_BxT: 0/1, the ids to score (None: every id after the first).
    impl, block_sizes, logit_softcap: `fused_logprobs`'s ("auto": the Pallas TPU
      kernels when compiled for TPUs, else the chunked XLA path).

  Returns:
    float32 `[B, T - 1]`; position `t` scores id `t + 1`.
  """
  targets = input_ids_BxT[:, 1:].astype(jnp.int32)
  if mask_BxT is not None:
    targets = jnp.where(mask_BxT[:, 1:] > 0, targets, IGNORE_INDEX)
  return fused_logprobs(hidden_BxTxD[:, :-1], head_DxV, targets, impl=impl,
                        block_sizes=block_sizes, logit_softcap=logit_softcap)


def dpo_loss_from_hidden(hidden_BxTxD, head_DxV, input_ids_BxT, mask_BxT,
                         ref_logps_BxT=None, *, impl="auto", logit_softcap=None,
                         **loss_kwargs):
  """`dpo_loss` of a concatenated pair batch from the policy's hidden states.

  Args:
    hidden_BxTxD, head_DxV, input_ids_BxT, mask_BxT: `next_token_logps`'s, for B = 2P
      rows: the P chosen rows, then their P rejected rows (`mask` 1 on the responses).
    ref_logps_BxT: the frozen reference's `next_token_logps` of the same batch, float32
      `[B, T - 1]` (not differentiated); None for reference-free loss types.
    impl, logit_softcap: the log-probs' (`next_token_logps`); the loss picks its own.
    **loss_kwargs: `dpo_loss`'s (`beta`, `loss_type`, `label_smoothing`, ...).

  Returns:
    `dpo_loss`'s `(loss, metrics)`: a float32 scalar, differentiable in `hidden` and
    `head`, and TRL's batch-mean metrics.
  """
  logps = next_token_logps(hidden_BxTxD, head_DxV, input_ids_BxT, mask_BxT, impl=impl,
                           logit_softcap=logit_softcap)
  pairs = logps.shape[0] // 2
  mask = mask_BxT[:, 1:]
  ref = (None, None) if ref_logps_BxT is None else (ref_logps_BxT[:pairs],
                                                    ref_logps_BxT[pairs:])
  return dpo_loss(logps[:pairs], logps[pairs:], *ref, chosen_mask=mask[:pairs],
                  rejected_mask=mask[pairs:], **loss_kwargs)
