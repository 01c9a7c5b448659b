"""The resumable sampler: epoch order from the seed, exact mid-epoch restart, disjoint rank shares."""

from logitless.training import ResumableSampler


def test_restart_mid_epoch_continues_the_same_order():
    s = ResumableSampler(23, shuffle=True, seed=5)
    s.set_epoch(2)
    full = list(s)
    s.set_epoch(2, start=9)
    assert list(s) == full[9:]
    assert sorted(full) == list(range(23))
    s.set_epoch(3)
    assert list(s) != full


def test_ranks_split_like_a_single_device_batch():
    n, ws = 20, 2
    single = ResumableSampler(n, seed=1)
    ranks = [ResumableSampler(n, seed=1, rank=r, world_size=ws) for r in range(ws)]
    order = list(single)
    # micro-batch k of size b on every rank covers exactly single-device batch k of size ws * b
    b = 3
    shares = [list(r) for r in ranks]
    for k in range(n // (ws * b)):
        union = sorted(i for sh in shares for i in sh[k * b:(k + 1) * b])
        assert union == sorted(order[k * ws * b:(k + 1) * ws * b])
