"""Greedy evaluation of a GRPO policy on held-out prompts (``eval_every_n_steps``)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from logitless.generation.policy_sampler import PolicySampler
from logitless.rl.rewards import RewardSpec, compute_rewards
from logitless.training.distributed import Runtime


@torch.no_grad()
def greedy_accuracy(policy: nn.Module, sampler: PolicySampler, dataset: Any, rewards: Sequence[RewardSpec], *,
                    num_prompts: Optional[int], reward: str, batch_size: int, runtime: Runtime) -> Dict[str, float]:
    """Mean of the reward ``reward`` over one greedy completion per prompt, the prompts split over the ranks.

    Args:
        policy (nn.Module): the policy (sharded or not).
        sampler (PolicySampler): samples it.
        dataset (Any): the evaluation prompts.
        num_prompts (Optional[int]): evaluate the first this many (None: all).
        rewards (Sequence[RewardSpec]): the run's reward functions.
        reward (str): the name of the one whose mean is the accuracy.
        batch_size (int): prompts per sampler call.
        runtime (Runtime): splits the prompts and sums the scores over the ranks.

    Returns:
        Dict[str, float]: ``{"eval/accuracy": mean score}``.
    """
    rows = [dataset[i] for i in range(len(dataset))][:num_prompts]
    rows = [rows[i] for i in runtime.share(len(rows))]
    total = torch.zeros(2, dtype=torch.float64)  # score sum, prompts
    with sampler.weights(policy):
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            _, prompts, texts, fields = sampler.sample(policy, chunk, 1, None, evaluation=True, temperature=0.0)
            scores = compute_rewards(rewards, prompts, texts, fields, batch_id="eval")[reward]
            total += torch.tensor([float(scores.double().sum()), len(chunk)], dtype=torch.float64)
    total = runtime.all_reduce(total)
    return {"eval/accuracy": float(total[0] / total[1])}


__all__ = ["greedy_accuracy"]
