"""Group-relative advantages for GRPO.

Completions come in contiguous groups of ``num_generations`` that share one prompt. The advantage
of a completion is its reward minus its group's mean, optionally divided by a standard deviation
(the group's, the whole batch's, or none). A group whose rewards are all equal carries no signal
and gets exactly zero advantage (never NaN).
"""

import torch

_SCALES = ("group", "batch", "none")


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-normalised advantages.

    ``A_i = (r_i - mean_g(r)) / (std + eps)`` where ``std`` is the unbiased standard deviation of
    the completion's group (``scale="group"``), of the whole batch (``"batch"``), or 1 with no eps
    (``"none"``). Groups whose rewards have zero spread get ``A = 0`` for every member.

    Args:
        rewards (torch.Tensor): ``(N,)`` rewards, ``N = num_prompts * num_generations``, grouped
            contiguously (completions ``g*G .. g*G+G-1`` share prompt ``g``).
        num_generations (int): group size ``G`` (>= 2: a group of one has nothing to compare).
        scale (str): ``"group" | "batch" | "none"``.
        eps (float): added to the standard deviation before dividing.

    Returns:
        torch.Tensor: ``(N,)`` float32 advantages.

    Raises:
        ValueError: on a bad ``num_generations``, ``scale``, shape or non-finite reward.

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
        tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
    """
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(
            f"num_generations must be an int >= 2 (a group needs two completions to compare), "
            f"got {num_generations!r}"
        )
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by num_generations={num_generations}, "
            f"got shape {tuple(rewards.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; check the reward functions")
    r = rewards.float().view(-1, num_generations)
    mean = r.mean(dim=1, keepdim=True)
    group_std = r.std(dim=1, keepdim=True)
    centred = r - mean
    if scale == "group":
        adv = centred / (group_std + eps)
    elif scale == "batch":
        adv = centred / (r.std() + eps)
    else:
        adv = centred
    # Equal rewards in a group: no signal. Exact zero (centred is already ~0 up to rounding).
    adv = torch.where(group_std == 0, torch.zeros_like(adv), adv)
    return adv.view(-1)
