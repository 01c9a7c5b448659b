"""Rewards for reasoning models: check the answer after the ``<think>`` block, reward the block's format.

A Qwen3 completion with thinking on is ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``; with thinking
off the prompt already holds the empty block and the completion is the answer alone. Answer checks
must not read the reasoning (a number the model tried on the way, a ``####`` it wrote while
thinking), so :func:`answer_only` wraps any reward function to see only the text after the last
``</think>``; a completion whose reasoning never closed has no answer (an empty one).

Named in YAML like any reward::

    rewards:
      - function: logitless.rl.reasoning.math_correctness   # the answer's number, reasoning stripped
        weight: 1.0
      - function: logitless.rl.reasoning.gsm8k_format       # the answer ends with '#### <number>'
        weight: 0.2
      - function: logitless.rl.reasoning.think_format       # one closed think block, then an answer
        weight: 0.1
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable, List, Sequence

from logitless.rl import rewards

__all__ = ["THINK_CLOSE", "THINK_OPEN", "answer_only", "gsm8k_format", "math_correctness", "strip_reasoning",
           "think_format"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# one block: optional whitespace, <think> (or already opened by the prompt), reasoning without tags,
# </think>, then a non-empty answer without tags
_ANSWER_AFTER_BLOCK = re.compile(r"\s*(?:<think>)?((?:(?!</?think>).)*)</think>\s*((?:(?!</?think>).)*\S(?:(?!</?think>).)*)$",
                                 re.DOTALL)


def strip_reasoning(completion: str) -> str:
    """The answer of a completion: the text after its last ``</think>``; ``""`` while a ``<think>``
    is still open (the reasoning was cut off before any answer); the completion itself without tags.

    Args:
        completion (str): generated text.

    Returns:
        str: the answer, leading whitespace removed.

    Example:
        >>> strip_reasoning("<think>\\ntry 5, no: 7\\n</think>\\n\\n#### 7"), strip_reasoning("<think>\\ntry 5")
        ('#### 7', '')
    """
    if THINK_CLOSE in completion:
        return completion.rsplit(THINK_CLOSE, 1)[1].lstrip()
    if THINK_OPEN in completion:
        return ""
    return completion


def answer_only(reward: Callable[..., Sequence[float]]) -> Callable[..., List[float]]:
    """``reward`` applied to the completions' answers (:func:`strip_reasoning`), same name and arguments.

    Args:
        reward (Callable): ``f(prompts, completions, **columns) -> list[float]``.

    Returns:
        Callable: the wrapped reward function.

    Example:
        >>> answer_only(rewards.gsm8k_format)(["q"], ["<think>#### 3</think>so 4"])
        [0.0]
    """
    @functools.wraps(reward)
    def on_answers(prompts: Sequence[str], completions: Sequence[str], *args: Any, **columns: Any) -> List[float]:
        return list(reward(prompts, [strip_reasoning(c) for c in completions], *args, **columns))

    return on_answers


math_correctness = answer_only(rewards.math_correctness)
gsm8k_format = answer_only(rewards.gsm8k_format)


def think_format(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> List[float]:
    """1.0 for a completion with exactly one closed think block followed by a non-empty answer, else 0.0.

    The block opens with ``<think>`` in the completion or at the end of the prompt (templates that
    open it in the generation prompt); neither the reasoning nor the answer may hold another tag.

    Args:
        prompts (Sequence[str]): prompt texts (their end says whether the block is already open).
        completions (Sequence[str]): generated texts.
        **columns: dataset columns (ignored).

    Returns:
        List[float]: one reward per completion.

    Example:
        >>> think_format(["q", "q", "q"], ["<think>\\n3+4\\n</think>\\n\\n7", "7", "<think>\\n3+4"])
        [1.0, 0.0, 0.0]
    """
    out = []
    for prompt, completion in zip(prompts, completions):
        opened = completion.lstrip().startswith(THINK_OPEN) or prompt.rstrip().endswith(THINK_OPEN)
        found = _ANSWER_AFTER_BLOCK.match(completion)
        out.append(1.0 if opened and found is not None else 0.0)
    return out
