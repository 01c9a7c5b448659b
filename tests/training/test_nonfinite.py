"""Non-finite steps are skipped (no optimizer or LR-scheduler step, gradients zeroed), counted, and
stop the run after ``max_consecutive_skipped_steps`` in a row; NaN weights are never saved."""

import copy

import pytest
import torch

from logitless.losses import LinearCrossEntropyLoss, LossOutput
from logitless.losses.grpo import GRPOLoss
from logitless.models import qwen2_5_tiny
from logitless.rl.batch import policy_batch
from logitless.generation.eager import generate
from logitless.rl.update import grpo_update
from logitless.training import CheckpointManager, SFTObjective, StepObjective, TrainStep
from logitless.training.nonfinite import (NonFiniteGuard, NonFiniteStepsError, NonFiniteWeightsError,
                                          check_finite_weights)


def _model():
    torch.manual_seed(0)
    return qwen2_5_tiny(vocab_size=48, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64)


def _sft_batch(seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 48, (2, 8), generator=g)
    return {"tokens": tokens, "labels": tokens.clone()}


class _Poisoned(StepObjective):
    """The SFT objective, with a NaN injected into the loss of the steps listed in ``bad``."""

    def __init__(self, objective, bad):
        self.objective, self.bad, self.calls = objective, set(bad), 0

    def units(self, mb):
        return self.objective.units(mb)

    def __call__(self, mb, total):
        self.calls += 1
        loss, metrics = self.objective(mb, total)
        return LossOutput(loss * float("nan") if self.calls in self.bad else loss, metrics)


def _sft_step(model, max_skips=3, clip=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return TrainStep(model, opt, sched, clip_grad_norm=clip, grads_averaged_over_ranks=False,
                     max_consecutive_skipped_steps=max_skips), opt, sched


@pytest.mark.parametrize("clip", [None, 1.0])
def test_sft_nan_step_is_skipped_and_counted(clip):
    model = _model()
    step, opt, sched = _sft_step(model, clip=clip)
    obj = _Poisoned(SFTObjective(model, LinearCrossEntropyLoss(impl="chunked")), bad={2})
    first = step([_sft_batch(0)], obj, step=1)
    assert not first.skipped and first.stepped and first.grad_norm > 0
    before = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(opt.state_dict())
    res = step([_sft_batch(1)], obj, step=2)
    assert res.skipped and not res.stepped and res.skipped_steps == 1
    assert res.grad_norm != res.grad_norm  # NaN, reported
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # no optimizer step
    assert all(p.grad is None for p in model.parameters())  # gradients zeroed
    assert sched.last_epoch == 1 and opt.state_dict()["state"][0]["step"] == opt_state["state"][0]["step"]
    after = step([_sft_batch(2)], obj, step=3)
    assert after.stepped and not after.skipped and after.skipped_steps == 1 and sched.last_epoch == 2


def test_sft_grad_norm_without_clipping_equals_the_gradients_norm():
    model = _model()
    step, _, _ = _sft_step(model)
    norms = []

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
            return super().step(closure)

    step.optimizer, step.lr_scheduler = Capture(model.parameters(), lr=0.0), None
    obj = SFTObjective(model, LinearCrossEntropyLoss(impl="chunked"))
    res = step([_sft_batch(0)], obj)
    assert res.grad_norm == pytest.approx(norms[0], rel=1e-5)


def test_sft_stops_after_n_consecutive_skips_naming_the_step():
    model = _model()
    step, _, _ = _sft_step(model, max_skips=3)
    obj = _Poisoned(SFTObjective(model, LinearCrossEntropyLoss(impl="chunked")), bad={2, 3, 5, 6})
    for i in (1, 2, 3, 4, 5):  # skips at 2, 3, then a good step resets the run of skips, then 5
        step([_sft_batch(i)], obj, step=i)
    assert step.guard.skipped_steps == 3 and step.guard.consecutive_skipped == 1
    obj.bad.add(7)
    step([_sft_batch(6)], obj, step=6)
    with pytest.raises(NonFiniteStepsError, match=r"3 optimizer steps in a row.*step 7.*max_consecutive_skipped_steps=3"):
        step([_sft_batch(7)], obj, step=7)


def _grpo_setup():
    base = _model()
    rollout = generate(base, [[5, 6, 7], [8, 9]], max_new_tokens=4, stop_tokens=[3], pad_id=0, num_generations=4,
                       generator=torch.Generator().manual_seed(0))
    return base, policy_batch(rollout), torch.linspace(-1, 1, 8)


def test_grpo_update_skips_a_nan_step_and_stops_after_n_in_a_row():
    model, batch, adv = _grpo_setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    guard = NonFiniteGuard(max_consecutive_skipped_steps=2)
    loss_fn = GRPOLoss(temperature=0.9, impl="chunked")
    good = grpo_update(model, loss_fn, opt, batch, adv, micro_batch_size=4, lr_scheduler=sched, guard=guard, step=1)
    assert good["skipped"] == 0 and good["skipped_steps"] == 0 and good["grad_norm"] > 0
    before = copy.deepcopy(model.state_dict())
    with torch.no_grad():  # a NaN in the head weight: NaN loss and gradients
        head = model.output.weight if hasattr(model.output, "weight") else model.output.tied_module.weight
        saved = head[0, 0].item()
        head[0, 0] = float("nan")
    out = grpo_update(model, loss_fn, opt, batch, adv, micro_batch_size=4, lr_scheduler=sched, guard=guard, step=2)
    assert out["skipped"] == 1 and out["skipped_steps"] == 1 and out["grad_norm"] != out["grad_norm"]
    assert sched.last_epoch == 1 and all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) or k.endswith("weight") and torch.isnan(v).any(), k
    with pytest.raises(NonFiniteStepsError, match="step 3"):
        grpo_update(model, loss_fn, opt, batch, adv, micro_batch_size=4, lr_scheduler=sched, guard=guard, step=3)
    with torch.no_grad():
        head[0, 0] = saved
    assert sched.last_epoch == 1


def test_checkpoint_with_nan_weights_is_refused(tmp_path):
    model = _model()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["norm.scale"][3] = float("inf")
    ckpt = CheckpointManager(None, str(tmp_path))
    with pytest.raises(NonFiniteWeightsError, match=r"refusing to write checkpoint step_000004.*'norm.scale' \(1 values\)"):
        ckpt.save(step=4, epoch=0, recipe_state={"step": 4}, model_state=sd)
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())
    sd["norm.scale"][3] = 1.0
    assert ckpt.save(step=4, epoch=0, recipe_state={"step": 4}, model_state=sd).is_dir()
    check_finite_weights(dict(model.named_parameters()))


def test_guard_rejects_bad_limit():
    with pytest.raises(ValueError, match="max_consecutive_skipped_steps"):
        NonFiniteGuard(0)
