"""Reasoning rewards: answers are checked after the think block, the block's format is rewarded."""

import pytest

from logitless.rl import rewards
from logitless.rl.reasoning import answer_only, gsm8k_format, math_correctness, strip_reasoning, think_format
from logitless.rl.rewards import build_reward_specs, compute_rewards

THINKING = "<think>\nMaybe 5? #### 5 no: 3 + 4 = 7.\n</think>\n\nSo the sum is 7.\n#### 7"


def test_strip_reasoning_keeps_the_text_after_the_last_closing_tag():
    assert strip_reasoning(THINKING) == "So the sum is 7.\n#### 7"
    assert strip_reasoning("<think>\nstill thinking #### 7") == ""  # cut off before answering: no answer
    assert strip_reasoning("#### 7") == "#### 7"  # thinking off: the completion is the answer
    assert strip_reasoning("3 + 4\n</think>\n\n#### 7") == "#### 7"  # the prompt opened the block


def test_answer_checks_ignore_what_the_reasoning_wrote():
    completions = [THINKING, "<think>\n#### 7\n</think>\n\n#### 5", "<think>\n#### 7", "#### 7"]
    answers = ["7"] * 4
    assert math_correctness([""] * 4, completions, answer=answers) == [1.0, 0.0, 0.0, 1.0]
    # the plain reward reads the reasoning's "#### 7" of the third completion
    assert rewards.math_correctness([""] * 4, completions, answer=answers)[2] == 1.0
    assert gsm8k_format([""] * 4, completions) == [1.0, 1.0, 0.0, 1.0]
    assert math_correctness.__name__ == "math_correctness"


def test_think_format_wants_one_closed_block_then_an_answer():
    prompts = ["q"] * 6 + ["<|im_start|>assistant\n<think>\n"]
    completions = [THINKING, "#### 7", "<think>\nno end", "<think>\n</think>\n\n   ",
                   "<think>a</think>\n<think>b</think>\n7", "7 <think>late</think> 8", "opened by the prompt\n</think>\n7"]
    assert think_format(prompts, completions) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_wrapped_reward_gets_the_row_columns_and_runs_from_yaml():
    seen = {}

    def needs_columns(prompts, completions, a, b, **kw):
        seen.update(a=a, b=b, completions=completions)
        return [1.0] * len(completions)

    assert answer_only(needs_columns)(["p"], ["<think>x</think> y"], a=[1], b=[2]) == [1.0]
    assert seen == {"a": [1], "b": [2], "completions": ["y"]}
    specs = build_reward_specs([{"function": "logitless.rl.reasoning.math_correctness"},
                                {"function": "logitless.rl.reasoning.think_format", "weight": 0.5}])
    assert [s.name for s in specs] == ["math_correctness", "think_format"]


@pytest.mark.parametrize("completion,total", [(THINKING, 1.5), ("#### 7", 1.0), ("<think>\n#### 7", 0.0)])
def test_weighted_total_of_answer_and_format(completion, total):
    specs = build_reward_specs([{"function": "logitless.rl.reasoning.math_correctness"},
                                {"function": "logitless.rl.reasoning.think_format", "weight": 0.5}])
    out = compute_rewards(specs, ["q"], [completion], {"answer": ["7"]})
    assert float(out["total"][0]) == total
