"""The oracle itself, against a hand-written softmax over explicit Python sums."""

import math

import torch

from logitless.ops import reference


def _by_hand(hidden, weight, labels, temperature, ignore_index=-100):
    logp, ent = [], []
    for h, y in zip(hidden.tolist(), labels.tolist()):
        z = [sum(a * b for a, b in zip(h, w)) / temperature for w in weight.tolist()]
        m = max(z)
        lse = m + math.log(sum(math.exp(v - m) for v in z))
        if y == ignore_index:
            logp.append(0.0), ent.append(0.0)
            continue
        logp.append(z[y] - lse)
        ent.append(-sum(math.exp(v - lse) * (v - lse) for v in z))
    return torch.tensor(logp, dtype=torch.float64), torch.tensor(ent, dtype=torch.float64)


def test_log_probs_and_entropy_match_hand_written_softmax():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 5, dtype=torch.float64, generator=g)
    weight = torch.randn(9, 5, dtype=torch.float64, generator=g)
    labels = torch.tensor([0, 8, -100, 3, 4, 2])
    logp, ent = reference.log_probs(hidden, weight, labels, temperature=0.6)
    want_logp, want_ent = _by_hand(hidden, weight, labels, 0.6)
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=1e-12, atol=1e-12)


def test_cross_entropy_reductions():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, dtype=torch.float64, generator=g)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=g)
    labels = torch.tensor([1, -100, 6, 0, -100])
    want, _ = _by_hand(hidden, weight, labels, 1.0)
    per_token = reference.cross_entropy(hidden, weight, labels, reduction="none")
    torch.testing.assert_close(per_token, -want)
    torch.testing.assert_close(reference.cross_entropy(hidden, weight, labels, reduction="sum"), -want.sum())
    torch.testing.assert_close(reference.cross_entropy(hidden, weight, labels), -want.sum() / 3)
    all_ignored = torch.full((5,), -100)
    assert reference.cross_entropy(hidden, weight, all_ignored).item() == 0.0
