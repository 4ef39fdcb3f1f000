"""Kernels for DPO, one sub-package per op: `logprobs` (fused linear log-probs),
`dpo_loss` (the DPO loss family) and `attention` (attention over the trainer's rows,
`attention.attention`). Each holds its API, its XLA and Pallas TPU implementations,
their tiles and its GSPMD partitioning rule; beside them, what the ops share: the
dispatch (`dispatch`), the chip facts (`tpu`), the GSPMD machinery (`gspmd`), small
helpers (`common`) and the oracles (`naive`).

`fused_logprobs` and `dpo_loss` share one dispatch layer (`tunix_kernels.dispatch`): `impl` is
one of `IMPLS`, and "auto" picks the Pallas TPU kernels when the computation is compiled
for TPUs, else the XLA paths. "naive" is the oracle; "reference" only ever means DPO's
frozen reference model. `IGNORE_INDEX` is the target id of unscored positions.
"""

import importlib
import sys

from tunix_kernels.dispatch import IGNORE_INDEX
from tunix_kernels.dispatch import IMPLS
from tunix_kernels.dpo_loss import LOSS_TYPES
from tunix_kernels.dpo_loss import REFERENCE_FREE_TYPES
from tunix_kernels.dpo_loss import dpo_loss
from tunix_kernels.dpo_loss.pallas import BlockSizes as DPOLossBlockSizes
from tunix_kernels.logprobs import fused_logprobs
from tunix_kernels.logprobs.blocks import BlockSizes as LogprobsBlockSizes

# Both ops take the same implementations; the two names stay for flag enums.
LOGPROB_IMPLS = IMPLS
DPO_LOSS_IMPLS = IMPLS

# The flat module names of earlier releases (`tunix_kernels.logprobs_pallas`, ...) still
# import, as the modules they became, for code that embeds them.
_FORMER_NAMES = {
    "attention_blocks": "attention.blocks", "attention_gspmd": "attention.gspmd",
    "attention_pallas": "attention.pallas", "attention_tiles": "attention.tiles",
    "attention_xla": "attention.xla", "dpo_loss_pallas": "dpo_loss.pallas",
    "dpo_losses": "dpo_loss.losses", "logprobs_blocks": "logprobs.blocks",
    "logprobs_fused_bwd": "logprobs.fused_bwd", "logprobs_gspmd": "logprobs.gspmd",
    "logprobs_pallas": "logprobs.pallas", "logprobs_tile": "logprobs.tile",
    "logprobs_vocab": "logprobs.vocab", "logprobs_xla": "logprobs.xla",
}
for _former, _module in _FORMER_NAMES.items():
  sys.modules[f"{__name__}.{_former}"] = globals()[_former] = importlib.import_module(
      f"{__name__}.{_module}")

__all__ = ["DPOLossBlockSizes", "DPO_LOSS_IMPLS", "IGNORE_INDEX", "IMPLS", "LOGPROB_IMPLS",
           "LOSS_TYPES", "LogprobsBlockSizes", "REFERENCE_FREE_TYPES", "dpo_loss",
           "fused_logprobs"]
