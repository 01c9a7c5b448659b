"""GRPOLoss against a hand-written float64 reference: every loss_type, clipping, KL, entropy bonus,
sequence-level ratios, truncation masking, micro-batch accumulation, and bad inputs."""

import math

import pytest
import torch

from logitless.losses import LossUnits
from logitless.losses.grpo import GRPOLoss
from logitless.modules import HeadInput

IGN = -100
T = 0.7


def make_inputs(seed=0, b=4, s=7, h=8, v=13):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, v, (b, s), generator=g)
    # completions of different lengths; prompt positions (first 2) ignored; row 3 has one token
    lengths = [4, 5, 2, 1]
    for i, n in enumerate(lengths):
        labels[i, :2] = IGN
        labels[i, 2 + n:] = IGN
    adv = torch.tensor([1.5, -0.7, 0.3, -2.0], dtype=torch.float64)
    old = torch.randn(b, s, generator=g, dtype=torch.float64) * 0.3 - 2.0
    ref = torch.randn(b, s, generator=g, dtype=torch.float64) * 0.3 - 2.0
    return hidden, weight, labels, adv, old, ref


def reference_loss(hidden, weight, labels, adv, old, ref, *, loss_type, eps_lo=0.2, eps_hi=0.28, beta=0.0,
                   ent_coef=0.0, level="token", truncated=None, max_len=None, total_seqs=None, total_tokens=None,
                   num_micro=1):
    """Plain float64 GRPO loss written out token by token (no code shared with the implementation)."""
    logits = hidden @ weight.T / T
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    logsm = logits - logz
    b, s = labels.shape
    seq_terms, all_terms, count, entropies = [], [], 0, []
    for i in range(b):
        if truncated is not None and truncated[i]:
            seq_terms.append([])
            continue
        toks = [t for t in range(s) if labels[i, t] != IGN]
        lps = {t: logsm[i, t, labels[i, t]] for t in toks}
        if level == "sequence" and toks:
            seq_lr = sum(lps[t] - old[i, t] for t in toks) / len(toks)
        terms = []
        for t in toks:
            log_ratio = seq_lr if level == "sequence" else lps[t] - old[i, t]
            r = torch.exp(log_ratio)
            a = adv[i]
            term = -torch.minimum(r * a, torch.clamp(r, 1 - eps_lo, 1 + eps_hi) * a)
            if beta:
                d = ref[i, t] - lps[t]
                term = term + beta * (torch.exp(d) - d - 1)
            if ent_coef:
                p = torch.softmax(logits[i, t], -1)
                entropies.append(-(p * torch.log(p)).sum())
            terms.append(term)
        seq_terms.append(terms)
        all_terms += terms
        count += len(terms)
    total_seqs = b if total_seqs is None else total_seqs
    zero = hidden.sum() * 0
    # the entropy bonus: the mean entropy per loss token of the batch, whatever the loss_type
    bonus = ent_coef * sum(entropies, zero) / max(count if total_tokens is None else total_tokens, 1)
    if loss_type == "grpo":
        return sum((sum(t) / len(t) for t in seq_terms if t), zero) / total_seqs - bonus
    if loss_type == "bnpo":
        return sum(all_terms, zero) / max(count, 1) / num_micro - bonus
    if loss_type == "dr_grpo":
        return sum(all_terms, zero) / (total_seqs * max_len) - bonus
    return sum(all_terms, zero) / max(count if total_tokens is None else total_tokens, 1) - bonus


def run_both(loss_kwargs, ref_kwargs, call_kwargs=None, seed=0, impl="reference"):
    hidden, weight, labels, adv, old, ref = make_inputs(seed)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fn = GRPOLoss(temperature=T, impl=impl, **loss_kwargs)
    call_kwargs = dict(call_kwargs or {})
    got, metrics = fn(HeadInput(h1, w1), labels, adv, old_log_probs=old, ref_log_probs=ref, **call_kwargs)
    got.backward()
    want = reference_loss(h2, w2, labels, adv, old, ref, **ref_kwargs)
    want.backward()
    return got, want, (h1.grad, w1.grad), (h2.grad, w2.grad), metrics


