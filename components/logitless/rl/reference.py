"""The reference policy of the KL term: a frozen copy (full fine-tuning) or the policy itself with
its LoRA adapters disabled (no second copy of the weights).

A frozen copy can follow the policy (TR-DPO, ``ref_model_sync_steps`` / ``ref_model_mixup_alpha``):
every N steps :meth:`ReferencePolicy.mix_in` sets ``ref <- alpha * policy + (1 - alpha) * ref`` on
every parameter. A LoRA policy's reference is its own base weights, which never change: there is
nothing of the reference's own to mix, so the recipes refuse the sync under LoRA
(:func:`check_reference_sync`).
"""

import copy
from typing import Any, Iterator, Optional, Tuple

import torch
from torch import nn

# Wrapper segments that activation checkpointing and per-layer compile add to parameter names.
_WRAPPER_NAMES = ("._checkpoint_wrapped_module", "._orig_mod")


def _named_parameters(model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    for name, p in model.named_parameters():
        for w in _WRAPPER_NAMES:
            name = name.replace(w, "")
        yield name, p


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

    @torch.no_grad()
    def mix_in(self, policy: nn.Module, alpha: float) -> None:
        """TR-DPO's reference update ``ref <- alpha * policy + (1 - alpha) * ref``, parameter by
        parameter, in the reference's dtype (on FSDP2 shards alike, each rank on its own shard).

        Args:
            policy (nn.Module): the policy (possibly wrapped for activation checkpointing / compile).
            alpha (float): in ``(0, 1]``; 1 copies the policy.

        Raises:
            ValueError: for the adapters-disabled reference (no weights of its own), an ``alpha``
                outside ``(0, 1]``, or parameters that do not match by name and shape.

        Example:
            >>> ref.mix_in(policy, alpha=0.6)
        """
        if self.disable_adapters:
            raise ValueError("the reference of a LoRA policy is the policy with its adapters disabled: it has no "
                             "weights of its own to mix the policy into")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        ref, pol = dict(_named_parameters(self.model)), dict(_named_parameters(policy))
        if ref.keys() != pol.keys():
            missing = sorted(ref.keys() ^ pol.keys())
            raise ValueError(f"the reference and the policy have different parameters, e.g. {missing[:3]}")
        for name, r in ref.items():
            p = pol[name].detach()
            if p.shape != r.shape:
                raise ValueError(f"parameter {name!r}: policy shape {tuple(p.shape)} != reference {tuple(r.shape)}")
            r.mul_(1.0 - alpha).add_(p.to(r.dtype), alpha=alpha)


def check_reference_sync(cfg: Any) -> None:
    """Checks ``ref_model_sync_steps`` / ``ref_model_mixup_alpha`` of a GRPO config.

    Raises:
        ConfigError: an alpha outside ``(0, 1]``, a sync without a reference (``loss.beta`` 0), or a
            sync of a LoRA policy (its reference is the base weights, not a copy that can move).
    """
    from logitless.training.config import ConfigError

    alpha, steps = cfg.get("ref_model_mixup_alpha", 0.6), cfg.get("ref_model_sync_steps", None)
    if not 0.0 < float(alpha) <= 1.0:
        raise ConfigError(f"config key 'ref_model_mixup_alpha': expected a value in (0, 1] (the policy's share "
                          f"of the synced reference), got {alpha!r}")
    if steps is None:
        return
    beta = float(cfg.loss.get("beta", 0.0))
    if beta <= 0:
        raise ConfigError(f"config key 'ref_model_sync_steps': {steps} syncs the KL reference, but loss.beta={beta} "
                          f"builds no reference; set loss.beta > 0 or ref_model_sync_steps: null")
    if "lora_rank" in cfg.model:
        raise ConfigError(f"config key 'ref_model_sync_steps': {steps} is not supported with a LoRA policy: its "
                          f"reference is the policy with the adapters switched off (the base weights, which never "
                          f"change), so there is no reference copy to mix into; use full fine-tuning or "
                          f"ref_model_sync_steps: null")


def reference_sync_due(step: int, sync_steps: Optional[int]) -> bool:
    """Whether the reference is synced after step ``step`` (1-based): every ``sync_steps`` steps."""
    return sync_steps is not None and step % sync_steps == 0


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


__all__ = ["ReferencePolicy", "build_reference", "check_reference_sync", "reference_sync_due"]
