"""Kernels for DPO: fused linear log-probs and the DPO loss family."""

from kernels.dpo_loss import IMPLS as DPO_LOSS_IMPLS
from kernels.dpo_loss import LOSS_TYPES
from kernels.dpo_loss import dpo_loss
from kernels.logprobs import IMPLS as LOGPROB_IMPLS
from kernels.logprobs import fused_logprobs

__all__ = ["DPO_LOSS_IMPLS", "LOGPROB_IMPLS", "LOSS_TYPES", "dpo_loss", "fused_logprobs"]
