import math

import pytest

from logitless.rl.rewards import (
    RewardError, build_reward_specs, compute_rewards, extract_final_number, gsm8k_correctness, gsm8k_format,
    parse_gsm8k_answer,
)

GSM_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("text, want", [
    ("so the total is 72.\n#### 72", 72.0),
    ("#### 1,234", 1234.0),
    ("The answer is $18.", 18.0),
    ("we get \\boxed{-3.5}", -3.5),
    ("3 + 4 = 7, then 7 * 2 = 14", 14.0),
    ("#### 5 and later 6", 5.0),  # the '####' line wins over later numbers
    ("no number here", None),
])
def test_extract_final_number(text, want):
    assert extract_final_number(text) == want


def test_parse_gsm8k_answer():
    assert parse_gsm8k_answer(GSM_ANSWER) == 72.0
    assert parse_gsm8k_answer("#### 1,000") == 1000.0
    assert parse_gsm8k_answer("8") == 8.0


def test_correctness_on_gsm8k_strings():
    completions = ["48/2 = 24, 48 + 24 = 72\n#### 72", "I think 70.\n#### 70", "72", "seventy-two", "#### 72.0"]
    got = gsm8k_correctness(["q"] * 5, completions, answer=[GSM_ANSWER] * 5)
    assert got == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_format_reward():
    got = gsm8k_format(["q"] * 4, ["work\n#### 72", "#### 72 because", "72", "#### 1,000.\n"])
    assert got == [1.0, 0.0, 0.0, 1.0]


def test_weighted_total_and_per_function_values():
    specs = build_reward_specs([
        {"function": "logitless.rl.rewards.gsm8k_correctness", "weight": 1.0},
        {"function": "logitless.rl.rewards.gsm8k_format", "weight": 0.5, "name": "fmt"},
    ])
    out = compute_rewards(specs, ["q", "q"], ["#### 72", "72"], {"answer": [GSM_ANSWER, GSM_ANSWER]})
    assert out["gsm8k_correctness"].tolist() == [1.0, 1.0]
    assert out["fmt"].tolist() == [1.0, 0.0]
    assert out["total"].tolist() == [1.5, 1.0]


def _raises(prompts, completions, **kw):
    raise KeyError("boom")


def _short(prompts, completions, **kw):
    return [1.0]


def _nan(prompts, completions, **kw):
    return [0.0, math.nan]


def test_errors_name_function_batch_and_prompt():
    def run(fn):
        return compute_rewards(build_reward_specs([{"function": fn}]), ["p0", "p1"], ["c0", "c1"], batch_id="step 7")

    with pytest.raises(RewardError, match=r"'_raises' raised on batch step 7.*KeyError"):
        run(_raises)
    with pytest.raises(RewardError, match=r"'_short' returned 1 rewards on batch step 7, expected 2"):
        run(_short)
    with pytest.raises(RewardError, match=r"'_nan' returned nan .*completion 1; prompt: 'p1'"):
        run(_nan)


def test_bad_specs():
    with pytest.raises(ValueError, match="at least one"):
        build_reward_specs([])
    with pytest.raises(ValueError, match="cannot be imported"):
        build_reward_specs([{"function": "logitless.rl.rewards.nope"}])
    with pytest.raises(ValueError, match="needs a 'function'"):
        build_reward_specs([{"weight": 1.0}])
    with pytest.raises(ValueError, match="unique"):
        build_reward_specs([{"function": _nan}, {"function": _nan}])
    with pytest.raises(ValueError, match="row field 'answer' has 1 values"):
        compute_rewards(build_reward_specs([{"function": _nan}]), ["a", "b"], ["c", "d"], {"answer": ["x"]})
