"""The tiny tool task: multiplying two numbers, which the tiny policy can only do with a calculator.

A 2-layer, 128-wide model cannot multiply two 2-digit numbers in its head, but it can learn to copy
by position: to write the question into a calculator call and the calculator's answer after
``####``. The operands are drawn so that every product has ``2 * digits`` digits: each copied digit
then sits at the same distance from its source in every row, a pattern the tiny model learns in a
few hundred SFT steps; a result whose length varies (the sum of two 4-digit numbers has 4 or 5
digits) shifts the answer by a token on some rows, which it learns far more slowly. So the reward
of ``configs/tiny_grpo_tools.yaml`` is reachable through the tool only, and GRPO on multi-turn
rollouts has something to learn: call the tool every time.

- :func:`tool_arithmetic_dataset`: the prompts (chat rows ``[system, user "a*b="]``, the ``answer``
  column for the correctness reward);
- :func:`tool_arithmetic_warmstart_dataset`: SFT rows of whole tool conversations, rendered with the
  chat format the rollout uses: a share of them call the calculator and copy its answer, the others
  answer directly (and, the model being unable to multiply, almost always wrongly), so the warm-started
  policy calls the tool on some prompts only (``scripts/make_tiny_grpo_tools_warmstart.py``).

Example:
    >>> ds = tool_arithmetic_dataset(tiny_qwen2_5_tokenizer(), split="eval", num_samples=4)
    >>> ds[0]["prompt_messages"][-1]["content"], ds[0]["answer"]
    ('76*72=', '5472')
"""

from __future__ import annotations

import json
import math
import random
from typing import Any, Dict, List, Tuple

from logitless.generation.tools import CHAT_FORMATS, ToolChat, tool_schema
from logitless.generation.tools.builtin import calculator
from logitless.rl.chat import chat_messages, render_chat_prompt
from logitless.rl.prompts import PromptDataset

__all__ = ["TOOL_ARITHMETIC_SYSTEM_PROMPT", "tool_arithmetic_dataset", "tool_arithmetic_warmstart_dataset"]

TOOL_ARITHMETIC_SYSTEM_PROMPT = "Multiply the numbers with the calculator, then answer as #### <product>."
_SPLIT_SEEDS = {"train": 0, "eval": 1}


def _pairs(split: str, num_samples: int, digits: int, seed: int) -> List[Tuple[int, int]]:
    """``digits``-digit operands whose product always has ``2 * digits`` digits (a fixed layout)."""
    if split not in _SPLIT_SEEDS:
        raise ValueError(f"split must be one of {sorted(_SPLIT_SEEDS)}, got {split!r}")
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits must be an int >= 1, got {digits!r}")
    rng = random.Random(f"{seed}-{split}")
    low, high = math.isqrt(10 ** (2 * digits - 1) - 1) + 1, 10 ** digits - 1
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(num_samples)]


def tool_arithmetic_dataset(tokenizer: Any, *, split: str = "train", num_samples: int = 2000, digits: int = 2,
                            system_prompt: str = TOOL_ARITHMETIC_SYSTEM_PROMPT, seed: int = 0,
                            **real_dataset_args: Any) -> PromptDataset:
    """Chat prompts ``"a*b="`` with ``digits``-digit operands; the answer column holds the product.

    Args:
        tokenizer: a torchtune tokenizer with a chat template (``tokenize_messages``).
        split (str): ``"train"`` or ``"eval"`` (different random streams).
        num_samples (int): rows.
        digits (int): digits of each operand (drawn so that the product has ``2 * digits``).
        system_prompt (str): the system turn.
        seed (int): data seed.
        **real_dataset_args: ignored: another dataset's arguments (``source``, ``chat``...), so that it swaps
            in for one with a single ``_component_`` override.

    Returns:
        PromptDataset: rows with ``prompt_tokens`` (the chat rendering without tools; a tool run
        re-renders them with the tools), ``prompt``, ``prompt_messages`` and ``answer``.
    """
    pairs = _pairs(split, num_samples, digits, seed)
    messages = [chat_messages([{"role": "user", "content": f"{a}*{b}="}], system_prompt=system_prompt)
                for a, b in pairs]
    rendered = [render_chat_prompt(tokenizer, m) for m in messages]
    return PromptDataset([text for _, text in rendered], [ids for ids, _ in rendered],
                         {"answer": [str(a * b) for a, b in pairs]}, messages=messages, source=f"{split} pairs")


def tool_arithmetic_warmstart_dataset(tokenizer: Any, *, num_samples: int = 4000, digits: int = 2,
                                      tool_fraction: float = 0.5, system_prompt: str = TOOL_ARITHMETIC_SYSTEM_PROMPT,
                                      seed: int = 0, tools_in_prompt: bool = True,
                                      **real_dataset_args: Any) -> List[Dict[str, List[int]]]:
    """SFT rows of whole tool conversations, labelled on the model's turns only.

    With probability ``tool_fraction`` a row calls ``calculator`` with the question's expression and
    answers ``#### <its result>`` in a second turn; otherwise it answers ``#### <the product>`` at once.
    The rows are rendered exactly as a tool rollout is (Qwen2.5's chat format with the calculator's
    schema, :class:`~logitless.generation.tools.chat_format.ToolChat`): prompt, model turn, the
    template's tool turn and next assistant header, model turn; the labels are ``-100`` outside the
    model's turns.

    Args:
        tokenizer: the tiny Qwen2.5 tokenizer.
        num_samples (int): rows.
        digits (int): digits of each operand.
        tool_fraction (float): share of rows that call the tool.
        system_prompt (str): the system turn.
        seed (int): data seed (operands and the tool / no-tool choice).
        tools_in_prompt (bool): render the tools block in the system turn, as the rollout does; False
            leaves it out (rows ~6x shorter: a cheap first phase that teaches the copying, whose
            relative positions are the same).
        **real_dataset_args: ignored.

    Returns:
        List[Dict[str, List[int]]]: ``{"tokens", "labels"}`` rows for the SFT recipes.
    """
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction!r}")
    chat = ToolChat(CHAT_FORMATS["qwen2_5"], tokenizer, tools=[tool_schema(calculator)] if tools_in_prompt else None)
    eot = [chat.end_of_turn_id]
    rng = random.Random(f"{seed}-warmstart-choice")
    rows = []
    for a, b in _pairs("train", num_samples, digits, seed):
        messages = chat_messages([{"role": "user", "content": f"{a}*{b}="}], system_prompt=system_prompt)
        tokens, _ = chat.prompt(messages)
        labels = [-100] * len(tokens)
        if rng.random() < tool_fraction:
            arguments = {"expression": f"{a}*{b}"}
            call = chat.encode(f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': arguments})}\n"
                               f"</tool_call>") + eot
            result = calculator(arguments["expression"])
            history = messages + [{"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": arguments}}]}]
            continuation, _ = chat.continuation(history, [{"role": "tool", "name": "calculator", "content": result}])
            tokens += call + continuation
            labels += call + [-100] * len(continuation)
        answer = chat.encode(f"#### {a * b}") + eot
        rows.append({"tokens": tokens + answer, "labels": labels + answer})
    return rows
