"""The rollout metrics a GRPO step logs: rewards per function, completion lengths, truncation.

Computed from the whole step's rollout (on several ranks, from the gathered per-completion values),
so a data-parallel run logs the same numbers as one device sampling the same completions.
"""

from typing import Callable, Dict

import torch


def rollout_metrics(rewards: Dict[str, torch.Tensor], lengths: torch.Tensor,
                    truncated: torch.Tensor) -> Dict[str, float]:
    """Mean and std of every reward, completion length mean / max, truncated fraction.

    Args:
        rewards (Dict[str, torch.Tensor]): ``{name: (N,)}`` from ``compute_rewards`` (``"total"``
            is the weighted sum, logged as ``reward/mean`` and ``reward/std``).
        lengths (torch.Tensor): ``(N,)`` completion lengths in tokens.
        truncated (torch.Tensor): ``(N,)`` bool, completions without a stop token.

    Returns:
        Dict[str, float]: ``reward/mean``, ``reward/std``, ``reward/<name>/mean|std``,
        ``completion_length/mean|max``, ``truncated_fraction``.

    Example:
        >>> rollout_metrics({"total": torch.tensor([1.0, 0.0])}, torch.tensor([3, 5]),
        ...                 torch.tensor([False, True]))["completion_length/mean"]
        4.0
    """
    out: Dict[str, float] = {}
    for name, values in rewards.items():
        prefix = "reward" if name == "total" else f"reward/{name}"
        out[f"{prefix}/mean"] = float(values.mean())
        out[f"{prefix}/std"] = float(values.std())
    lengths = lengths.float()
    out.update({"completion_length/mean": float(lengths.mean()), "completion_length/max": float(lengths.max()),
                "truncated_fraction": float(truncated.float().mean())})
    return out


def gather_columns(columns: Dict[str, torch.Tensor], all_gather: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Dict[str, torch.Tensor]:
    """Every rank's per-completion values, in batch order, with one collective for all columns.

    Args:
        columns (Dict[str, torch.Tensor]): ``{name: (n,)}`` for this rank's completions.
        all_gather (Callable): ``Runtime.all_gather`` (concatenates the ranks' rows in rank order).

    Returns:
        Dict[str, torch.Tensor]: ``{name: (N,)}`` float32 on the CPU, N completions over all ranks.

    Example:
        >>> gather_columns({"total": torch.tensor([1.0, 0.0])}, lambda t: t)["total"]
        tensor([1., 0.])
    """
    names = list(columns)
    table = all_gather(torch.stack([columns[k].float().cpu() for k in names], dim=1))
    return {k: table[:, i] for i, k in enumerate(names)}
