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


# ---------------------------------------------------------------- estimators against their public formulas
# Each reference below is written from the published definition, in float64, one completion at a time:
# TRL's GRPOTrainer (scale_rewards group / batch / none), TRL's RLOOTrainer (leave-one-out baseline),
# OpenRLHF's REINFORCE++ ("reinforce") and REINFORCE++-baseline ("reinforce_baseline"): a completion's
# return is its reward at each of its tokens, whitened over every completion token of the batch.

from logitless.rl.advantages import advantage_settings, compute_advantages, resolve_scale_rewards  # noqa: E402
from logitless.training.config import ConfigError  # noqa: E402

G = 4
REWARDS = [1.0, 0.0, 0.5, 0.25,   2.0, 2.0, 2.0, 2.0,   -1.0, 3.0, 0.0, 0.0,   0.1, 0.1, 0.1, 0.1]
LENGTHS = [3, 7, 1, 4,   2, 2, 5, 6,   8, 1, 1, 3,   4, 4, 2, 9]


def groups(xs):
    return [xs[i:i + G] for i in range(0, len(xs), G)]


def trl_grpo(rewards, scale):
    batch_std = std(rewards)
    out = []
    for g in groups(rewards):
        m, s = sum(g) / G, {"group": std(g), "batch": batch_std}.get(scale)
        out += [0.0 if std(g) == 0 else ((x - m) if s is None else (x - m) / (s + 1e-4)) for x in g]
    return out


def trl_rloo(rewards):
    return [x - (sum(g) - x) / (G - 1) for g in groups(rewards) for x in g]


def openrlhf_whiten(values, lengths, divide):
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]  # each completion's value at each token
    mu = sum(tokens) / len(tokens)
    var = sum((t - mu) ** 2 for t in tokens) / len(tokens)
    return [(v - mu) * (1 / math.sqrt(max(var, 1e-8)) if divide else 1.0) for v in values]


def check(got, want):
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_mean_is_trls_grpo_advantage(scale):
    got = compute_advantages(torch.tensor(REWARDS, dtype=torch.float64), G, estimator="group_mean",
                             scale_rewards=scale)
    check(got, trl_grpo(REWARDS, scale))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_rloo_is_the_leave_one_out_baseline(scale):
    got = compute_advantages(torch.tensor(REWARDS, dtype=torch.float64), G, estimator="rloo", scale_rewards=scale)
    loo, batch_std = trl_rloo(REWARDS), std(REWARDS)
    want = []
    for g, a in zip(groups(REWARDS), groups(loo)):
        s = {"group": std(g), "batch": batch_std}.get(scale)
        want += [0.0 if std(g) == 0 else (x if s is None else x / (s + 1e-4)) for x in a]
    check(got, want)
    # scale none is TRL's RLOOTrainer (normalize_advantages off), also its default here
    check(compute_advantages(torch.tensor(REWARDS, dtype=torch.float64), G, estimator="rloo", scale_rewards=None),
          trl_rloo(REWARDS))


@pytest.mark.parametrize("scale", ["batch", "none"])
def test_reinforce_pp_whitens_rewards_over_the_batch_tokens(scale):
    got = compute_advantages(torch.tensor(REWARDS, dtype=torch.float64), G, estimator="reinforce_pp",
                             scale_rewards=scale, lengths=torch.tensor(LENGTHS))
    check(got, openrlhf_whiten(REWARDS, LENGTHS, scale == "batch"))


@pytest.mark.parametrize("scale", ["batch", "none"])
def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens(scale):
    got = compute_advantages(torch.tensor(REWARDS, dtype=torch.float64), G, estimator="reinforce_pp_baseline",
                             scale_rewards=scale, lengths=torch.tensor(LENGTHS))
    centred = [x - sum(g) / G for g in groups(REWARDS) for x in g]
    want = openrlhf_whiten(centred, LENGTHS, scale == "batch")
    # groups with equal rewards: 0 (OpenRLHF shifts them by the token-weighted mean; no signal here)
    want = [0.0 if std(groups(REWARDS)[i // G]) == 0 else w for i, w in enumerate(want)]
    check(got, want)


@pytest.mark.parametrize("estimator", ["group_mean", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_no_nan_for_a_batch_without_spread_or_tokens(estimator):
    # every reward equal: zero everywhere (the REINFORCE++ variance is floored, not divided by)
    got = compute_advantages(torch.ones(8), G, estimator=estimator, scale_rewards=None, lengths=torch.full((8,), 3))
    assert torch.equal(got, torch.zeros(8)), got
    # no completion token in the batch: REINFORCE++ has no token to weight (zero); the others ignore lengths
    got = compute_advantages(torch.arange(8.0), G, estimator=estimator, scale_rewards=None, lengths=torch.zeros(8))
    assert torch.isfinite(got).all()
    if estimator.startswith("reinforce_pp"):
        assert torch.equal(got, torch.zeros(8)), got


def test_float32_group_mean_matches_the_former_function_bit_for_bit():
    r = torch.rand(64, generator=torch.Generator().manual_seed(0)).round(decimals=1)
    for scale in ("group", "batch", "none"):
        assert torch.equal(compute_advantages(r, 8, scale_rewards=scale), group_advantages(r, 8, scale=scale))
        assert compute_advantages(r, 8, scale_rewards=scale).dtype == torch.float32


def test_scale_rewards_settings_and_trl_aliases():
    assert resolve_scale_rewards(True) == "group" and resolve_scale_rewards(False) == "none"
    assert [resolve_scale_rewards(None, e) for e in ("group_mean", "rloo", "reinforce_pp", "reinforce_pp_baseline")] \
        == ["group", "none", "batch", "batch"]
    assert resolve_scale_rewards("group", "rloo") == "group"
    with pytest.raises(ValueError, match="'scale_rewards': 'group' does not apply to advantage_estimator="
                                         "'reinforce_pp'.*expected 'batch' \\(whiten\\) or 'none'"):
        resolve_scale_rewards("group", "reinforce_pp")
    with pytest.raises(ValueError, match="lengths of shape \\(8,\\)"):
        compute_advantages(torch.arange(8.0), 4, estimator="reinforce_pp", scale_rewards="batch")


@pytest.mark.parametrize("cfg, want", [
    (dict(), ("group_mean", "group")),
    (dict(scale_rewards=False), ("group_mean", "none")),
    (dict(advantage_scale="batch"), ("group_mean", "batch")),
    (dict(scale_rewards="batch", advantage_scale="batch"), ("group_mean", "batch")),
    (dict(advantage_estimator="reinforce_pp"), ("reinforce_pp", "batch")),
])
def test_advantage_settings(cfg, want):
    from omegaconf import OmegaConf

    assert advantage_settings(OmegaConf.create(cfg)) == want


@pytest.mark.parametrize("cfg, match", [
    (dict(scale_rewards="token"), "config key 'scale_rewards': expected one of \\['group', 'batch', 'none'\\].*"
                                  "got 'token'"),
    (dict(advantage_scale="group", scale_rewards="none"), "config key 'advantage_scale': 'group' .*disagrees"),
    (dict(advantage_estimator="reinforce_pp", scale_rewards="group"),
     "config key 'scale_rewards': 'group' does not apply to advantage_estimator='reinforce_pp'"),
    (dict(advantage_estimator="reinforce_pp", advantage_scale="group"), "config key 'advantage_scale'"),
    (dict(advantage_estimator="ppo"), "config key 'advantage_estimator': expected one of .*got 'ppo'"),
])
def test_advantage_settings_errors(cfg, match):
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError, match=match):
        advantage_settings(OmegaConf.create(cfg))
