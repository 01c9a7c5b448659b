import math

import numpy as np
import pytest
import torch

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
    with pytest.raises(RewardError, match=r"'_nan' returned nan \(float\) on batch step 7 for completion 1; expected a "
                                          r"finite number with \|r\| <= 1e\+15. Prompt: 'p1'; completion: 'c1'"):
        run(_nan)


def test_bad_specs():
    with pytest.raises(ValueError, match="at least one"):
        build_reward_specs([])
    with pytest.raises(ValueError, match="cannot be imported"):
        build_reward_specs([{"function": "logitless.rl.rewards.nope"}])
    with pytest.raises(ValueError, match=r"config key 'rewards\[0\].function': required"):
        build_reward_specs([{"weight": 1.0}])
    with pytest.raises(ValueError, match="unique"):
        build_reward_specs([{"function": _nan}, {"function": _nan}])
    with pytest.raises(ValueError, match="row field 'answer' has 1 values"):
        compute_rewards(build_reward_specs([{"function": _nan}]), ["a", "b"], ["c", "d"], {"answer": ["x"]})


N = 4


@pytest.mark.parametrize("returned, match", [
    # a string used to become one reward per character ("0101" -> [0., 1., 0., 1.])
    ("0101", r"'bad' returned a str on batch step 3; expected a list of 4 real numbers, one per completion"),
    (["1.0"] * N, r"'bad' returned '1.0' \(str\) on batch step 3 for completion 0; expected a real number"),
    ([1.0, True, 0.0, 0.0], r"'bad' returned True \(bool\) on batch step 3 for completion 1; expected a real number"),
    ([1.0, 0.0, None, 0.0], r"'bad' returned None \(NoneType\) on batch step 3 for completion 2"),
    ([0.0] * (N - 1), r"'bad' returned 3 rewards on batch step 3, expected 4 \(one per completion\)"),
    ([0.0, 0.0, 0.0, math.inf], r"'bad' returned inf \(float\) on batch step 3 for completion 3; expected a finite "
                                r"number with \|r\| <= 1e\+15"),
    # +-3e38 are finite in float32, but their group's std overflows: reward/mean was NaN, the loss 0
    ([3e38, -3e38, 3e38, -3e38], r"'bad' returned 3e\+38 \(float\) on batch step 3 for completion 0"),
    (torch.tensor([[1.0] * N]), r"'bad' returned a Tensor on batch step 3"),
    ({"a": 1}, r"'bad' returned a dict"),
])
def test_each_completion_gets_one_finite_real_number(returned, match):
    specs = build_reward_specs([{"function": lambda prompts, completions, **kw: returned, "name": "bad"}])
    with pytest.raises(RewardError, match=match):
        compute_rewards(specs, ["p"] * N, ["c"] * N, batch_id="step 3")


@pytest.mark.parametrize("returned", [[1, 0, 2, -1], (1.0, 0.0, 2.0, -1.0), torch.tensor([1.0, 0.0, 2.0, -1.0]),
                                      np.array([1, 0, 2, -1], dtype=np.int64), [np.float32(1), 0.0, 2, -1],
                                      [torch.tensor(1.0), 0, 2, -1]])
def test_numbers_in_any_plain_container_are_accepted(returned):
    specs = build_reward_specs([{"function": lambda prompts, completions, **kw: returned, "name": "ok", "weight": 0.5}])
    out = compute_rewards(specs, ["p"] * N, ["c"] * N)
    assert out["ok"].tolist() == [1.0, 0.0, 2.0, -1.0] and out["total"].tolist() == [0.5, 0.0, 1.0, -0.5]


def test_the_weighted_total_must_stay_within_the_bound():
    # each reward within the bound, their weighted sum past it
    specs = build_reward_specs([{"function": lambda p, c, **kw: [1e15] * len(c), "name": "a", "weight": 2.0}])
    with pytest.raises(RewardError, match=r"the weighted total of the rewards is 2e\+15 on batch step 1 for "
                                          r"completion 0; expected \|total\| <= 1e\+15"):
        compute_rewards(specs, ["p"], ["c"], batch_id="step 1")


def test_the_bound_keeps_a_batch_of_a_million_completions_finite_in_float32():
    # the largest deviations the bound allows, squared and summed over 2^20 completions, as std does
    from logitless.rl.advantages import group_advantages
    from logitless.rl.rewards import MAX_ABS_REWARD

    r = torch.tensor([MAX_ABS_REWARD, -MAX_ABS_REWARD] * (1 << 19), dtype=torch.float32)
    assert torch.isfinite(r.std()) and torch.isfinite(group_advantages(r, 1 << 20, scale="batch")).all()
    big = torch.tensor([3e38, -3e38] * 8, dtype=torch.float32)
    assert not torch.isfinite(big.std())  # what the bound prevents


def _needs_a_b(prompts, completions, a, b, **kwargs):
    return [0.0] * len(completions)


def _no_kwargs(prompts, completions, answer, scale=1.0):
    return [0.0] * len(completions)


def test_reward_columns_come_from_the_signature():
    from logitless.rl.rewards import math_correctness, reward_columns

    assert reward_columns(math_correctness) == (("answer",), None)
    assert reward_columns(gsm8k_format) == ((), None)
    assert reward_columns(_needs_a_b) == (("a", "b"), None)
    assert reward_columns(_no_kwargs) == (("answer",), ("answer", "scale"))
