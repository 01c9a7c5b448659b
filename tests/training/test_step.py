"""Gradient accumulation: weighting by non-ignored tokens of the whole accumulated batch."""

import copy

import pytest
import torch
import torch.nn.functional as F

from logitless.losses import CEWithChunkedOutputLoss, LinearCrossEntropyLoss
from logitless.models import qwen2_5_tiny
from logitless.training import SFTObjective, TrainStep

IGN = -100


def _batch(seed, b, s, n_ignored):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 2026, (b, s), generator=g)
    labels = tokens.clone()
    labels.view(-1)[:n_ignored] = IGN  # very different token counts per micro-batch
    return {"tokens": tokens, "labels": labels}


def _reference_grads(model, batches):
    """One big batch, plain full logits, mean CE over every non-ignored token."""
    tokens = torch.cat([b["tokens"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGN)], dim=1)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), shifted.reshape(-1), ignore_index=IGN)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_cls", [CEWithChunkedOutputLoss, LinearCrossEntropyLoss])
def test_accumulated_step_equals_one_big_batch(loss_cls):
    torch.manual_seed(0)
    ref_model = qwen2_5_tiny(num_layers=1, embed_dim=64, intermediate_dim=128, max_seq_len=64)
    model = copy.deepcopy(ref_model)
    batches = [_batch(1, 2, 12, 20), _batch(2, 2, 12, 0), _batch(3, 2, 12, 23)]  # 20, 0 and 23 ignored labels
    ref_loss, ref_grads = _reference_grads(ref_model, batches)

    grads = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return super().step(closure)

    obj = SFTObjective(model, loss_cls())
    step = TrainStep(model, Capture(model.parameters(), lr=0.0), grads_averaged_over_ranks=False)
    res = step(batches, obj)
    n_ref = sum(int((b["labels"][:, 1:] != IGN).sum()) for b in batches)
    assert res.num_units == n_ref
    assert res.loss == pytest.approx(ref_loss, rel=1e-5)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_all_ignored_batch_skips_the_step():
    torch.manual_seed(0)
    model = qwen2_5_tiny(num_layers=1, embed_dim=64, intermediate_dim=128, max_seq_len=64)
    before = copy.deepcopy(model.state_dict())
    obj = SFTObjective(model, CEWithChunkedOutputLoss())
    step = TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1.0), clip_grad_norm=1.0)
    b = _batch(0, 2, 8, 16)
    with pytest.warns(UserWarning, match="no units"):
        res = step([b], obj)
    assert not res.stepped and res.loss == 0.0 and res.num_units == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_step_rejects_bad_arguments():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        TrainStep(m, torch.optim.SGD(m.parameters(), lr=1), clip_grad_norm=0.0)
    tiny = qwen2_5_tiny(num_layers=1, embed_dim=64, intermediate_dim=64)
    with pytest.raises(ValueError, match="no micro-batches"):
        TrainStep(m, torch.optim.SGD(m.parameters(), lr=1))([], SFTObjective(tiny, LinearCrossEntropyLoss()))
    with pytest.raises(TypeError, match="loss protocol: expected a logitless.losses.StepLoss"):
        SFTObjective(tiny, torch.nn.CrossEntropyLoss())
