"""Advantages for GRPO: one value per completion, from the rewards of the whole step.

Completions come in contiguous groups of ``num_generations`` (G) that share one prompt. The
estimator (``advantage_estimator``) picks the baseline that is subtracted from a reward, and
``scale_rewards`` what the centred reward is divided by:

- ``group_mean`` (GRPO): ``r_i - mean(group)``;
- ``rloo`` (REINFORCE leave-one-out): ``r_i - mean(the other G-1 rewards of the group)``, which is
  ``G / (G - 1)`` times the group-mean advantage;
- ``reinforce_pp`` (REINFORCE++): ``r_i`` whitened over the whole batch's completion tokens:
  ``(r_i - mu) / sigma`` with the token-weighted mean ``mu`` and (biased) standard deviation ``sigma``
  of the rewards, each completion weighted by its token count (its return is its reward at every
  token, with an outcome reward and ``gamma = 1``);
- ``reinforce_pp_baseline`` (REINFORCE++-baseline): ``r_i - mean(group)``, then whitened over the
  batch's tokens as ``reinforce_pp``.

``scale_rewards`` (TRL's semantics for ``group_mean`` and ``rloo``): ``group`` divides by the group's
standard deviation + 1e-4, ``batch`` by the whole batch's + 1e-4 (both unbiased, of the rewards),
``none`` leaves the centred reward as is. REINFORCE++ normalises over the batch by definition: it takes
``batch`` (whiten) or ``none`` (centre only). ``True`` / ``False`` are TRL's aliases of ``group`` /
``none``; null picks the estimator's usual setting (``group`` for ``group_mean``, ``none`` for ``rloo``
as TRL's RLOOTrainer, ``batch`` for the REINFORCE++ pair).

A group whose rewards are all equal carries no signal: under every estimator with a group baseline
it gets exactly zero advantage (never NaN). The statistics are computed in float64 when the rewards
are float64, in float32 otherwise.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

ADVANTAGE_ESTIMATORS = ("group_mean", "rloo", "reinforce_pp", "reinforce_pp_baseline")
SCALE_REWARDS = ("group", "batch", "none")
#: ``scale_rewards: null``: each estimator's usual setting.
DEFAULT_SCALE = {"group_mean": "group", "rloo": "none", "reinforce_pp": "batch", "reinforce_pp_baseline": "batch"}
_GROUP_BASELINE = ("group_mean", "rloo", "reinforce_pp_baseline")
_WHITENED = ("reinforce_pp", "reinforce_pp_baseline")
# REINFORCE++ (OpenRLHF) floors the token variance before its reciprocal square root.
_MIN_VARIANCE = 1e-8


def resolve_scale_rewards(scale_rewards: Union[str, bool, None], estimator: str = "group_mean") -> str:
    """The ``scale_rewards`` setting as one of :data:`SCALE_REWARDS`, checked against the estimator.

    Args:
        scale_rewards: ``"group" | "batch" | "none"``, TRL's aliases ``True`` (group) / ``False``
            (none), or None (the estimator's :data:`DEFAULT_SCALE`).
        estimator (str): one of :data:`ADVANTAGE_ESTIMATORS`.

    Returns:
        str: ``"group"``, ``"batch"`` or ``"none"``.

    Raises:
        ValueError: naming the config key, the value and what is allowed.

    Example:
        >>> resolve_scale_rewards(True), resolve_scale_rewards(None, "rloo")
        ('group', 'none')
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"config key 'advantage_estimator': expected one of {list(ADVANTAGE_ESTIMATORS)}, "
                         f"got {estimator!r}")
    if scale_rewards is None:
        return DEFAULT_SCALE[estimator]
    if isinstance(scale_rewards, bool):
        scale_rewards = "group" if scale_rewards else "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"config key 'scale_rewards': expected one of {list(SCALE_REWARDS)}, true (= group), "
                         f"false (= none) or null (the estimator's default), got {scale_rewards!r}")
    if estimator in _WHITENED and scale_rewards == "group":
        raise ValueError(f"config key 'scale_rewards': 'group' does not apply to advantage_estimator={estimator!r}, "
                         f"which normalises over the whole batch; expected 'batch' (whiten) or 'none' (centre only)")
    return scale_rewards


