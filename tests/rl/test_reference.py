"""The KL reference's TR-DPO sync: ref <- alpha * policy + (1 - alpha) * ref, and its config checks."""

import copy

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from logitless.rl.reference import ReferencePolicy, check_reference_sync, reference_sync_due
from logitless.training.config import ConfigError


class Wrapped(nn.Module):
    """Names its child as activation checkpointing names a wrapped layer (``._checkpoint_wrapped_module``)."""

    def __init__(self, inner):
        super().__init__()
        self._checkpoint_wrapped_module = inner


def model(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False)).to(dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_mix_in_is_the_tr_dpo_update(dtype, tol):
    policy = model(dtype)
    ref = ReferencePolicy.frozen_copy(policy)
    with torch.no_grad():  # the policy trains away from the reference
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    want = {}
    for alpha in (0.6, 0.25):
        before = {n: p.detach().double().clone() for n, p in ref.model.named_parameters()}
        want = {n: alpha * p.detach().double() + (1 - alpha) * before[n] for n, p in policy.named_parameters()}
        # layer wrappers (activation checkpointing) add a name segment: matched through
        ref.mix_in(nn.Sequential(Wrapped(policy[0]), policy[1]) if alpha == 0.25 else policy, alpha)
        for n, r in ref.model.named_parameters():
            assert r.dtype == dtype and not r.requires_grad
            torch.testing.assert_close(r.double(), want[n], rtol=0, atol=tol)
    ref.mix_in(policy, 1.0)  # alpha 1: a copy of the policy
    assert all(torch.equal(r, p) for r, p in zip(ref.model.parameters(), policy.parameters()))


def test_mix_in_refuses_what_it_cannot_mix():
    policy = model(torch.float32)
    with pytest.raises(ValueError, match="adapters disabled: it has no weights of its own"):
        ReferencePolicy.adapters_disabled(policy).mix_in(policy, 0.5)
    ref = ReferencePolicy.frozen_copy(policy)
    with pytest.raises(ValueError, match="alpha must be in \\(0, 1\\], got 0.0"):
        ref.mix_in(policy, 0.0)
    other = copy.deepcopy(policy)
    other.append(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="different parameters"):
        ref.mix_in(other, 0.5)


def test_sync_is_due_every_n_steps():
    assert [s for s in range(1, 10) if reference_sync_due(s, 3)] == [3, 6, 9]
    assert not any(reference_sync_due(s, None) for s in range(1, 10))


FULL = {"model": {"_component_": "logitless.models.qwen2_5_tiny"}, "loss": {"beta": 0.05}}


@pytest.mark.parametrize("cfg, match", [
    (dict(ref_model_mixup_alpha=0.0), "config key 'ref_model_mixup_alpha': expected a value in \\(0, 1\\].*got 0.0"),
    (dict(ref_model_mixup_alpha=1.5), "config key 'ref_model_mixup_alpha'.*got 1.5"),
    (dict(ref_model_sync_steps=4, loss={"beta": 0.0}),
     "config key 'ref_model_sync_steps': 4 syncs the KL reference, but loss.beta=0.0 builds no reference"),
    (dict(ref_model_sync_steps=4, model={"_component_": "logitless.models.lora_qwen2_5_tiny", "lora_rank": 4}),
     "config key 'ref_model_sync_steps': 4 is not supported with a LoRA policy"),
])
def test_sync_config_errors(cfg, match):
    with pytest.raises(ConfigError, match=match):
        check_reference_sync(OmegaConf.merge(FULL, cfg))
    check_reference_sync(OmegaConf.merge(FULL, {"ref_model_sync_steps": 4, "ref_model_mixup_alpha": 1.0}))
