"""policy_batch labels and grpo_update: micro-batching does not change the update; the sampler's
log-probs and high-entropy token selection: the old pass, the sampler-trainer mismatch metrics, the
importance weights reaching the update, the batch-wide entropy threshold, and that turning the
correction off gives today's update."""

import copy

import pytest
import torch

from logitless.generation import Rollout, generate
from logitless.generation.sampling import filter_logits
from logitless.losses.grpo import GRPOLoss
from logitless.models import qwen2_5_tiny
from logitless.rl.batch import policy_batch
from logitless.rl.metrics import sampler_mismatch_metrics, update_flops
from logitless.rl.reference import ReferencePolicy
from logitless.rl.update import _all_values, batch_log_probs_and_entropy, grpo_update


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


# ---------------------------------------------------------------- sampler correction, top-entropy
TEMPERATURE = 0.9


def _rollout(model, seed=0, temperature=TEMPERATURE, **sampling):
    return generate(model, [[5, 6, 7], [8, 9]], max_new_tokens=4, stop_tokens=[3], pad_id=0, num_generations=4,
                    temperature=temperature, generator=torch.Generator().manual_seed(seed), **sampling)


def _update(model, loss_fn, batch, adv, **kwargs):
    m = copy.deepcopy(model)
    out = grpo_update(m, loss_fn, torch.optim.SGD(m.parameters(), lr=0.5), batch, adv, **kwargs)
    return m, out


