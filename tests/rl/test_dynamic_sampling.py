"""Dynamic sampling: which groups a step keeps, how rounds of rollouts are joined, and that two
ranks select the same groups as one device (ranks emulated by threads with in-memory collectives)."""

import threading

import pytest
import torch

from logitless.rl.dynamic_sampling import (GroupFill, ScoredRollout, concat_rollouts, groups_with_spread,
                                           micro_batch_size_for, take_groups)
from logitless.generation import Rollout
from logitless.training.distributed import Runtime

PAD = 0


def rollout(prompts, completions, g):
    """A Rollout of groups: each prompt (a token list) repeated g times, completions given per row."""
    n = len(prompts) * g
    pw, cw = max(map(len, prompts)), max(map(len, completions))
    pt, pm = torch.zeros(n, pw, dtype=torch.long), torch.zeros(n, pw, dtype=torch.bool)
    ct, cm = torch.zeros(n, cw, dtype=torch.long), torch.zeros(n, cw, dtype=torch.bool)
    for i in range(n):
        p, c = prompts[i // g], completions[i]
        pt[i, pw - len(p):], pm[i, pw - len(p):] = torch.tensor(p), True
        ct[i, :len(c)], cm[i, :len(c)] = torch.tensor(c), True
    lp = torch.where(cm, -torch.arange(1.0, cw + 1.0).expand(n, cw), torch.zeros(n, cw))
    return Rollout(pt, pm, ct, cm, torch.tensor([len(c) == 3 for c in completions]), lp, g)


def rows_of(r):
    return [(r.prompt_tokens[i][r.prompt_mask[i]].tolist(), r.completion_tokens[i][r.completion_mask[i]].tolist(),
             r.sampler_log_probs[i][r.completion_mask[i]].tolist(), bool(r.truncated[i]))
            for i in range(r.prompt_tokens.shape[0])]


def test_groups_with_spread():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, -1.0, -1.0 + 1e-7])
    assert groups_with_spread(r, 2).tolist() == [False, True, False, True]


def test_concat_then_take_keeps_every_row_and_trims_padding():
    a = rollout([[5, 6], [7]], [[1], [2, 3], [4], [5]], 2)
    b = rollout([[8, 9, 10], [11]], [[1, 2, 3], [4], [6], [7, 8]], 2)
    both = concat_rollouts([a, b], pad_id=PAD)
    assert both.prompt_tokens.shape == (8, 3) and both.completion_tokens.shape == (8, 3)
    assert rows_of(both) == rows_of(a) + rows_of(b)
    picked = take_groups(both, [3, 0])  # b's second group, then a's first
    assert rows_of(picked) == rows_of(b)[2:] + rows_of(a)[:2]
    assert picked.prompt_tokens.shape[1] == 2 and picked.completion_tokens.shape[1] == 2  # widths of these rows


@pytest.mark.parametrize("n, configured, g, want", [(40, 16, 4, 8), (48, 16, 4, 16), (12, 16, 4, 12), (28, 16, 4, 4),
                                                   (10, 4, 5, 2), (6, 4, 3, 3)])
def test_micro_batch_size_for(n, configured, g, want):
    size = micro_batch_size_for(n, configured, g)
    assert size == want and n % size == 0 and size <= max(configured, g)


def scored_round(totals, g, prompt_base, rank=0, world=1):
    """One round of len(totals)/g groups; rank r holds its contiguous share (as the recipe samples)."""
    n_groups = len(totals) // g
    share = range(rank * n_groups // world, (rank + 1) * n_groups // world)
    prompts = [[prompt_base + gi, 1 + gi % 3] for gi in share]
    completions = [[prompt_base + gi, j + 1][: 1 + (gi + j) % 2] for gi in share for j in range(g)]
    rows = slice(share.start * g, share.stop * g)
    total = torch.tensor(totals, dtype=torch.float32)
    values = {"acc": total.clone(), "total": total, "length": torch.ones(len(totals)),
              "truncated": torch.zeros(len(totals))}
    return ScoredRollout(rollout(prompts, completions, g), [f"p{prompt_base + gi}" for gi in share for _ in range(g)],
                         [f"c{prompt_base + gi}.{j}" for gi in share for j in range(g)],
                         {k: values[k][rows] for k in ("acc", "total")}, values, rows)


G = 2
ROUNDS = [[1, 1, 0, 1, 0, 0, 1, 0],    # groups 0..3: spread in groups 1 and 3
          [0, 0, 0, 0, 1, 0, 1, 1],    # groups 4..7: spread in group 6
          [1, 0, 0, 1, 1, 1, 0, 1]]    # groups 8..11: spread in 8, 9, 11


def run_fill(rounds, *, prompts_per_step=4, runtime=None, rank=0, world=1):
    runtime = runtime or Runtime(torch.device("cpu"))
    fill = GroupFill(prompts_per_step, G, runtime=runtime, pad_id=PAD)
    for i, totals in enumerate(rounds):
        fill.add(scored_round(totals, G, 100 * i, rank, world))
        if fill.full:
            break
    return fill


def test_fill_keeps_the_first_groups_with_spread_in_stream_order():
    fill = run_fill(ROUNDS)
    assert fill.full and len(fill.rounds) == 3
    batch = fill.batch()
    # kept in stream order: 1, 3, 6, 8 (9 and 11 are the surplus); group k of round i is prompt 100 i + k % 4
    assert [batch.prompts[i] for i in range(0, 8, G)] == ["p1", "p3", "p102", "p200"]
    assert batch.values["total"].tolist() == [0, 1, 1, 0, 1, 0, 1, 0]
    assert batch.rewards["acc"].tolist() == batch.values["total"].tolist() and batch.rows == slice(0, 8)
    assert batch.texts[:2] == ["c1.0", "c1.1"] and batch.rollout.completion_tokens.shape[0] == 8
    assert fill.metrics() == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/sampled_groups": 12.0,
                              "dynamic_sampling/dropped_groups": 6.0,
                              "dynamic_sampling/surplus_groups": 2.0, "dynamic_sampling/filled_fraction": 1.0}
    assert fill.sampled_values()["total"].numel() == 24


