import math

import pytest
import torch

from logitless.rl.advantages import group_advantages


def std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_group_scaling_by_hand():
    r = [1.0, 0.0, 0.0, 0.5, 2.0, 2.0, 2.0, 2.0]  # second group has zero spread
    got = group_advantages(torch.tensor(r), 4, scale="group", eps=1e-4)
    g = r[:4]
    want = [(x - sum(g) / 4) / (std(g) + 1e-4) for x in g] + [0.0] * 4
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_batch_and_none_scaling_by_hand():
    r = [3.0, 1.0, 0.0, 4.0]
    bstd = std(r)
    got = group_advantages(torch.tensor(r), 2, scale="batch", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([1 / bstd, -1 / bstd, -2 / bstd, 2 / bstd]))
    got = group_advantages(torch.tensor(r), 2, scale="none")
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0, -2.0, 2.0]))


def test_zero_std_groups_are_zero_not_nan():
    for scale in ("group", "batch", "none"):
        got = group_advantages(torch.ones(6), 3, scale=scale, eps=0.0)
        assert torch.equal(got, torch.zeros(6))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_generations=1), "num_generations"),
    (dict(num_generations=3), "divisible"),
    (dict(num_generations=2, scale="token"), "scale"),
])
def test_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(torch.zeros(4), **kwargs)


def test_nan_rewards_rejected():
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([0.0, float("nan")]), 2)
