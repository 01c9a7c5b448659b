"""GRPO parts: rewards, group advantages, the policy update, and the set-up and evaluation pieces of
the GRPO recipes (config, prompts; the loop is in ``recipes/``, sampling in :mod:`logitless.generation`).

Public: the rewards a config names (``rewards: [{function: ...}]``) and what scores them. The other
modules (``advantages``, ``batch``, ``shared_batch``, ``update``, ...) are internal.

Example:
    >>> from logitless.rl import build_reward_specs, compute_rewards
    >>> specs = build_reward_specs([{"function": "logitless.rl.rewards.gsm8k_correctness", "weight": 1.0}])
"""

from logitless.rl.rewards import (
    RewardError, RewardSpec, build_reward_specs, compute_rewards, gsm8k_correctness, gsm8k_format, math_correctness,
)

__all__ = ["RewardError", "RewardSpec", "build_reward_specs", "compute_rewards", "gsm8k_correctness", "gsm8k_format",
           "math_correctness"]
