"""policy_batch labels and grpo_update: micro-batching does not change the update."""

import copy

import pytest
import torch

from logitless.losses.grpo import GRPOLoss
from logitless.models import qwen2_5_tiny
from logitless.rl.batch import policy_batch
from logitless.generation import Rollout, generate
from logitless.rl.reference import ReferencePolicy
from logitless.rl.update import grpo_update


def test_policy_batch_labels_mask_and_positions():
    r = Rollout(prompt_tokens=torch.tensor([[0, 0, 5], [6, 7, 8]]),
                prompt_mask=torch.tensor([[False, False, True], [True, True, True]]),
                completion_tokens=torch.tensor([[9, 2, 0], [10, 11, 12]]),
                completion_mask=torch.tensor([[True, True, False], [True, True, True]]),
                truncated=torch.tensor([False, True]), sampler_log_probs=torch.zeros(2, 3), num_generations=2)
    b = policy_batch(r)
    assert b.labels.tolist() == [[-100, -100, 9, 2, -100, -100], [-100, -100, 10, 11, 12, -100]]
    assert b.input_pos.tolist() == [[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert b.mask[0, 3].tolist() == [False, False, True, True, False, False]  # pads hidden, causal
    assert b.mask[0, 0, 0]  # a pad query attends to itself (no all-False row)
    assert b.truncated.tolist() == [False, True]


def _model():
    torch.manual_seed(0)
    m = qwen2_5_tiny(vocab_size=48, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64)
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(0.3)
    return m


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_micro_batching_gives_the_same_update(loss_type):
    base = _model()
    rollout = generate(base, [[5, 6, 7], [8, 9]], max_new_tokens=4, stop_tokens=[3], pad_id=0, num_generations=4,
                       generator=torch.Generator().manual_seed(0))
    batch = policy_batch(rollout)
    adv = torch.linspace(-1, 1, 8)
    results = []
    for mbs in (8, 2):
        m = copy.deepcopy(base)
        loss_fn = GRPOLoss(loss_type=loss_type, beta=0.1, max_completion_length=4, temperature=0.9, impl="chunked")
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        ref = ReferencePolicy.frozen_copy(base)
        metrics = grpo_update(m, loss_fn, opt, batch, adv, micro_batch_size=mbs, num_iterations=2, reference=ref)
        results.append((m, metrics))
    (m1, r1), (m2, r2) = results
    if loss_type != "bnpo":  # bnpo normalises per micro-batch by definition (as TRL)
        for p1, p2 in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-6)
        assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-4, abs=1e-6)
    assert r1["kl"] > 0  # second iteration: the policy moved away from the reference


def test_update_argument_errors():
    m = _model()
    rollout = generate(m, [[5, 6]], max_new_tokens=2, stop_tokens=[3], pad_id=0, num_generations=4)
    batch, adv = policy_batch(rollout), torch.zeros(4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="micro_batch_size=3 must divide"):
        grpo_update(m, GRPOLoss(), opt, batch, adv, micro_batch_size=3)
    with pytest.raises(ValueError, match="reference"):
        grpo_update(m, GRPOLoss(beta=0.1), opt, batch, adv, micro_batch_size=2)
    with pytest.raises(ValueError, match="num_iterations"):
        grpo_update(m, GRPOLoss(), opt, batch, adv, micro_batch_size=2, num_iterations=0)
    from logitless.losses import LinearCrossEntropyLoss

    with pytest.raises(TypeError, match="loss_fn: expected a logitless.losses.GRPOLoss, got "
                                        "logitless.losses.ce.LinearCrossEntropyLoss"):
        grpo_update(m, LinearCrossEntropyLoss(), opt, batch, adv, micro_batch_size=2, num_iterations=2)


def _float64_grpo_reference(model, batch, adv, temperature, loss_type, max_len):
    """The GRPO loss of the whole batch in float64 with the full logits, written out (num_iterations=1:
    the ratio is 1 with the gradient of logp), its gradients and token-mean entropy."""
    m64 = copy.deepcopy(model).double()
    logits = m64(batch.tokens, mask=batch.mask, input_pos=batch.input_pos) / temperature
    logz = torch.log_softmax(logits, dim=-1)
    mask = batch.labels != -100
    logp = logz.gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0]
    per_token = -torch.exp(logp - logp.detach()) * adv.double()[:, None]
    if loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum()
    else:  # grpo: per-sequence token mean, then the mean over sequences
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / mask.shape[0]
    loss.backward()
    ent = -(logz.exp() * logz).sum(-1)
    return float(loss), {n: p.grad for n, p in m64.named_parameters()}, float(ent[mask].mean()), int(mask.sum())


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_update_equals_a_float64_accumulation_of_the_whole_batch(loss_type, monkeypatch):
    """grpo_update on 4 micro-batches of 2 completions is ONE TrainStep whose gradient, loss, grad norm
    and token-weighted metrics are those of the whole batch, computed here in float64 from full logits."""
    from logitless.training import step as step_module

    base = _model()
    rollout = generate(base, [[5, 6, 7], [8, 9]], max_new_tokens=4, stop_tokens=[3], pad_id=0, num_generations=4,
                       generator=torch.Generator().manual_seed(1))
    batch = policy_batch(rollout)
    adv = torch.linspace(-1, 1, 8)
    want_loss, want_grads, want_entropy, want_tokens = _float64_grpo_reference(base, batch, adv, 0.9, loss_type, 4)
    model = copy.deepcopy(base)
    grads = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return super().step(closure)

    calls = []
    engine_call = step_module.TrainStep.__call__
    monkeypatch.setattr(step_module.TrainStep, "__call__",
                        lambda self, *a, **k: calls.append(a[1]) or engine_call(self, *a, **k))
    loss_fn = GRPOLoss(loss_type=loss_type, temperature=0.9, impl="chunked")
    out = grpo_update(model, loss_fn, Capture(model.parameters(), lr=0.0), batch, adv, micro_batch_size=2)
    assert len(calls) == 1 and type(calls[0]).__name__ == "GRPOObjective"  # one engine step
    assert out["num_loss_tokens"] == want_tokens
    assert out["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert out["entropy"] == pytest.approx(want_entropy, rel=1e-5)
    want_norm = torch.cat([g.flatten() for g in want_grads.values()]).norm().item()
    assert out["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n].double(), g, rtol=1e-4, atol=1e-6, msg=n)


def test_sft_and_grpo_run_the_same_engine(monkeypatch):
    """Both objectives are StepObjectives run by TrainStep: grpo_update steps the engine
    num_iterations times, SFTObjective is the engine's SFT objective."""
    from logitless.losses import LinearCrossEntropyLoss
    from logitless.rl.update import GRPOObjective
    from logitless.training import SFTObjective, StepObjective
    from logitless.training import step as step_module

    assert issubclass(GRPOObjective, StepObjective) and issubclass(SFTObjective, StepObjective)
    SFTObjective(_model(), LinearCrossEntropyLoss())  # accepted by the same contract
    m = _model()
    rollout = generate(m, [[5, 6]], max_new_tokens=2, stop_tokens=[3], pad_id=0, num_generations=4)
    calls = []
    engine_call = step_module.TrainStep.__call__
    monkeypatch.setattr(step_module.TrainStep, "__call__",
                        lambda self, *a, **k: calls.append(self) or engine_call(self, *a, **k))
    grpo_update(m, GRPOLoss(), torch.optim.SGD(m.parameters(), lr=0.1), policy_batch(rollout), torch.ones(4),
                micro_batch_size=2, num_iterations=3)
    assert len(calls) == 3 and len(set(map(id, calls))) == 1  # one engine, one call per iteration
