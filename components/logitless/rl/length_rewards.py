"""Rewards computed from a completion's length in tokens.

Every reward function receives ``completion_ids`` (each completion's token ids, its stop token
included, as the policy sampled them; TRL's keyword), so a length reward counts tokens, not
characters of the decoded text.

:class:`SoftOverlongPunishment` is DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): no
penalty up to ``L_max - L_buffer`` tokens, then a penalty growing linearly to -1 at ``L_max``, and
-1 beyond::

    R(y) = 0                                   if |y| <= L_max - L_buffer
         = ((L_max - L_buffer) - |y|) / L_buffer  if L_max - L_buffer < |y| <= L_max
         = -1                                  if |y| > L_max

In YAML, next to the task's reward (the penalty is added with its weight)::

    rewards:
      - function: logitless.rl.rewards.math_correctness
      - function:
          _component_: logitless.rl.length_rewards.SoftOverlongPunishment
          max_completion_length: ${generation.max_new_tokens}
          overlong_buffer: 64
        name: overlong
"""

from __future__ import annotations

from typing import Any, List, Sequence


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment as a reward function (the formula in the module docstring).

    Args:
        max_completion_length (int): ``L_max``, usually ``generation.max_new_tokens``.
        overlong_buffer (int): ``L_buffer``, the last tokens before ``L_max`` over which the penalty
            grows from 0 to -1; in ``[1, max_completion_length]``.

    Raises:
        ValueError: naming the argument, its value and the expected range.

    Example:
        >>> reward = SoftOverlongPunishment(max_completion_length=100, overlong_buffer=20)
        >>> reward(["q"] * 3, ["a", "b", "c"], completion_ids=[[1] * 80, [1] * 90, [1] * 100])
        [0.0, -0.5, -1.0]
    """

    # The name its metrics are logged under unless the reward entry sets ``name``.
    __name__ = "soft_overlong_punishment"

    def __init__(self, max_completion_length: int, overlong_buffer: int):
        if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int) \
                or max_completion_length < 1:
            raise ValueError(f"SoftOverlongPunishment: max_completion_length must be an int >= 1 (L_max, usually "
                             f"generation.max_new_tokens), got {max_completion_length!r}")
        if isinstance(overlong_buffer, bool) or not isinstance(overlong_buffer, int) \
                or not 1 <= overlong_buffer <= max_completion_length:
            raise ValueError(f"SoftOverlongPunishment: overlong_buffer must be an int in [1, max_completion_length="
                             f"{max_completion_length}] (the tokens before L_max over which the penalty grows to -1), "
                             f"got {overlong_buffer!r}")
        self.max_completion_length = max_completion_length
        self.overlong_buffer = overlong_buffer

    def penalty(self, length: int) -> float:
        """The reward of a completion of ``length`` tokens."""
        start = self.max_completion_length - self.overlong_buffer
        if length <= start:
            return 0.0
        if length <= self.max_completion_length:
            return (start - length) / self.overlong_buffer
        return -1.0

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], *,
                 completion_ids: Sequence[Sequence[int]], **row_fields: Any) -> List[float]:
        """One reward per completion, from ``len(completion_ids[i])``.

        Args:
            prompts (Sequence[str]): prompts (unused).
            completions (Sequence[str]): completion texts (unused: lengths are counted in tokens).
            completion_ids (Sequence[Sequence[int]]): each completion's token ids.
            **row_fields: dataset columns (ignored).

        Returns:
            List[float]: rewards in ``[-1, 0]``.
        """
        if len(completion_ids) != len(completions):
            raise ValueError(f"completion_ids holds {len(completion_ids)} completions, expected {len(completions)}")
        return [self.penalty(len(ids)) for ids in completion_ids]

    def __repr__(self) -> str:
        return (f"SoftOverlongPunishment(max_completion_length={self.max_completion_length}, "
                f"overlong_buffer={self.overlong_buffer})")


__all__ = ["SoftOverlongPunishment"]
