"""Tool and environment tokens are context, never loss: the update of a multi-turn rollout (loss,
entropy, KL, every gradient; expanded and prompt-shared batches) equals a float64 reference over the
policy's own tokens only; a one-turn rollout is labelled exactly as before."""

import copy
import dataclasses

import pytest
import torch

from logitless.losses.grpo import GRPOLoss
from logitless.models import qwen2_5_tiny
from logitless.rl.batch import policy_batch
from logitless.rl.reference import ReferencePolicy
from logitless.generation.eager import generate
from logitless.rl.shared_batch import training_batch
from logitless.rl.update import grpo_update

G = 4
TEMPERATURE = 0.9


def _model(seed=0):
    torch.manual_seed(seed)
    m = qwen2_5_tiny(vocab_size=48, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64)
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(0.3)
    return m


@pytest.fixture(scope="module")
def multi_turn():
    """A rollout whose completions hold context tokens: every third completion position of each row
    is marked as appended by the environment (not sampled)."""
    base = _model()
    rollout = generate(base, [[5, 6, 7, 8], [9, 10]], max_new_tokens=8, stop_tokens=[3], pad_id=0,
                       num_generations=G, temperature=TEMPERATURE, generator=torch.Generator().manual_seed(2))
    n, t = rollout.completion_tokens.shape
    sampled = (torch.arange(t) % 3 != 1)[None].expand(n, t).clone()
    sampled[::2, 0] = False  # and some rows start with context
    return base, dataclasses.replace(rollout, sampled_mask=sampled)


def _reference_update(model, reference, batch, rollout, adv, beta):
    """The dapo GRPO loss in float64 from full logits, over the sampled completion tokens only."""
    m64, r64 = copy.deepcopy(model).double(), copy.deepcopy(reference).double()
    p = rollout.prompt_tokens.shape[1]
    own = rollout.completion_mask & rollout.sampled_mask  # written out, not Rollout.loss_mask
    logits = m64(batch.tokens, mask=batch.mask, input_pos=batch.input_pos)[:, p - 1:-1] / TEMPERATURE
    with torch.no_grad():
        ref_logits = r64(batch.tokens, mask=batch.mask, input_pos=batch.input_pos)[:, p - 1:-1] / TEMPERATURE
    logz, ref_logz = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    tokens = rollout.completion_tokens[..., None]
    logp, ref = logz.gather(-1, tokens)[..., 0], ref_logz.gather(-1, tokens)[..., 0]
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = -torch.exp(logp - logp.detach()) * adv.double()[:, None] + beta * kl
    loss = per_token[own].sum() / own.sum()
    loss.backward()
    ent = -(logz.exp() * logz).sum(-1)
    return (float(loss), {n: p.grad for n, p in m64.named_parameters()}, float(ent[own].mean()),
            float(kl[own].mean()), int(own.sum()))


def _update(base, loss_fn, batch, adv, **kwargs):
    """One ``grpo_update`` of a copy of ``base`` (learning rate 0); returns its metrics and the gradients."""
    model = copy.deepcopy(base)
    grads = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return super().step(closure)

    out = grpo_update(model, loss_fn, Capture(model.parameters(), lr=0.0), batch, adv, micro_batch_size=G, **kwargs)
    return out, grads


@pytest.mark.parametrize("prompt_sharing", [False, True])
def test_update_counts_the_policy_tokens_only(multi_turn, prompt_sharing):
    base, rollout = multi_turn
    assert bool((rollout.completion_mask & ~rollout.sampled_mask).any())
    reference = _model(seed=1)  # a different policy, so the KL is not 0
    adv = torch.linspace(-1.0, 1.5, rollout.completion_tokens.shape[0])
    want_loss, want_grads, want_entropy, want_kl, want_tokens = _reference_update(
        base, reference, policy_batch(rollout), rollout, adv, beta=0.1)
    loss_fn = GRPOLoss(loss_type="dapo", beta=0.1, temperature=TEMPERATURE, impl="chunked")
    out, grads = _update(base, loss_fn, training_batch(rollout, prompt_sharing=prompt_sharing), adv,
                         reference=ReferencePolicy.frozen_copy(reference))
    assert out["num_loss_tokens"] == want_tokens
    assert out["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert out["entropy"] == pytest.approx(want_entropy, rel=1e-5)
    assert out["kl"] == pytest.approx(want_kl, rel=1e-4, abs=1e-8)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n].double(), g, rtol=1e-4, atol=1e-6, msg=n)


