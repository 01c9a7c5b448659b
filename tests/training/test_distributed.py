"""Runtime on one process: identities, contiguous shares, the world size a launch announces. The
collectives and FSDP2 paths run in tests/recipes (two gloo processes)."""

import pytest
import torch

from logitless.training.distributed import Runtime, launched_world_size


def test_one_device_collectives_are_identities():
    rt = Runtime.setup("cpu", distributed=False)
    t = torch.tensor([1.0, 2.0])
    assert rt.all_reduce(t) is t and rt.all_gather(t) is t and rt.is_rank_zero
    model = torch.nn.Linear(2, 2)
    rt.shard(model)
    with rt.full_weights(model):
        pass
    assert rt.full_state_dict(model).keys() == model.state_dict().keys()
    assert rt.own_rng_state(rt.rng_states()) is not None


@pytest.mark.parametrize("n, world", [(8, 2), (5, 2), (3, 4), (11, 3)])
def test_shares_are_contiguous_and_cover_every_item_once(n, world):
    shares = [Runtime(torch.device("cpu"), rank=r, world_size=world, distributed=True).share(n) for r in range(world)]
    assert [i for s in shares for i in s] == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_launched_world_size_reads_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_world_size() == 4
    monkeypatch.delenv("WORLD_SIZE")
    assert launched_world_size() == 1