def assert_close(got, want, grads_got, grads_want, tol=1e-5):
    assert math.isclose(float(got), float(want), rel_tol=tol, abs_tol=tol), (float(got), float(want))
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_loss_types_match_reference(loss_type, impl):
    kw = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, max_completion_length=6)
    got, want, gg, gw, _ = run_both(kw, dict(loss_type=loss_type, max_len=6), impl=impl)
    assert abs(float(want.detach())) > 1e-3  # non-trivial
    assert_close(got, want, gg, gw)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_kl_entropy_and_sequence_level(loss_type):
    kw = dict(loss_type=loss_type, beta=0.1, entropy_coef=0.03, importance_sampling_level="sequence")
    got, want, gg, gw, metrics = run_both(kw, dict(loss_type=loss_type, beta=0.1, ent_coef=0.03, level="sequence"))
    assert_close(got, want, gg, gw)
    assert "kl" in metrics and float(metrics["kl"]) > 0


def test_kl_metric_is_mean_k3():
    hidden, weight, labels, adv, old, ref = make_inputs(1)
    fn = GRPOLoss(beta=0.5, temperature=T, impl="reference")
    _, metrics = fn(HeadInput(hidden, weight), labels, adv, old_log_probs=old, ref_log_probs=ref)
    logsm = torch.log_softmax(hidden @ weight.T / T, -1)
    vals = []
    for i, t in (labels != IGN).nonzero().tolist():
        d = float(ref[i, t] - logsm[i, t, labels[i, t]])
        vals.append(math.exp(d) - d - 1)
    assert math.isclose(float(metrics["kl"]), sum(vals) / len(vals), rel_tol=1e-5)


def test_clip_fractions_and_clipped_gradient():
    """Tokens whose ratio lies outside the clip range on the advantage's side get no gradient."""
    hidden, weight, labels, _, _, _ = make_inputs(2)
    fn = GRPOLoss(epsilon=0.2, epsilon_high=0.2, temperature=T, impl="reference", loss_type="dapo")
    logp = fn.log_probs(HeadInput(hidden, weight), labels)
    mask = labels != IGN
    # ratios: row 0 -> 1.5 (A>0: clipped high), row 1 -> 0.5 (A<0: clipped low), rows 2, 3 -> 1.1 (inside)
    shift = torch.tensor([math.log(1.5), math.log(0.5), math.log(1.1), math.log(1.1)], dtype=torch.float64)
    old = torch.where(mask, logp - shift[:, None], torch.zeros_like(logp))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    h = hidden.clone().requires_grad_()
    loss, metrics = fn(HeadInput(h, weight), labels, adv, old_log_probs=old)
    loss.backward()
    n = mask.sum(1).double()
    assert math.isclose(float(metrics["clip_ratio/high"]), float(n[0] / n.sum()), rel_tol=1e-6)
    assert math.isclose(float(metrics["clip_ratio/low"]), float(n[1] / n.sum()), rel_tol=1e-6)
    assert math.isclose(float(metrics["clip_ratio/region"]), float((n[0] + n[1]) / n.sum()), rel_tol=1e-6)
    assert h.grad[0].abs().max() == 0 and h.grad[1].abs().max() == 0
    assert h.grad[2].abs().max() > 0 and h.grad[3].abs().max() > 0
    # value: clipped rows contribute -clip(r) * A, the others -r * A
    want = (-(1.2 * 1.0) * n[0] - (0.8 * -1.0) * n[1] - (1.1 * 1.0) * n[2] - (1.1 * -1.0) * n[3]) / n.sum()
    assert math.isclose(float(loss), float(want), rel_tol=1e-6)