def test_labels_cover_exactly_the_sampled_tokens(multi_turn):
    _, rollout = multi_turn
    own = rollout.completion_mask & rollout.sampled_mask
    want = torch.where(own, rollout.completion_tokens, torch.full_like(rollout.completion_tokens, -100))
    assert torch.equal(policy_batch(rollout).head_labels, want)
    assert torch.equal(training_batch(rollout, prompt_sharing=True).head_labels, want)


def test_one_turn_rollouts_are_labelled_as_before(multi_turn):
    _, rollout = multi_turn
    single = dataclasses.replace(rollout, sampled_mask=None)
    assert single.loss_mask is single.completion_mask
    all_sampled = dataclasses.replace(rollout, sampled_mask=torch.ones_like(rollout.completion_mask))
    for sharing in (False, True):
        assert torch.equal(training_batch(single, prompt_sharing=sharing).head_labels,
                           training_batch(all_sampled, prompt_sharing=sharing).head_labels)
    labels = policy_batch(single).head_labels
    assert torch.equal(labels != -100, single.completion_mask)


def test_sampler_correction_weighs_and_measures_the_policy_tokens_only(multi_turn):
    """The sampler-trainer importance weight and its metrics read the sampled tokens only: context
    tokens carry a sampler log-prob far from the trainer's (-30: ratio e^30 if it were read), which
    would move the loss (truncated to the cap) and every mismatch metric."""
    base, rollout = multi_turn
    own = rollout.completion_mask & rollout.sampled_mask
    batch = policy_batch(rollout)
    p = rollout.prompt_tokens.shape[1]
    m64 = copy.deepcopy(base).double()
    logits = m64(batch.tokens, mask=batch.mask, input_pos=batch.input_pos)[:, p - 1:-1] / TEMPERATURE
    logp = torch.log_softmax(logits, -1).gather(-1, rollout.completion_tokens[..., None])[..., 0]
    n, t = own.shape
    offsets = torch.linspace(-1.5, 1.5, n * t, dtype=torch.float64).reshape(n, t)  # some ratios past the cap 3
    sampler = torch.where(own, logp.detach() - offsets, torch.full_like(logp, -30.0))
    adv = torch.linspace(-1.0, 1.5, n)
    d = (logp.detach() - sampler)[own]
    weight = torch.where(own, torch.clamp(torch.exp(logp.detach() - sampler), max=3.0), 0.0)
    want = (-weight * torch.exp(logp - logp.detach()) * adv.double()[:, None])[own].sum() / own.sum()
    want.backward()

    loss_fn = GRPOLoss(loss_type="dapo", beta=0.0, temperature=TEMPERATURE, impl="chunked",
                       sampler_correction=True, sampler_correction_mode="token_truncate",
                       sampler_correction_clip_max=3.0)
    out, grads = _update(base, loss_fn, training_batch(rollout, prompt_sharing=True), adv,
                         sampler_log_probs=sampler.float())
    assert out["loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-7)
    assert out["sampling/logp_difference/mean"] == pytest.approx(float(d.abs().mean()), rel=1e-5)
    assert out["sampling/logp_difference/max"] == pytest.approx(float(d.abs().max()), rel=1e-5)
    assert out["sampling/ratio_outside_cap"] == pytest.approx(float((d.abs() > torch.log(torch.tensor(3.0))).double()
                                                                    .mean()), rel=1e-6)
    assert out["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)
    for name, g in ((n, p.grad) for n, p in m64.named_parameters()):
        torch.testing.assert_close(grads[name].double(), g, rtol=1e-4, atol=1e-6, msg=name)
