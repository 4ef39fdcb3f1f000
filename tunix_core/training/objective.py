"""The DPO objective of a model on a pair batch.

A pair batch is a dict of int32 arrays `[B, 2, T]`: axis 1 is (chosen, rejected), both
rows of a pair sharing its prompt. This is the one layout from the dataset to the loss;
the model runs on the model rows `data.packing.pack` added to the batch (plain, shared
or packed: the step plan's `rows`), the LM head on their scored slots, and the
log-probs come back as `[B, 2, T]` (`packing.unpack`).
"""

import jax
import jax.numpy as jnp

import tunix_kernels
from tunix_kernels.dpo_loss import losses as dpo_losses
from tunix_core import model as model_lib
from tunix_core.data import packing
from tunix_core.parallel import layout as layout_lib


def sequence_logps(params, batch: dict, mcfg: model_lib.ModelConfig, impl: str,
                   rows: packing.Spec, layout: layout_lib.Layout = layout_lib.WHOLE
                   ) -> jax.Array:
  """Float32 per-token log-probs `[B, 2, T]` of `batch["targets"]` (0 where unscored).

  `params` are in `layout`'s step form; inside `shard_map` they are a device's part
  (gathered as they are used under FSDP, tensor-parallel slices with a
  vocabulary-parallel LM head under TP; the log-probs are the same on every device of
  the model axis). `batch` carries the model rows and head slots of `rows`
  (`packing.pack`); the default `layout` is params held whole. Differentiable in
  `params`; the `[.., V]` logits are never built (`tunix_kernels.fused_logprobs`).
  """
  params, gather_layer = layout.gather(params)
  segments_RxL = batch["row_segments"]
  hidden_RxLxD = layout.forward(
      params, gather_layer, batch["row_tokens"], (segments_RxL > 0).astype(jnp.int32), mcfg,
      positions_BxT=batch["row_positions"], segments_BxT=segments_RxL,
      branches_BxT=batch["row_branches"] if rows.share else None, band=rows.band)
  hidden_NxSxD, targets_NxS = packing.head_hidden(hidden_RxLxD, batch, rows)
  with jax.named_scope("lm_head"):
    logps_NxS = tunix_kernels.fused_logprobs(
        hidden_NxSxD, model_lib.lm_head(params, mcfg).astype(hidden_NxSxD.dtype),
        targets_NxS, impl=impl, ignore_index=tunix_kernels.IGNORE_INDEX,
        logit_softcap=mcfg.final_softcap or None, vocab_axis=layout.model_axis)
  return packing.unpack(logps_NxS, batch, rows)


def valid_pairs(mask_Bx2xT) -> jax.Array:
  """Float32 `[B]`: 1 for a pair whose both rows score a token, 0 for padding (online
  DPO's tied prompts, a batch's filler)."""
  return jnp.all(jnp.any(mask_Bx2xT > 0, -1), -1).astype(jnp.float32)


def drift_metrics(logps_Bx2xT, ref_logps_Bx2xT, mask_Bx2xT) -> dict:
  """How far the policy has moved, batch means of per-token averages over each response:
  `kl/chosen`, `kl/rejected` (log pi - log ref on the response's tokens: the KL estimate
  on the data's responses; absent without a reference) and `logps/chosen_per_token`
  (the chosen responses' own log-prob, whose fall is likelihood displacement)."""
  mask = mask_Bx2xT.astype(jnp.float32)
  per_token = lambda x_Bx2xT: (jnp.sum(x_Bx2xT * mask, -1)
                               / jnp.maximum(jnp.sum(mask, -1), 1.0)).mean(0)  # [2]
  out = {"logps/chosen_per_token": per_token(logps_Bx2xT)[0]}
  if ref_logps_Bx2xT is not None:
    kl = per_token(logps_Bx2xT - ref_logps_Bx2xT)
    out.update({"kl/chosen": kl[0], "kl/rejected": kl[1]})
  return jax.lax.stop_gradient(out)


def dpo_objective(params, ref_logps_Bx2xT, batch: dict, loss: dpo_losses.LossSpec,
                  mcfg: model_lib.ModelConfig, rows: packing.Spec,
                  layout: layout_lib.Layout = layout_lib.WHOLE, drift: bool = False, *,
                  logprob_impl: str = "auto", loss_impl: str = "auto"):
  """`(loss, metrics)` of `tunix_kernels.dpo_loss` for `params` on a `[B, 2, T]` pair batch.

  `ref_logps_Bx2xT` are the frozen reference's per-token log-probs (None when the run is
  reference-free: `--reference=none`, or only reference-free loss types); `loss` the
  terms and their parameters; `layout` and `rows` as in `sequence_logps`; the impls those
  of `tunix_kernels.fused_logprobs` and `tunix_kernels.dpo_loss`. The loss and its
  metrics are means over the batch's valid pairs (`valid_pairs`; 0 when there is none).
  Differentiable in `params`. With `drift` (evaluation), the metrics also carry `drift_metrics`.
  """
  logps_Bx2xT = sequence_logps(params, batch, mcfg, logprob_impl, rows, layout)
  mask_Bx2xT = batch["loss_mask"]
  ref = (None, None) if ref_logps_Bx2xT is None else (ref_logps_Bx2xT[:, 0],
                                                      ref_logps_Bx2xT[:, 1])
  with jax.named_scope("loss"):
    value, metrics = tunix_kernels.dpo_loss(
        logps_Bx2xT[:, 0], logps_Bx2xT[:, 1], *ref,
        chosen_mask=mask_Bx2xT[:, 0], rejected_mask=mask_Bx2xT[:, 1],
        reference_free=ref_logps_Bx2xT is None, impl=loss_impl,
        pair_mask=valid_pairs(mask_Bx2xT), **dpo_losses.kwargs(loss))
  if drift:
    metrics = dict(metrics, **drift_metrics(logps_Bx2xT, ref_logps_Bx2xT, mask_Bx2xT))
  return value, metrics