def test_ratio_one_gives_policy_gradient():
    """Without old log-probs (num_iterations == 1) the gradient is -A * grad(logp) / tokens."""
    hidden, weight, labels, adv, _, _ = make_inputs(3)
    fn = GRPOLoss(temperature=T, impl="reference", loss_type="dapo")
    h = hidden.clone().requires_grad_()
    loss, metrics = fn(HeadInput(h, weight), labels, adv)
    loss.backward()
    h2 = hidden.clone().requires_grad_()
    logsm = torch.log_softmax(h2 @ weight.T / T, -1)
    mask = labels != IGN
    lp = logsm.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    (-(adv[:, None] * lp * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-6, atol=1e-9)
    want = -(adv[:, None] * mask).sum() / mask.sum()  # ratio 1: the loss is minus the mean advantage per token
    assert math.isclose(float(loss), float(want), rel_tol=1e-9) and float(metrics["clip_ratio/region"]) == 0


def test_truncated_completions_masked():
    trunc = torch.tensor([False, True, False, False])
    kw = dict(loss_type="dapo", mask_truncated_completions=True)
    got, want, gg, gw, metrics = run_both(kw, dict(loss_type="dapo", truncated=trunc), {"truncated": trunc})
    assert_close(got, want, gg, gw)
    assert gg[0][1].abs().max() == 0
    assert int(metrics["num_tokens"]) == 4 + 2 + 1


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_micro_batches_add_up_to_the_full_batch(loss_type):
    """Summing the micro-batch losses (with the batch totals passed in) gives the loss the recipe means."""
    hidden, weight, labels, adv, old, ref = make_inputs(4)
    fn = GRPOLoss(temperature=T, impl="reference", loss_type=loss_type, max_completion_length=6, epsilon_high=0.28)
    total_tokens = fn.num_loss_tokens(labels)
    parts = []
    for rows in (slice(0, 2), slice(2, 4)):
        loss, _ = fn(HeadInput(hidden[rows], weight), labels[rows], adv[rows], old_log_probs=old[rows],
                     total_sequences=4, total_tokens=total_tokens, num_micro_batches=2)
        parts.append(loss)
    if loss_type == "bnpo":  # token mean per micro-batch, averaged over micro-batches (as TRL)
        want = sum(reference_loss(hidden[r], weight, labels[r], adv[r], old[r], ref[r], loss_type="bnpo")
                   for r in (slice(0, 2), slice(2, 4))) / 2
    else:
        want = reference_loss(hidden, weight, labels, adv, old, ref, loss_type=loss_type, max_len=6)
    assert math.isclose(float(sum(parts)), float(want), rel_tol=1e-6)


def test_dapo_counts_tokens_of_the_whole_accumulated_batch():
    hidden, weight, labels, adv, old, ref = make_inputs(5)
    fn = GRPOLoss(temperature=T, impl="reference", loss_type="dapo")
    full, _ = fn(HeadInput(hidden, weight), labels, adv, old_log_probs=old)
    part, _ = fn(HeadInput(hidden[:1], weight), labels[:1], adv[:1], old_log_probs=old[:1],
                 total_tokens=fn.num_loss_tokens(labels))
    rest, _ = fn(HeadInput(hidden[1:], weight), labels[1:], adv[1:], old_log_probs=old[1:],
                 total_tokens=fn.num_loss_tokens(labels))
    assert math.isclose(float(part + rest), float(full), rel_tol=1e-9)


def test_no_completion_tokens_gives_zero_loss_and_grads():
    hidden, weight, labels, adv, old, _ = make_inputs(6)
    labels = torch.full_like(labels, IGN)
    h = hidden.clone().requires_grad_()
    for lt in ("grpo", "bnpo", "dapo"):
        loss, _ = GRPOLoss(temperature=T, impl="reference", loss_type=lt)(HeadInput(h, weight), labels, adv)
        loss.backward()
        assert float(loss) == 0 and torch.isfinite(h.grad).all() and h.grad.abs().max() == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="ppo"), "loss_type"),
    (dict(epsilon=-0.1), "epsilon"),
    (dict(beta=float("nan")), "beta"),
    (dict(importance_sampling_level="seq"), "importance_sampling_level"),
    (dict(loss_type="dr_grpo"), "max_completion_length"),
    (dict(temperature=0.0), "temperature"),
    (dict(impl="cuda"), "impl"),
])
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLoss(**kwargs)