def advantage_settings(cfg: Any) -> Tuple[str, str]:
    """The GRPO config's ``(advantage_estimator, scale_rewards)``, the scale resolved.

    ``advantage_scale`` (the former name of ``scale_rewards``) is taken when ``scale_rewards`` is
    null, and refused when both are set and disagree.

    Args:
        cfg: the GRPO config (``advantage_estimator``, ``scale_rewards``, ``advantage_scale``).

    Returns:
        Tuple[str, str]: the estimator and ``"group" | "batch" | "none"``.

    Raises:
        ConfigError: naming the key, the value and the expectation.

    Example:
        >>> advantage_settings(OmegaConf.create({"advantage_estimator": "rloo", "scale_rewards": None}))
        ('rloo', 'none')
    """
    from logitless.training.config import ConfigError

    estimator = cfg.get("advantage_estimator", "group_mean")
    scale, former = cfg.get("scale_rewards", None), cfg.get("advantage_scale", None)
    try:
        resolved = resolve_scale_rewards(scale if scale is not None else former, estimator)
    except ValueError as e:
        raise ConfigError(str(e) if scale is not None or former is None else
                          str(e).replace("'scale_rewards'", "'advantage_scale' (the former name of scale_rewards)")
                          ) from None
    if scale is not None and former is not None and resolve_scale_rewards(scale, estimator) != former:
        raise ConfigError(f"config key 'advantage_scale': {former!r} (the former name of scale_rewards) disagrees "
                          f"with scale_rewards={scale!r}; set scale_rewards only")
    return estimator, resolved


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    estimator: str = "group_mean",
    scale_rewards: Union[str, bool, None] = "group",
    lengths: Optional[torch.Tensor] = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Per-completion advantages of one step (see the module docstring for each estimator).

    Args:
        rewards (torch.Tensor): ``(N,)`` total rewards, ``N = num_prompts * num_generations``, grouped
            contiguously (completions ``g*G .. g*G+G-1`` share prompt ``g``).
        num_generations (int): group size ``G`` (>= 2: a group of one has nothing to compare).
        estimator (str): one of :data:`ADVANTAGE_ESTIMATORS`.
        scale_rewards: see :func:`resolve_scale_rewards`.
        lengths (Optional[torch.Tensor]): ``(N,)`` completion token counts; the token weights of the
            REINFORCE++ whitening (required there, unused otherwise).
        eps (float): added to the standard deviation of ``group`` / ``batch`` scaling.

    Returns:
        torch.Tensor: ``(N,)`` advantages, float64 for float64 rewards, else float32.

    Raises:
        ValueError: on a bad ``num_generations``, estimator, scale, shape, length or a non-finite reward.

    Example:
        >>> compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
        tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
        >>> compute_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, estimator="rloo", scale_rewards="none")
        tensor([ 1.0000, -0.5000, -0.5000])
    """
    scale = resolve_scale_rewards(scale_rewards, estimator)
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(
            f"num_generations must be an int >= 2 (a group needs two completions to compare), "
            f"got {num_generations!r}"
        )
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by num_generations={num_generations}, "
            f"got shape {tuple(rewards.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; check the reward functions")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(dtype).view(-1, num_generations)
    group_std = r.std(dim=1, keepdim=True)
    if estimator == "reinforce_pp":
        adv = _whiten(r, lengths, num_generations, scale == "batch")
        return adv.view(-1)
    mean = r.mean(dim=1, keepdim=True)
    centred = r - mean
    if estimator == "rloo":  # r_i - (sum - r_i) / (G - 1)
        centred = centred * (num_generations / (num_generations - 1))
    if estimator == "reinforce_pp_baseline":
        adv = _whiten(centred, lengths, num_generations, scale == "batch")
    elif scale == "group":
        adv = centred / (group_std + eps)
    elif scale == "batch":
        adv = centred / (r.std() + eps)
    else:
        adv = centred
    # Equal rewards in a group: no signal. Exact zero (centred is already ~0 up to rounding).
    adv = torch.where(group_std == 0, torch.zeros_like(adv), adv)
    return adv.view(-1)


def _whiten(values: torch.Tensor, lengths: Optional[torch.Tensor], num_generations: int,
            divide: bool) -> torch.Tensor:
    # REINFORCE++'s normalisation over every completion token of the batch: a completion's value
    # counts once per token (token-weighted mean and biased variance, floored before the rsqrt).
    if lengths is None or lengths.shape != (values.numel(),):
        raise ValueError(f"the REINFORCE++ estimators weight each completion by its token count: expected "
                         f"lengths of shape ({values.numel()},), got "
                         f"{None if lengths is None else tuple(lengths.shape)}")
    w = lengths.to(values.dtype).view(-1, num_generations)
    if bool((w < 0).any()):
        raise ValueError("lengths must be >= 0 (completion token counts)")
    tokens = w.sum()
    if tokens == 0:  # no completion token in the batch: nothing to weight, nothing to learn
        return torch.zeros_like(values)
    mu = (values * w).sum() / tokens
    out = values - mu
    if divide:
        var = ((values - mu) ** 2 * w).sum() / tokens
        out = out * var.clamp(min=_MIN_VARIANCE).rsqrt()
    return out


def group_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-mean advantages, ``(r_i - mean(group)) / (std + eps)``: :func:`compute_advantages`
    with ``estimator="group_mean"`` (kept for callers of the former name).

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
        tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale must be one of {SCALE_REWARDS}, got {scale!r}")
    return compute_advantages(rewards, num_generations, estimator="group_mean", scale_rewards=scale, eps=eps)


__all__ = ["ADVANTAGE_ESTIMATORS", "DEFAULT_SCALE", "SCALE_REWARDS", "advantage_settings", "compute_advantages",
           "group_advantages", "resolve_scale_rewards"]
