"""Each GRPO step's prompt rows, and gathering per-completion columns over ranks."""

import torch

from logitless.rl.metrics import gather_columns
from logitless.rl.prompt_sets import step_prompt_indices


def test_every_epoch_of_steps_visits_each_row_once_in_a_seeded_order():
    n, k = 10, 5  # two steps per epoch
    steps = [step_prompt_indices(s, num_rows=n, prompts_per_step=k, seed=3) for s in range(6)]
    for epoch in range(3):
        assert sorted(steps[2 * epoch] + steps[2 * epoch + 1]) == list(range(n))
    assert steps[0] + steps[1] != steps[2] + steps[3]  # a new order each epoch
    assert steps == [step_prompt_indices(s, num_rows=n, prompts_per_step=k, seed=3) for s in range(6)]
    assert steps[0] != step_prompt_indices(0, num_rows=n, prompts_per_step=k, seed=4)
    # a step that straddles two epochs takes the end of one order and the start of the next
    assert step_prompt_indices(1, num_rows=7, prompts_per_step=5, seed=0) == (
        steps_of(7, 0, epoch=0)[5:] + steps_of(7, 0, epoch=1)[:3])


def steps_of(n, seed, epoch):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


def test_gather_columns_keeps_rank_order_and_names():
    ranks = [{"total": torch.tensor([1.0, 0.0]), "length": torch.tensor([3, 5])},
             {"total": torch.tensor([0.5, 2.0]), "length": torch.tensor([7, 1])}]
    mine = ranks[0]
    # all_gather as torch.distributed does it: every rank's (n, columns) table, concatenated in rank order
    out = gather_columns(mine, lambda t: torch.cat([t] + [torch.stack([r[k].float() for k in mine], 1)
                                                         for r in ranks[1:]]))
    assert out["total"].tolist() == [1.0, 0.0, 0.5, 2.0] and out["length"].tolist() == [3.0, 5.0, 7.0, 1.0]


def test_the_prompt_stream_continues_across_epochs_and_steps():
    from logitless.rl.prompt_sets import prompt_stream_indices

    orders = steps_of(7, 5, epoch=0) + steps_of(7, 5, epoch=1) + steps_of(7, 5, epoch=2)
    assert prompt_stream_indices(3, 12, num_rows=7, seed=5) == orders[3:15]
    # without dynamic sampling, step s is the stream's positions s * P .. s * P + P - 1
    assert [step_prompt_indices(s, num_rows=7, prompts_per_step=3, seed=5) for s in range(4)] == \
        [orders[3 * s:3 * s + 3] for s in range(4)]


def test_a_dataset_column_named_completion_ids_is_refused():
    import pytest
    from omegaconf import OmegaConf

    from logitless.rl.prompt_sets import fit_prompts
    from logitless.training.config import ConfigError

    rows = [{"prompt_tokens": [1, 2], "prompt": "1+1=", "completion_ids": [3]}]
    with pytest.raises(ConfigError, match="config key 'dataset': its rows have a column 'completion_ids'"):
        fit_prompts(rows, "dataset", OmegaConf.create({"on_too_long": "drop"}), rewards=(), max_seq_len=16,
                    max_new_tokens=4, log=False)
