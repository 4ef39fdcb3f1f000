"""Kernels for DPO, one sub-package per op: `logprobs` (fused linear log-probs),
`dpo_loss` (the DPO loss family) and `attention` (attention over the trainer's rows,
`attention.attention`); `causal_lm` serves any framework's causal LM from its hidden
states and head weight (`next_token_logps`, `dpo_loss_from_hidden`). Each holds its API, its XLA and Pallas TPU implementations,
their tiles and its GSPMD partitioning rule; beside them, what the ops share: the
dispatch (`dispatch`), the chip facts (`tpu`), the GSPMD machinery (`gspmd`), small
helpers (`common`) and the oracles (`naive`).

`fused_logprobs` and `dpo_loss` share one dispatch layer (`tunix_kernels.dispatch`): `impl` is
one of `IMPLS`, and "auto" picks the Pallas TPU kernels when the computation is compiled
for TPUs, else the XLA paths. "naive" is the oracle; "reference" only ever means DPO's
frozen reference model. `IGNORE_INDEX` is the target id of unscored positions.
"""

from tunix_kernels.causal_lm import dpo_loss_from_hidden
from tunix_kernels.causal_lm import next_token_logps
from tunix_kernels.dispatch import IGNORE_INDEX
from tunix_kernels.dispatch import IMPLS
from tunix_kernels.dpo_loss import LOSS_TYPES
from tunix_kernels.dpo_loss import REFERENCE_FREE_TYPES
from tunix_kernels.dpo_loss import dpo_loss
from tunix_kernels.dpo_loss.pallas import BlockSizes as DPOLossBlockSizes
from tunix_kernels.logprobs import fused_logprobs
from tunix_kernels.logprobs.blocks import BlockSizes as LogprobsBlockSizes

__all__ = ["DPOLossBlockSizes", "IGNORE_INDEX", "IMPLS", "LOSS_TYPES", "LogprobsBlockSizes",
           "REFERENCE_FREE_TYPES", "dpo_loss", "dpo_loss_from_hidden", "fused_logprobs",
           "next_token_logps"]
