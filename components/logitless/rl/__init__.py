"""GRPO parts: sampling with a KV cache, rewards, group advantages, the policy update, and the set-up
and evaluation pieces of the GRPO recipes (config, prompts, policy sampler; the loop is in ``recipes/``).

Example:
    >>> from logitless.rl import generate, policy_batch, group_advantages, compute_rewards
"""

from logitless.rl.advantages import group_advantages
from logitless.rl.batch import PolicyBatch, policy_batch, policy_forward
from logitless.rl.reference import ReferencePolicy, build_reference
from logitless.rl.rewards import (
    RewardError, RewardSpec, build_reward_specs, compute_rewards, gsm8k_correctness, gsm8k_format, math_correctness,
)
from logitless.generation import Rollout, generate, left_pad, sample_next
from logitless.rl.shared_batch import SharedGroupBatch, shared_batch, training_batch
from logitless.rl.update import grpo_update

__all__ = [
    "PolicyBatch", "ReferencePolicy", "RewardError", "RewardSpec", "Rollout", "SharedGroupBatch", "build_reference",
    "build_reward_specs", "compute_rewards", "generate", "group_advantages", "grpo_update", "gsm8k_correctness",
    "gsm8k_format", "left_pad", "math_correctness", "policy_batch", "policy_forward", "sample_next", "shared_batch",
    "training_batch",
]
