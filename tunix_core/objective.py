"""The DPO objective of a model on a pair batch.

A pair batch is a dict of int32 arrays `[B, 2, T]`: axis 1 is (chosen, rejected), both
rows of a pair sharing its prompt. This is the one layout from the dataset to the loss;
`sequence_logps` is the one place it is reshaped to the model's `[2B, T]` rows.
"""

import jax

import kernels
from tunix_core import model as model_lib
from tunix_core import scored
from tunix_core import tensor_parallel


def sequence_logps(params, batch: dict, mcfg: model_lib.ModelConfig, impl: str,
                   fsdp=None, model_axis: str | None = None,
                   scored_size: int | None = None) -> jax.Array:
  """Float32 per-token log-probs `[B, 2, T]` of `batch["targets"]` (0 where unscored).

  Differentiable in `params`; the `[.., V]` logits are never built (`fused_logprobs`).
  With `fsdp` (a `tunix_core.fsdp.Layout`, inside `shard_map`) `params` are a device's
  local pieces, gathered as they are used; their gradient is the device-mean gradient.
  With `model_axis` (inside `shard_map`) `params` are a device's tensor-parallel slices
  (`tunix_core.tensor_parallel`; under FSDP, the pieces of its slices) and the LM head is
  vocabulary-parallel; the log-probs are the same on every device of the axis.
  With `scored_size` the LM head runs on each row's block of that many positions from its
  first scored one (`tunix_core.scored`; every row's scored span must fit in it).
  """
  gather_layer = None
  if fsdp is not None:
    params = dict(fsdp.gather_rest(params), layers=params["layers"])
    gather_layer = fsdp.gather_layer
  B, two, T = batch["tokens"].shape
  # Model rows are all chosen rows, then all rejected rows.
  rows = lambda x_Bx2xT: x_Bx2xT.swapaxes(0, 1).reshape(two * B, T)
  tokens_RxT, mask_RxT = rows(batch["tokens"]), rows(batch["attention_mask"])
  if model_axis is None:
    hidden_RxTxD = model_lib.forward(params, tokens_RxT, mask_RxT, mcfg, gather_layer)
  else:
    hidden_RxTxD = tensor_parallel.forward(params, tokens_RxT, mask_RxT, mcfg, model_axis,
                                           gather_layer)
  head_DxV = model_lib.lm_head(params, mcfg).astype(hidden_RxTxD.dtype)
  head = lambda hidden, targets: kernels.fused_logprobs(
      hidden, head_DxV, targets, impl=impl, ignore_index=kernels.IGNORE_INDEX,
      logit_softcap=mcfg.final_softcap or None, vocab_axis=model_axis)
  logps_RxT = scored.scored_logprobs(head, hidden_RxTxD, rows(batch["targets"]), scored_size,
                                     kernels.IGNORE_INDEX)
  return logps_RxT.reshape(two, B, T).swapaxes(0, 1)


def dpo_objective(params, ref_logps_Bx2xT, batch: dict, cfg, mcfg: model_lib.ModelConfig,
                  fsdp=None, model_axis: str | None = None, scored_size: int | None = None):
  """`(loss, metrics)` of `kernels.dpo_loss` for `params` on a `[B, 2, T]` pair batch.

  `ref_logps_Bx2xT` are the frozen reference's per-token log-probs (None with
  `cfg.reference_free`); `cfg` is a `TrainConfig` (beta, loss type, impls); `fsdp`,
  `model_axis` and `scored_size` as in `sequence_logps`. Differentiable in `params`.
  """
  logps_Bx2xT = sequence_logps(params, batch, mcfg, cfg.logprob_impl, fsdp, model_axis,
                               scored_size)
  mask_Bx2xT = batch["loss_mask"]
  ref = (None, None) if ref_logps_Bx2xT is None else (ref_logps_Bx2xT[:, 0],
                                                      ref_logps_Bx2xT[:, 1])
  return kernels.dpo_loss(
      logps_Bx2xT[:, 0], logps_Bx2xT[:, 1], *ref,
      chosen_mask=mask_Bx2xT[:, 0], rejected_mask=mask_Bx2xT[:, 1], beta=cfg.beta,
      loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
      reference_free=cfg.reference_free, impl=cfg.loss_impl)
