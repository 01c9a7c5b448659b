"""Objective fused with the head (gradients in the forward) against autograd through the reference."""

import pytest
import torch

from logitless.ops import chunked, reference


def _clipped_policy_terms(logp, ent, old, adv, weight, eps=0.2, kl_ref=None, beta=0.0, ent_coef=0.0):
    ratio = torch.exp(logp - old)
    terms = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    if kl_ref is not None:
        d = kl_ref - logp
        terms = terms + beta * (torch.exp(d) - d - 1)
    if ent is not None:
        terms = terms - ent_coef * ent
    return (terms * weight).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_entropy", [True, False])
def test_fused_policy_objective_matches_autograd(dtype, need_entropy):
    g = torch.Generator().manual_seed(0)
    n, h, v = 29, 16, 311
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / 4).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    valid = (labels != -100).float()
    with torch.no_grad():
        base, _ = reference.log_probs(hidden.double(), weight.double(), labels, temperature=0.8)
    old = (base + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    ref = (base + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(n, generator=g)
    wts = valid / valid.sum()
    kw = dict(kl_ref=ref, beta=0.05, ent_coef=0.01 if need_entropy else 0.0)

    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    lp, ent = reference.log_probs(h64, w64, labels, temperature=0.8)
    want = _clipped_policy_terms(lp, ent if need_entropy else None, old.double(), adv.double(), wts.double(),
                                 **{**kw, "kl_ref": ref.double()})
    want.backward()

    seen = []

    def objective(lp, ent, rows):
        seen.append(rows)
        return _clipped_policy_terms(lp, ent, old[rows], adv[rows], wts[rows], **{**kw, "kl_ref": ref[rows]})

    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got, got_lp, got_ent = chunked.linear_token_objective(
        hh, ww, labels, objective, temperature=0.8, need_entropy=need_entropy, chunk_size=6
    )
    (got * 1.5).backward()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-3)
    torch.testing.assert_close(got.double(), want.detach(), **tol)
    torch.testing.assert_close(got_lp.double(), lp.detach(), **tol)
    torch.testing.assert_close((hh.grad.double() / 1.5), h64.grad, **tol)
    torch.testing.assert_close((ww.grad.double() / 1.5), w64.grad, **tol)
    assert (got_ent is not None) == need_entropy
    # every non-ignored row is passed exactly once, ignored rows never
    assert torch.equal(torch.cat(seen).sort().values, torch.nonzero(labels != -100).squeeze(1))
