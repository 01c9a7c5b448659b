"""When a recipe step logs or saves, and the peak memory of the busiest rank."""

import torch

from logitless.training.progress import busiest_rank_peak_memory_gib, is_due, peak_memory_gib


def test_is_due_every_n_steps_and_the_last_step():
    for every, last in [(3, 7), (3, 6), (1, 4), (None, 5), (4, None), (None, None)]:
        got = [s for s in range(1, 10) if is_due(s, every, last_step=last)]
        want = sorted({s for s in range(1, 10) if every and s % every == 0} | ({last} if last else set()))
        assert got == want, (every, last)


def test_busiest_rank_peak_memory_is_the_max_over_ranks():
    mine = peak_memory_gib(torch.device("cpu"))
    other = {k: v + 1.5 for k, v in mine.items()}  # another rank that peaked 1.5 GiB higher

    def all_reduce(t, op="sum"):
        assert op == "max"
        return torch.maximum(t, torch.tensor(list(other.values()), dtype=t.dtype))

    got = busiest_rank_peak_memory_gib(torch.device("cpu"), all_reduce)
    assert got.keys() == mine.keys() and all(abs(got[k] - other[k]) < 0.1 for k in got)
