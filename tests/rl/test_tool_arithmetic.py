"""The tiny tool task: its prompts hold no answer, its products have a fixed width, and its warm-start
rows label exactly the calculator call and the copied answer."""

import json
import re

import pytest

from logitless.datasets import tiny_qwen2_5_tokenizer
from logitless.generation.tools.builtin import calculator
from logitless.rl.tool_arithmetic import tool_arithmetic_dataset, tool_arithmetic_warmstart_dataset


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_qwen2_5_tokenizer()


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_products_have_twice_the_operand_digits_and_are_not_in_the_prompt(tokenizer, digits):
    ds = tool_arithmetic_dataset(tokenizer, split="train", num_samples=64, digits=digits)
    for row in ds.rows:
        question = row["prompt_messages"][-1]["content"]
        a, b = map(int, re.fullmatch(r"(\d+)\*(\d+)=", question).groups())
        assert len(str(a)) == len(str(b)) == digits
        assert row["answer"] == str(a * b) and len(row["answer"]) == 2 * digits
        assert row["answer"] not in row["prompt"]


def test_splits_differ_and_bad_arguments_are_named(tokenizer):
    train = tool_arithmetic_dataset(tokenizer, split="train", num_samples=8)
    eval_ = tool_arithmetic_dataset(tokenizer, split="eval", num_samples=8)
    assert [r["answer"] for r in train.rows] != [r["answer"] for r in eval_.rows]
    with pytest.raises(ValueError, match="split must be one of"):
        tool_arithmetic_dataset(tokenizer, split="test", num_samples=2)
    with pytest.raises(ValueError, match="digits must be an int >= 1, got 0"):
        tool_arithmetic_dataset(tokenizer, num_samples=2, digits=0)
    with pytest.raises(ValueError, match="tool_fraction must be in"):
        tool_arithmetic_warmstart_dataset(tokenizer, num_samples=2, tool_fraction=1.5)


@pytest.mark.parametrize("tools_in_prompt", [True, False])
def test_warmstart_rows_label_the_call_and_the_copied_answer(tokenizer, tools_in_prompt):
    rows = tool_arithmetic_warmstart_dataset(tokenizer, num_samples=32, tool_fraction=0.5,
                                             tools_in_prompt=tools_in_prompt)
    calls = 0
    for row in rows:
        text = tokenizer.decode(row["tokens"], skip_special_tokens=False)
        a, b = map(int, re.search(r"<\|im_start\|>user\n(\d+)\*(\d+)=<\|im_end\|>", text).groups())
        labelled = tokenizer.decode([t for t, l in zip(row["tokens"], row["labels"]) if l != -100],
                                    skip_special_tokens=False)
        assert all(l in (-100, t) for t, l in zip(row["tokens"], row["labels"]))
        call = re.search(r"<tool_call>\n(.*)\n</tool_call>", labelled)
        if call:
            calls += 1
            assert json.loads(call.group(1)) == {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
            assert f"<tool_response>\n{calculator(f'{a}*{b}')}\n</tool_response>" in text  # the tool's turn...
            assert "tool_response" not in labelled  # ...is context, not a label
        assert labelled.endswith(f"#### {a * b}<|im_end|>")
        assert ("# Tools" in text) == tools_in_prompt
    assert 0 < calls < len(rows)
