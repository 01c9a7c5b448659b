"""GRPOLoss(fused=True) against fused=False and a dense float64 reference: every loss_type with
clipping, epsilon_high, k3 KL, entropy bonus, truncation masking and micro-batch normalisation;
loss values, gradients and metrics; impls reference, chunked and triton (CPU interpreter).
Without CUDA the Triton kernels run in Triton's CPU interpreter (set up by ``tests/conftest.py``).
"""

import math

import pytest
import torch

_CUDA = torch.cuda.is_available()
try:
    from logitless.ops.triton import head
except ImportError:  # no triton: the triton cases are skipped
    head = None
from logitless.losses.grpo import GRPOLoss
from logitless.modules import HeadInput


IGN = -100
T = 0.8
DEV = "cuda" if _CUDA else "cpu"


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    if head is None:
        return
    # 5 rows per chunk: several row chunks and column splits in every call.
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 5 * 37 * 4)
    monkeypatch.setattr(head, "FORWARD_WORKSPACE_BYTES", 8 * 32 * 4)
    monkeypatch.setattr(head, "MAX_BLOCK_ROWS", 8)
    monkeypatch.setattr(head, "MIN_SLAB", 32)


def _inputs(seed=0, b=6, s=9, h=12, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.6
    labels = torch.randint(0, v, (b, s), generator=g)
    for i, n in enumerate([5, 6, 2, 1, 4, 3]):  # prompts of 2 tokens, completions of different lengths
        labels[i, :2] = IGN
        labels[i, 2 + n:] = IGN
    logits = hidden @ weight.T / T
    cur = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    # old/ref log-probs near the current ones: ratios spread over both sides of the clip range
    old = torch.where(labels != IGN, cur + 0.35 * torch.randn(b, s, generator=g, dtype=torch.float64), 0.0)
    ref = torch.where(labels != IGN, cur + 0.3 * torch.randn(b, s, generator=g, dtype=torch.float64), 0.0)
    adv = torch.tensor([1.2, -0.8, 0.5, -1.5, 0.9, -0.6], dtype=torch.float64)
    return hidden, weight, labels, adv, old, ref


def _dense_reference(hidden, weight, labels, adv, old, ref, *, loss_type, eps=0.2, eps_hi=0.28, beta=0.0,
                     ent_coef=0.0, truncated=None, total_sequences=None, total_tokens=None, num_micro=1,
                     max_len=7):
    """Float64 GRPO loss from the full logits, vectorised (shares nothing with GRPOLoss)."""
    logsm = torch.log_softmax(hidden @ weight.T / T, -1)
    valid = labels != IGN
    lp = logsm.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    r = torch.exp(lp - old)
    a = adv[:, None]
    terms = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps_hi) * a)
    terms = terms + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    m = (valid & ~truncated[:, None]) if truncated is not None else valid
    m = m.double()
    nseq = labels.shape[0] if total_sequences is None else total_sequences
    ntok = m.sum() if total_tokens is None else total_tokens
    bonus = ent_coef * (ent * m).sum() / ntok  # mean entropy per loss token, every loss_type
    if loss_type == "grpo":
        return ((terms * m).sum(1) / m.sum(1).clamp(min=1)).sum() / nseq - bonus
    if loss_type == "bnpo":
        return (terms * m).sum() / m.sum() / num_micro - bonus
    if loss_type == "dr_grpo":
        return (terms * m).sum() / (nseq * max_len) - bonus
    return (terms * m).sum() / ntok - bonus


