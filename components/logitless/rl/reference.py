"""The reference policy of the KL term: a frozen copy (full fine-tuning) or the policy itself with
its LoRA adapters disabled (no second copy of the weights)."""

import copy
from typing import Optional

import torch
from torch import nn



class ReferencePolicy:
    """Computes reference log-probs for a batch.

    Use :meth:`frozen_copy` for a fully fine-tuned policy and :meth:`adapters_disabled` for LoRA.

    Args:
        model (nn.Module): the module whose forward gives the reference outputs.
        disable_adapters (bool): run ``model`` inside ``torchtune.modules.peft.disable_adapter``.

    Example:
        >>> ref = ReferencePolicy.frozen_copy(policy)
        >>> ref_logp = ref.log_probs(loss_fn, batch)
    """

    def __init__(self, model: nn.Module, disable_adapters: bool = False):
        self.model, self.disable_adapters = model, disable_adapters

    @classmethod
    def frozen_copy(cls, policy: nn.Module) -> "ReferencePolicy":
        """A deep copy of ``policy`` in eval mode with ``requires_grad=False`` everywhere."""
        ref = copy.deepcopy(policy)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return cls(ref)

    @classmethod
    def adapters_disabled(cls, policy: nn.Module) -> "ReferencePolicy":
        """The LoRA ``policy`` itself, evaluated with its adapters disabled."""
        return cls(policy, disable_adapters=True)

    @torch.no_grad()
    def log_probs(self, loss_fn, batch) -> torch.Tensor:
        """Reference log-probs at the loss's temperature, ``batch.head_labels``-shaped (0 at padding).

        Args:
            loss_fn: a :class:`logitless.losses.GRPOLoss` (gives temperature and head impl).
            batch: the micro-batch, a :class:`logitless.rl.batch.PolicyBatch` (response-only head,
                ``(B, T)``) or a :class:`logitless.rl.shared_batch.SharedGroupBatch` (prompt once).

        Returns:
            torch.Tensor: fp32 log-probs.
        """
        loss_fn.set_model_output(self.model)
        if self.disable_adapters:
            from torchtune.modules.peft import disable_adapter

            with disable_adapter(self.model):
                return loss_fn.log_probs(batch.forward(self.model), batch.head_labels)
        return loss_fn.log_probs(batch.forward(self.model), batch.head_labels)


def build_reference(policy: nn.Module, beta: float, is_lora: bool) -> Optional[ReferencePolicy]:
    """The reference for ``beta > 0`` (None otherwise: no reference pass at all).

    Args:
        policy (nn.Module): the policy before training.
        beta (float): KL weight.
        is_lora (bool): True when the policy trains LoRA adapters only.

    Returns:
        Optional[ReferencePolicy]: the reference, or None for ``beta == 0``.
    """
    if beta <= 0:
        return None
    return ReferencePolicy.adapters_disabled(policy) if is_lora else ReferencePolicy.frozen_copy(policy)
