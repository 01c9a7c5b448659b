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


def test_copy_full_weights_fills_a_same_architecture_model_in_place():
    # The rollout copy: every parameter copied by name (activation-checkpoint wrapper names
    # stripped), into the destination's own storage (a CUDA graph over it stays valid).
    from torch import nn

    from logitless.training.model import apply_activation_checkpointing, build_model
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"_component_": "logitless.models.qwen2_5_tiny"})
    src = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=1)
    apply_activation_checkpointing(src)
    dst = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32, seed=2)
    storage = {k: p.data_ptr() for k, p in dst.named_parameters()}
    assert any(not torch.equal(p, dst.state_dict()[k.replace("._checkpoint_wrapped_module", "")])
               for k, p in src.state_dict().items())
    Runtime.setup("cpu", distributed=False).copy_full_weights(src, dst)
    for k, p in src.state_dict().items():
        assert torch.equal(p, dst.state_dict()[k.replace("._checkpoint_wrapped_module", "")]), k
    assert {k: p.data_ptr() for k, p in dst.named_parameters()} == storage
    # trainable_only: frozen parameters are left as they are
    frozen = "tok_embeddings.weight"
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    src.tok_embeddings.weight.requires_grad_(False)
    before = dst.state_dict()[frozen].clone()
    Runtime.setup("cpu", distributed=False).copy_full_weights(src, dst, trainable_only=True)
    assert torch.equal(dst.state_dict()[frozen], before)
    assert torch.equal(dst.state_dict()["norm.scale"], src.state_dict()["norm.scale"])
    other = nn.Module()
    other.tok_embeddings = nn.Embedding(3, 4)
    with pytest.raises(ValueError, match="dst: expected a parameter 'tok_embeddings.weight' of shape"):
        Runtime.setup("cpu", distributed=False).copy_full_weights(src, other)