def test_further_rounds_sample_the_missing_groups_over_the_keep_rate():
    def fill_after(kept, sampled, prompts_per_step=44, world=1):
        fill = GroupFill(prompts_per_step, G, runtime=Runtime(torch.device("cpu"), world_size=world), pad_id=PAD)
        fill._spread.append(torch.arange(sampled) < kept)  # what add() records of a round
        fill.rounds.append(None)
        return fill

    assert GroupFill(44, G, runtime=Runtime(torch.device("cpu")), pad_id=PAD).next_round_size() == 44
    assert fill_after(36, 44).next_round_size() == 10           # ceil(8 / (36 / 44)) = ceil(9.78)
    assert fill_after(36, 44, world=4).next_round_size() == 12  # whole shares of 4 ranks
    assert fill_after(0, 44).next_round_size() == 44            # nothing kept yet: a whole round
    assert fill_after(1, 44).next_round_size() == 44            # at most prompts_per_step
    assert fill_after(44, 50).next_round_size() == 0            # full


def test_rounds_running_out_train_on_what_was_kept_or_nothing():
    fill = run_fill(ROUNDS[:2])
    assert not fill.full and fill.metrics()["dynamic_sampling/filled_fraction"] == 0.75
    assert fill.batch().values["total"].numel() == 3 * G and "training on 3 groups" in fill.shortfall()
    empty = run_fill([[1, 1, 0, 0, 1, 1, 0, 0]])
    assert empty.batch() is None and empty.metrics()["dynamic_sampling/filled_fraction"] == 0.0
    assert "no optimizer step" in empty.shortfall()


class ThreadRanks:
    """In-memory collectives for ranks run as threads (all_gather, all_reduce max, all_gather_object)."""

    def __init__(self, world):
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world)

    def exchange(self, rank, value):
        self.barrier.wait()
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def runtime(self, rank):
        rt = Runtime(torch.device("cpu"), rank=rank, world_size=self.world, distributed=True)
        rt.all_gather = lambda t: torch.cat(self.exchange(rank, t))
        rt.all_reduce = lambda t, op="sum": torch.stack(self.exchange(rank, t)).amax(0) if op == "max" \
            else torch.stack(self.exchange(rank, t)).sum(0)
        rt.all_gather_object = lambda items: [x for part in self.exchange(rank, items) for x in part]
        return rt


@pytest.mark.parametrize("rounds, prompts_per_step", [(ROUNDS, 4), (ROUNDS[:2], 4)])
def test_two_ranks_select_what_one_device_selects(rounds, prompts_per_step):
    one = run_fill(rounds, prompts_per_step=prompts_per_step).batch()
    ranks, out = ThreadRanks(2), [None, None]

    def rank_main(rank):
        fill = run_fill(rounds, prompts_per_step=prompts_per_step, runtime=ranks.runtime(rank), rank=rank, world=2)
        out[rank] = fill.batch()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # kept groups rounded down to whole shares: 4 -> 2 + 2, 3 -> 1 + 1
    n = one.values["total"].numel() // G // 2 * 2 * G
    for rank, batch in enumerate(out):
        assert torch.equal(batch.values["total"], one.values["total"][:n])
        assert batch.rows == slice(rank * n // 2, (rank + 1) * n // 2)
        assert batch.prompts == one.prompts[batch.rows] and batch.texts == one.texts[batch.rows]
        assert rows_of(batch.rollout) == rows_of(one.rollout)[batch.rows]
