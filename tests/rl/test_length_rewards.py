"""DAPO's soft overlong punishment against its published formula, and its place in the reward call."""

from fractions import Fraction

import pytest

from logitless.rl.length_rewards import SoftOverlongPunishment
from logitless.rl.rewards import build_reward_specs, compute_rewards


def dapo_eq13(length, l_max, l_cache):
    """DAPO (Yu et al. 2025) eq. 13, in exact rationals."""
    if length <= l_max - l_cache:
        return Fraction(0)
    if length <= l_max:
        return Fraction((l_max - l_cache) - length, l_cache)
    return Fraction(-1)


@pytest.mark.parametrize("l_max, l_cache", [(100, 20), (7, 7), (16, 1), (4096, 1024)])
def test_soft_overlong_punishment_is_dapo_eq13(l_max, l_cache):
    reward = SoftOverlongPunishment(max_completion_length=l_max, overlong_buffer=l_cache)
    lengths = sorted({0, 1, l_max - l_cache - 1, l_max - l_cache, l_max - l_cache + 1, (2 * l_max - l_cache) // 2,
                      l_max - 1, l_max, l_max + 1, 2 * l_max} - {-1})
    got = reward(["p"] * len(lengths), ["c"] * len(lengths), completion_ids=[[7] * n for n in lengths])
    want = [dapo_eq13(n, l_max, l_cache) for n in lengths]
    assert all(abs(g - float(w)) <= 1e-12 for g, w in zip(got, want)), list(zip(lengths, got, want))
    assert min(got) >= -1.0 and max(got) == 0.0


def test_trl_docstring_example():
    # TRL's get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20) on 90 tokens: -0.5
    assert SoftOverlongPunishment(100, 20)(["p"], ["c"], completion_ids=[[1] * 90]) == [-0.5]


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_completion_length=0, overlong_buffer=1), "max_completion_length must be an int >= 1.*got 0"),
    (dict(max_completion_length=8.0, overlong_buffer=1), "max_completion_length must be an int >= 1.*got 8.0"),
    (dict(max_completion_length=8, overlong_buffer=0), "overlong_buffer must be an int in \\[1, max_completion_length"
                                                      "=8\\].*got 0"),
    (dict(max_completion_length=8, overlong_buffer=9), "overlong_buffer must be .*got 9"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SoftOverlongPunishment(**kwargs)


def test_built_from_yaml_and_called_with_the_token_ids():
    specs = build_reward_specs([{"function": {"_component_": "logitless.rl.length_rewards.SoftOverlongPunishment",
                                              "max_completion_length": 4, "overlong_buffer": 2}, "weight": 0.5}])
    assert specs[0].name == "soft_overlong_punishment"
    out = compute_rewards(specs, ["p"] * 3, ["a", "bb", "ccc"],
                          {"completion_ids": [[1, 2], [1, 2, 3], [1, 2, 3, 4]]})
    assert out["soft_overlong_punishment"].tolist() == [0.0, -0.5, -1.0]
    assert out["total"].tolist() == [0.0, -0.25, -0.5]