def test_bad_call_arguments():
    hidden, weight, labels, adv, old, _ = make_inputs(7)
    fn = GRPOLoss(temperature=T, impl="reference")
    head = HeadInput(hidden, weight)
    with pytest.raises(ValueError, match="advantages must have shape"):
        fn(head, labels, adv[:3])
    with pytest.raises(ValueError, match="NaN"):
        fn(head, labels, torch.tensor([1.0, float("nan"), 0.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="old_log_probs must have"):
        fn(head, labels, adv, old_log_probs=old[:, :3])
    with pytest.raises(ValueError, match="truncated must have shape"):
        fn(head, labels, adv, truncated=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="ref_log_probs"):
        GRPOLoss(beta=0.1, temperature=T, impl="reference")(head, labels, adv)
    with pytest.raises(ValueError, match="HeadInput"):
        fn(hidden @ weight.T, labels, adv)


def test_set_model_output_puts_model_in_hidden_mode():
    from logitless.models import qwen2_5_tiny

    model = qwen2_5_tiny(num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, intermediate_dim=64)
    GRPOLoss().set_model_output(model)
    out = model(torch.randint(0, 100, (2, 5)))
    assert isinstance(out, HeadInput) and out.hidden.shape == (2, 5, 32)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_contract_passes_the_steps_counts_and_weights_the_metrics(loss_type):
    """normalised_loss: the micro-batches' shares add up to the whole batch's loss (with the counts
    of the step from loss_units), and each metric's shares to its token mean over the batch."""
    hidden, weight, labels, adv, old, ref = make_inputs(8)
    truncated = torch.tensor([False, False, True, False])
    fn = GRPOLoss(temperature=T, impl="reference", loss_type=loss_type, max_completion_length=6, epsilon_high=0.28,
                  beta=0.1, mask_truncated_completions=True)
    parts = [slice(0, 2), slice(2, 4)]
    units = [fn.loss_units(labels[r], truncated[r]) for r in parts]
    total = LossUnits.total(units)
    assert total == LossUnits(tokens=4 + 5 + 1, sequences=4, micro_batches=2)  # row 2 (2 tokens) truncated
    shares = [fn.normalised_loss(HeadInput(hidden[r], weight), labels[r], total, advantages=adv[r],
                                 old_log_probs=old[r], ref_log_probs=ref[r], truncated=truncated[r]) for r in parts]
    if loss_type == "bnpo":  # token mean per micro-batch, averaged over the micro-batches
        want = sum(reference_loss(hidden[r], weight, labels[r], adv[r], old[r], ref[r], loss_type="bnpo", beta=0.1,
                                  truncated=truncated[r]) for r in parts) / 2
    else:
        want = reference_loss(hidden, weight, labels, adv, old, ref, loss_type=loss_type, max_len=6, beta=0.1,
                              truncated=truncated)
    assert math.isclose(float(sum(s.loss for s in shares)), float(want), rel_tol=1e-6)
    logz = torch.log_softmax(hidden @ weight.T / T, dim=-1)
    ent = -(logz.exp() * logz).sum(-1)
    mask = (labels != IGN) & ~truncated[:, None]
    got = sum(s.metrics["entropy"] for s in shares)
    assert "num_tokens" not in shares[0].metrics
    assert math.isclose(float(got), float(ent[mask].mean()), rel_tol=1e-6)
