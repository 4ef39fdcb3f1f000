"""The DPO objective of a model on a pair batch.

A pair batch is a dict of int32 arrays `[B, 2, T]`: axis 1 is (chosen, rejected), both
rows of a pair sharing its prompt. This is the one layout from the dataset to the loss;
`sequence_logps` is the one place it is reshaped to the model's `[2B, T]` rows, or, with
prefix sharing or packing, where the packed rows `packing.pack` added to the batch are
run and their log-probs put back into it.
"""

import jax
import jax.numpy as jnp

import kernels
from tunix_core import model as model_lib
from tunix_core import packing
from tunix_core import scored
from tunix_core import tensor_parallel


def sequence_logps(params, batch: dict, mcfg: model_lib.ModelConfig, impl: str,
                   fsdp=None, model_axis: str | None = None,
                   scored_size: int | None = None,
                   packed: packing.Spec | None = None) -> jax.Array:
  """Float32 per-token log-probs `[B, 2, T]` of `batch["targets"]` (0 where unscored).

  Differentiable in `params`; the `[.., V]` logits are never built (`fused_logprobs`).
  With `fsdp` (a `tunix_core.fsdp.Layout`, inside `shard_map`) `params` are a device's
  local pieces, gathered as they are used; their gradient is the device-mean gradient.
  With `model_axis` (inside `shard_map`) `params` are a device's tensor-parallel slices
  (`tunix_core.tensor_parallel`; under FSDP, the pieces of its slices) and the LM head is
  vocabulary-parallel; the log-probs are the same on every device of the axis.
  With `scored_size` the LM head runs on each row's block of that many positions from its
  first scored one (`tunix_core.scored`; every row's scored span must fit in it).
  With `packed` (a `packing.Spec`) the model runs on the batch's packed rows instead
  (prefix sharing, packing; `tunix_core.packing`) and the head on its scored slots.
  """
  gather_layer = None
  if fsdp is not None:
    params = dict(fsdp.gather_rest(params), layers=params["layers"])
    gather_layer = fsdp.gather_layer

  def forward(tokens_RxT, mask_RxT, **rows):
    if model_axis is None:
      return model_lib.forward(params, tokens_RxT, mask_RxT, mcfg, gather_layer, **rows)
    return tensor_parallel.forward(params, tokens_RxT, mask_RxT, mcfg, model_axis,
                                   gather_layer, **rows)

  def head(hidden, targets):
    return kernels.fused_logprobs(
        hidden, model_lib.lm_head(params, mcfg).astype(hidden.dtype), targets, impl=impl,
        ignore_index=kernels.IGNORE_INDEX, logit_softcap=mcfg.final_softcap or None,
        vocab_axis=model_axis)

  B, two, T = batch["loss_mask"].shape
  if packed is not None:
    return _packed_logps(forward, head, batch, packed, T)
  # Model rows are all chosen rows, then all rejected rows.
  rows = lambda x_Bx2xT: x_Bx2xT.swapaxes(0, 1).reshape(two * B, T)
  hidden_RxTxD = forward(rows(batch["tokens"]), rows(batch["attention_mask"]))
  logps_RxT = scored.scored_logprobs(head, hidden_RxTxD, rows(batch["targets"]), scored_size,
                                     kernels.IGNORE_INDEX)
  return logps_RxT.reshape(two, B, T).swapaxes(0, 1)


def _packed_logps(forward, head, batch: dict, spec: packing.Spec, T: int) -> jax.Array:
  """`sequence_logps` on packed rows: `[B, 2, T]` from the batch's `n` groups."""
  segments_RxL = batch["row_segments"]
  hidden_RxLxD = forward(batch["row_tokens"], (segments_RxL > 0).astype(jnp.int32),
                         positions_BxT=batch["row_positions"], segments_BxT=segments_RxL,
                         branches_BxT=batch["row_branches"] if spec.share else None,
                         band=spec.band)
  n = hidden_RxLxD.shape[0] // spec.rows
  hidden_NxGLxD = hidden_RxLxD.reshape(n, spec.rows * spec.length, -1)
  per_group = lambda x: x.reshape(n, spec.head)
  hidden_NxSxD = jnp.take_along_axis(hidden_NxGLxD, per_group(batch["head_src"])[..., None],
                                     axis=1)
  logps_NxS = head(hidden_NxSxD, per_group(batch["head_targets"]))
  B = batch["loss_mask"].shape[0]
  # Unused slots write past the end: dropped.
  logps_NxP2T = jnp.zeros((n, B // n * 2 * T), logps_NxS.dtype).at[
      jnp.arange(n)[:, None], per_group(batch["head_dst"])].set(logps_NxS, mode="drop")
  return logps_NxP2T.reshape(B, 2, T)


def dpo_objective(params, ref_logps_Bx2xT, batch: dict, cfg, mcfg: model_lib.ModelConfig,
                  fsdp=None, model_axis: str | None = None, scored_size: int | None = None,
                  packed: packing.Spec | None = None):
  """`(loss, metrics)` of `kernels.dpo_loss` for `params` on a `[B, 2, T]` pair batch.

  `ref_logps_Bx2xT` are the frozen reference's per-token log-probs (None with
  `cfg.reference_free`); `cfg` is a `TrainConfig` (beta, loss type, impls); `fsdp`,
  `model_axis`, `scored_size` and `packed` as in `sequence_logps`. Differentiable in
  `params`.
  """
  logps_Bx2xT = sequence_logps(params, batch, mcfg, cfg.logprob_impl, fsdp, model_axis,
                               scored_size, packed)
  mask_Bx2xT = batch["loss_mask"]
  ref = (None, None) if ref_logps_Bx2xT is None else (ref_logps_Bx2xT[:, 0],
                                                      ref_logps_Bx2xT[:, 1])
  return kernels.dpo_loss(
      logps_Bx2xT[:, 0], logps_Bx2xT[:, 1], *ref,
      chosen_mask=mask_Bx2xT[:, 0], rejected_mask=mask_Bx2xT[:, 1], beta=cfg.beta,
      loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing,
      reference_free=cfg.reference_free, impl=cfg.loss_impl)