def test_sampler_log_probs_are_the_trainers_under_top_k_and_top_p():
    """The sampler returns the log-prob of the full tempered distribution of its logits, the quantity
    the trainer recomputes: under top-k / top-p truncation their ratio is still 1 (up to kernels),
    where the truncated distribution's log-prob would carry log(kept mass) into every weight."""
    base = _model()
    temperature, top_k, top_p = 2.0, 3, 0.9  # a flat enough distribution for the truncation to matter
    rollout = _rollout(base, temperature=temperature, top_k=top_k, top_p=top_p)
    batch = policy_batch(rollout)
    loss_fn = GRPOLoss(temperature=temperature, impl="chunked")
    _, out = _update(base, loss_fn, batch, torch.linspace(-1, 1, 8), micro_batch_size=4,
                     sampler_log_probs=rollout.sampler_log_probs)
    assert out["sampling/logp_difference/max"] < 1e-5 and out["sampling/kl"] < 1e-9
    assert out["sampling/ratio_outside_cap"] == 0
    assert out["sampling/importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
    assert out["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
    # the truncation is real: the kept tokens hold well under all the mass at every sampled position,
    # so the truncated distribution's log-probs would be off by -log(kept mass) > 0.5 nats per token
    with torch.no_grad():
        logits = base(batch.tokens, mask=batch.mask, input_pos=batch.input_pos)[:, batch.head_span] / temperature
    logits = logits[batch.head_labels != -100]
    kept = (torch.softmax(logits, -1) * torch.isfinite(filter_logits(logits, top_k, top_p))).sum(-1)
    assert float(-kept.log().min()) > 0.5


def test_correction_off_is_todays_update():
    """sampler_correction=False with the sampler's log-probs: no old pass with one iteration, the
    same parameters bit for bit as an update without them."""
    base = _model()
    rollout = _rollout(base)
    batch, adv = policy_batch(rollout), torch.linspace(-1, 1, 8)
    m0, out0 = _update(base, GRPOLoss(temperature=TEMPERATURE, impl="chunked"), batch, adv, micro_batch_size=4)
    off = GRPOLoss(temperature=TEMPERATURE, impl="chunked", sampler_correction=False)
    assert not off.needs_old_log_probs(1, True) and off.needs_old_log_probs(2, True)
    m1, out1 = _update(base, off, batch, adv, micro_batch_size=4, sampler_log_probs=rollout.sampler_log_probs)
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        assert torch.equal(p0, p1)
    assert out0 == {k: v for k, v in out1.items() if k in out0} and not any(k.startswith("sampling/") for k in out1)


def test_sequence_mask_drops_completions_past_the_cap():
    """Completions whose sequence weight exceeds the cap (3) carry no policy gradient: the update
    equals one where their advantages are 0 (the others' weights are 1 up to the kernels)."""
    base = _model()
    rollout = _rollout(base, seed=2)
    batch, adv = policy_batch(rollout), torch.linspace(-1, 1, 8)
    sampler = rollout.sampler_log_probs.clone()
    sampler[[1, 6], 0] -= 2.0  # the first token's ratio exp(2) > 3: the whole completion masked
    loss_fn = GRPOLoss(temperature=TEMPERATURE, impl="chunked")
    m1, out = _update(base, loss_fn, batch, adv, micro_batch_size=2, sampler_log_probs=sampler)
    assert out["sampling/importance_sampling_ratio/min"] == 0.0
    assert out["sampling/ratio_outside_cap"] == pytest.approx(2 / float(rollout.completion_mask.sum()))
    dropped = adv.clone()
    dropped[[1, 6]] = 0.0
    m0, _ = _update(base, GRPOLoss(temperature=TEMPERATURE, impl="chunked"), batch, dropped, micro_batch_size=2)
    for p0, p1 in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(p1, p0, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(m1.parameters(), base.parameters()))  # it learned


def test_top_entropy_threshold_is_over_the_whole_batch():
    """The high-entropy tokens are chosen among every loss token of the batch (the old pass's
    entropies), so the update does not depend on the micro-batch size; the threshold is the
    quantile of those entropies."""
    base = _model()
    rollout = _rollout(base, seed=3)
    batch, adv = policy_batch(rollout), torch.linspace(-1, 1, 8)
    loss_fn = GRPOLoss(temperature=TEMPERATURE, impl="chunked", top_entropy_quantile=0.4, entropy_coef=0.05,
                       sampler_correction=False)
    assert loss_fn.needs_old_log_probs(1, False)
    results = [_update(base, loss_fn, batch, adv, micro_batch_size=mbs) for mbs in (8, 2)]
    for p0, p1 in zip(results[0][0].parameters(), results[1][0].parameters()):
        torch.testing.assert_close(p0, p1, rtol=1e-5, atol=1e-7)
    m = copy.deepcopy(base)
    loss_fn.set_model_output(m)
    _, ent = batch_log_probs_and_entropy(m, loss_fn, batch, 8)
    mask = loss_fn.loss_mask(batch.head_labels, batch.truncated)
    want = torch.quantile(ent[mask].float(), 0.6)
    assert results[0][1]["top_entropy/threshold"] == pytest.approx(float(want), rel=1e-6)
    assert results[1][1]["top_entropy/threshold"] == results[0][1]["top_entropy/threshold"]
    # and it changes the update: only 40% of the tokens carry the policy gradient
    m_all, _ = _update(base, GRPOLoss(temperature=TEMPERATURE, impl="chunked", entropy_coef=0.05), batch, adv,
                       micro_batch_size=8)
    assert any(not torch.allclose(a, b) for a, b in zip(m_all.parameters(), results[0][0].parameters()))


def test_sampler_log_probs_of_another_shape_are_refused():
    base = _model()
    rollout = _rollout(base)
    with pytest.raises(ValueError, match=r"sampler_log_probs must have the batch's head_labels shape \(8, 4\)"):
        _update(base, GRPOLoss(temperature=TEMPERATURE), policy_batch(rollout), torch.zeros(8), micro_batch_size=4,
                sampler_log_probs=rollout.sampler_log_probs[:, :2])


def test_mismatch_metrics_are_their_formulas():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64) - 2
    sampler = old + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.6
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    sampler[0, 4] = float("nan")  # outside the mask: ignored
    d = (old - sampler)[mask]
    for loss_fn in (GRPOLoss(sampler_correction_clip_max=1.5),
                    GRPOLoss(sampler_correction_clip_max=2.0, sampler_correction_clip_min=0.9, sampler_correction=False)):
        out = sampler_mismatch_metrics(old, sampler, mask, loss_fn)
        assert out["sampling/logp_difference/mean"] == pytest.approx(float(d.abs().mean()), rel=1e-12)
        assert out["sampling/logp_difference/max"] == pytest.approx(float(d.abs().max()), rel=1e-12)
        assert out["sampling/kl"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-12)
        hi = loss_fn.sampler_correction_clip_max
        lo = loss_fn.sampler_correction_clip_min or 1 / hi
        assert out["sampling/ratio_outside_cap"] == pytest.approx(float(((d.exp() > hi) | (d.exp() < lo)).double().mean()))
        assert 0 < out["sampling/ratio_outside_cap"] < 1
        # the default sequence_mask weights: one per completion, 0 past the cap
        if loss_fn.sampler_correction:
            w = torch.exp(torch.where(mask, old - sampler, 0.0).sum(1))
            w = torch.where(w > hi, 0.0, w)
            assert out["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(w.mean()), rel=1e-12)
            assert out["sampling/importance_sampling_ratio/min"] == pytest.approx(float(w.min()), rel=1e-12)
        else:
            assert not any("importance_sampling_ratio" in k for k in out)
    assert sampler_mismatch_metrics(old, sampler, torch.zeros_like(mask), GRPOLoss()) == {}


def test_values_of_every_rank_are_gathered():
    """_all_values pads each rank's values to the longest with NaN, gathers, and drops the padding."""

    class TwoRanks:  # rank 0 of two; rank 1 holds [7., 8., 9.]
        distributed = True

        def all_reduce(self, t, op="sum"):
            assert op == "max"
            return torch.maximum(t, torch.tensor([3]))

        def all_gather(self, t):
            other = torch.tensor([7.0, 8.0, 9.0])
            return torch.cat([t, torch.cat([other, t.new_full((t.numel() - 3,), float("nan"))])])

    assert _all_values(torch.tensor([1.0, 2.0]), TwoRanks()).tolist() == [1.0, 2.0, 7.0, 8.0, 9.0]
    assert _all_values(torch.tensor([1.0]), None).tolist() == [1.0]


def test_update_flops_counts_the_old_pass():
    class Counts:
        def training(self, **size):
            return 3.0

        def forward(self, **size):
            return 1.0

    args = (Counts(), torch.tensor([4, 4]), torch.tensor([2, 3]))
    kw = dict(group_size=2, prompt_once=False, num_iterations=1, reference=False)
    assert update_flops(*args, **kw) == 3.0
    assert update_flops(*args, **kw, old_pass=True) == 4.0
    assert update_flops(*args, **dict(kw, num_iterations=2)) == 7.0