def _run(fused, impl, loss_kwargs, call_kwargs, inputs, dtype=torch.float32):
    hidden, weight, labels, adv, old, ref = inputs
    h = hidden.to(dtype).to(DEV).requires_grad_()
    w = weight.to(dtype).to(DEV).requires_grad_()
    fn = GRPOLoss(temperature=T, impl=impl, fused=fused, max_completion_length=7, **loss_kwargs)
    assert fn.fused is fused
    kw = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in call_kwargs.items()}
    loss, metrics = fn(HeadInput(h, w), labels.to(DEV), adv.to(DEV), **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad, metrics


def _impls():
    out = ["reference", "chunked"]
    out.append(pytest.param("triton", marks=pytest.mark.skipif(head is None, reason="no triton")))
    return out


SCENARIO = dict(epsilon=0.2, epsilon_high=0.28, beta=0.1, entropy_coef=0.03,
                mask_truncated_completions=True)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_fused_equals_unfused_and_reference(loss_type, impl):
    inputs = _inputs(seed=7)  # a seed with clipped tokens on both sides
    hidden, weight, labels, adv, old, ref = inputs
    truncated = torch.tensor([False, True, False, False, False, False])
    call = dict(old_log_probs=old.float(), ref_log_probs=ref.float(), truncated=truncated,
                total_sequences=8, total_tokens=19, num_micro_batches=2)
    lk = dict(SCENARIO, loss_type=loss_type)
    got = _run(True, impl, lk, call, inputs)
    base = _run(False, impl, lk, call, inputs)
    # fused vs unfused: same value, gradients and metrics
    tol = dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got[0], base[0], **tol)
    torch.testing.assert_close(got[1], base[1], **tol)
    torch.testing.assert_close(got[2], base[2], **tol)
    assert sorted(got[3]) == sorted(base[3])
    for k in got[3]:
        torch.testing.assert_close(got[3][k].double(), base[3][k].double(), **tol, msg=k)
    # clipping is exercised on both sides
    assert float(got[3]["clip_ratio/low"]) > 0 and float(got[3]["clip_ratio/high"]) > 0
    # both against the dense float64 reference
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = _dense_reference(h64, w64, labels, adv, old.float().double(), ref.float().double(),
                            loss_type=loss_type, beta=0.1, ent_coef=0.03, truncated=truncated,
                            total_sequences=8, total_tokens=19, num_micro=2)
    want.backward()
    assert abs(float(want)) > 1e-3
    assert math.isclose(float(got[0]), float(want), rel_tol=1e-5, abs_tol=1e-6)
    torch.testing.assert_close(got[1].double().cpu(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[2].double().cpu(), w64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", _impls())
def test_fused_without_old_and_kl_metric_only(impl):
    """old_log_probs=None (ratio 1, as with one iteration), a reference with beta=0 (KL metric only)."""
    inputs = _inputs(seed=2)
    call = dict(ref_log_probs=inputs[5].float())
    lk = dict(loss_type="dapo", beta=0.0)
    got = _run(True, impl, lk, call, inputs)
    base = _run(False, impl, lk, call, inputs)
    tol = dict(rtol=2e-5, atol=1e-6)
    for a, b in zip(got[:3], base[:3]):
        torch.testing.assert_close(a, b, **tol)
    assert "kl" in got[3] and float(got[3]["kl"]) > 0
    for k in got[3]:
        torch.testing.assert_close(got[3][k], base[3][k], **tol, msg=k)


@pytest.mark.skipif(head is None, reason="no triton")
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_triton_two_pass_fallback(monkeypatch, loss_type):
    # More row chunks than FUSED_MAX_CHUNKS: slab forward + slab backward with the same a, b.
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 0)
    inputs = _inputs(seed=3)
    call = dict(old_log_probs=inputs[4].float(), ref_log_probs=inputs[5].float(), total_sequences=6)
    lk = dict(SCENARIO, loss_type=loss_type)
    got = _run(True, "triton", lk, call, inputs)
    base = _run(False, "chunked", lk, call, inputs)
    for a, b in zip(got[:3], base[:3]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)


def test_fused_default_and_sequence_level():
    assert GRPOLoss().fused is True
    assert GRPOLoss(importance_sampling_level="sequence").fused is False
    with pytest.raises(ValueError, match="fused"):
        GRPOLoss(importance_sampling_level="sequence", fused=True)
    with pytest.raises(ValueError, match="fused"):
        GRPOLoss(fused="yes")
