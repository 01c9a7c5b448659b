"""chunked and torch implementations against the float64 reference, over a sweep of shapes.

Bounds (DESIGN.md): each of loss, dh, dW has ||a - ref|| / ||ref|| at most 1.5x plain PyTorch's on the
same bf16 inputs (plain = logits in the input dtype, loss in fp32, autograd), with a floor for fp32
where both are at rounding level.
"""

import shutil

import pytest
import torch

import logitless
from logitless.ops import reference

# (N, H, V, chunk_size): odd V from real vocabularies, N not a multiple of the chunk.
SHAPES = [
    (7, 8, 151936, 3),
    (9, 16, 50257, 4),
    (33, 24, 32001, 8),
    (64, 32, 1000, None),
    (5, 8, 128256, 5),
]
IMPLS = ["chunked", "reference"]


def _rel(a, ref):
    ref = ref.double()
    denom = ref.norm()
    return ((a.double() - ref).norm() / denom).item() if denom > 0 else (a.double() - ref).norm().item()


def _inputs(n, h, v, dtype, seed, ignore="some"):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(dtype)
    # Shift to all-negative logits on some rows, which a 0 tile padding would get wrong.
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore == "some":
        labels[torch.rand(n, generator=g) < 0.3] = -100
    elif ignore == "all":
        labels[:] = -100
    return hidden, weight, labels


def _run(fn, hidden, weight, labels, upstream):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    out = fn(h, w, labels)
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o * u.to(o.dtype)).sum() for o, u in zip(outs, upstream) if o is not None)
    total.backward()
    return [o.detach() for o in outs if o is not None], h.grad, w.grad


def _check(errors, plain, floor):
    for name, err, base in zip(("out", "dh", "dW"), errors, plain):
        assert err <= max(1.5 * base, floor), f"{name}: error {err:.3g} vs plain PyTorch {base:.3g}"


@pytest.mark.parametrize("n,h,v,chunk", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", IMPLS)
def test_cross_entropy_matches_float64(n, h, v, chunk, dtype, reduction, impl):
    hidden, weight, labels = _inputs(n, h, v, dtype, seed=n + v)
    temperature = 0.7
    up = [torch.randn(n) if reduction == "none" else torch.tensor(1.7)]

    def ours(hh, ww, y):
        return logitless.linear_cross_entropy(
            hh, ww, y, reduction=reduction, temperature=temperature, impl=impl, chunk_size=chunk
        )

    def plain(hh, ww, y):
        return reference.cross_entropy(hh, ww, y, reduction=reduction, temperature=temperature)

    ref_out, ref_dh, ref_dw = _run(plain, hidden.double(), weight.double(), labels, [u.double() for u in up])
    got = _run(ours, hidden, weight, labels, up)
    base = _run(plain, hidden, weight, labels, up)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    errors = [_rel(got[0][0], ref_out[0]), _rel(got[1], ref_dh), _rel(got[2], ref_dw)]
    plain_err = [_rel(base[0][0], ref_out[0]), _rel(base[1], ref_dh), _rel(base[2], ref_dw)]
    _check(errors, plain_err, 1e-5 if dtype == torch.float32 else 0.0)


@pytest.mark.parametrize("n,h,v,chunk", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("return_entropy", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_log_probs_and_entropy_match_float64(n, h, v, chunk, dtype, return_entropy, impl):
    hidden, weight, labels = _inputs(n, h, v, dtype, seed=3 * n + v)
    up = [torch.randn(n), torch.randn(n)]

    def ours(hh, ww, y):
        return logitless.linear_log_probs(
            hh, ww, y, temperature=1.3, return_entropy=return_entropy, impl=impl, chunk_size=chunk
        )

    def plain(hh, ww, y):
        return reference.log_probs(hh, ww, y, temperature=1.3, return_entropy=return_entropy)

    ref = _run(plain, hidden.double(), weight.double(), labels, [u.double() for u in up])
    got = _run(ours, hidden, weight, labels, up)
    base = _run(plain, hidden, weight, labels, up)
    assert all(o.dtype == torch.float32 for o in got[0])
    floor = 1e-5 if dtype == torch.float32 else 0.0
    for k in range(len(ref[0])):
        assert _rel(got[0][k], ref[0][k]) <= max(1.5 * _rel(base[0][k], ref[0][k]), floor)
    _check([0.0, _rel(got[1], ref[1]), _rel(got[2], ref[2])], [0.0, _rel(base[1], ref[1]), _rel(base[2], ref[2])], floor)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_gives_zero_loss_and_zero_grads(impl, reduction):
    hidden, weight, labels = _inputs(6, 8, 50, torch.float32, seed=5, ignore="all")
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    loss = logitless.linear_cross_entropy(h, w, labels, reduction=reduction, impl=impl, chunk_size=4)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_no_ignored_labels_and_batched_shape():
    hidden, weight, labels = _inputs(12, 8, 97, torch.float64, seed=7, ignore="none")
    got = logitless.linear_cross_entropy(hidden.view(3, 4, 8), weight, labels.view(3, 4), reduction="none", impl="chunked", chunk_size=5)
    want = reference.cross_entropy(hidden, weight, labels, reduction="none")
    assert got.shape == (3, 4)
    torch.testing.assert_close(got.reshape(-1), want, rtol=1e-10, atol=1e-10)


def test_all_negative_logits():
    hidden, weight, labels = _inputs(8, 8, 301, torch.float32, seed=9, ignore="none")
    hidden = hidden.abs()
    weight = -weight.abs() - 1.0  # every logit < 0
    got_lp, got_ent = logitless.linear_log_probs(hidden, weight, labels, impl="chunked", chunk_size=3)
    want_lp, want_ent = reference.log_probs(hidden.double(), weight.double(), labels)
    torch.testing.assert_close(got_lp.double(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent.double(), want_ent, rtol=1e-5, atol=1e-5)


def test_forward_only_under_no_grad_keeps_no_graph():
    hidden, weight, labels = _inputs(10, 8, 50, torch.float32, seed=11)
    hidden.requires_grad_()
    with torch.no_grad():
        loss = logitless.linear_cross_entropy(hidden, weight, labels, impl="chunked", chunk_size=3)
    assert loss.grad_fn is None
    want = reference.cross_entropy(hidden.detach().double(), weight.double(), labels)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)


def test_gradient_only_for_entropy_or_only_for_logp():
    hidden, weight, labels = _inputs(10, 8, 60, torch.float64, seed=13)
    for which in (0, 1):
        h = hidden.clone().requires_grad_()
        out = logitless.linear_log_probs(h, weight, labels, impl="chunked", chunk_size=4)[which]
        out.sum().backward()
        h64 = hidden.clone().requires_grad_()
        reference.log_probs(h64, weight, labels)[which].sum().backward()
        torch.testing.assert_close(h.grad, h64.grad, rtol=1e-9, atol=1e-10)


def _epilogue_case(offset=0.0):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(37, 53, generator=g, dtype=torch.float64) * 4 + offset
    labels = torch.randint(0, 53, (37,), generator=g)
    valid = torch.rand(37, generator=g) > 0.3
    safe = torch.where(valid, labels, 0).unsqueeze(1)
    g_lp, g_ent = torch.randn(2, 37, generator=g, dtype=torch.float64)
    return z, labels, valid, safe, g_lp, g_ent


def _epilogue_checks(ep, in_place):
    """``ep``'s ce / stats / grad against float64 autograd of the same per-chunk math."""
    z, labels, valid, safe, g_lp, g_ent = _epilogue_case()
    coef = torch.tensor(0.25, dtype=torch.float64)
    zz = z.clone().requires_grad_(True)
    ref = (torch.nn.functional.cross_entropy(zz, labels, reduction="none") * valid).sum()
    ref.backward()
    loss, grad = ep.ce(z.clone(), safe, valid, coef, torch.float64)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(grad, zz.grad * coef)

    zz = z.clone().requires_grad_(True)
    logq = zz.log_softmax(-1)
    r_logp = torch.where(valid, logq.gather(1, safe).squeeze(1), 0.0)
    r_ent = torch.where(valid, -(logq.exp() * logq).sum(-1), 0.0)
    inv_t = 0.5  # the raw logits were divided by T = 2 before the epilogue
    ((r_logp * g_lp).sum() + (r_ent * g_ent).sum()).backward()
    for need_entropy, g_e in ((True, g_ent), (False, None)):
        zc = z.clone()
        logp, ent, m, log_s = ep.stats(zc, safe, valid, need_entropy)
        torch.testing.assert_close(logp, r_logp.detach())
        if need_entropy:
            torch.testing.assert_close(ent, r_ent.detach())
        else:
            assert ent is None
        if in_place:  # zc holds log q
            m = log_s = None
        grad = ep.grad(zc, m, log_s, ent, g_lp, g_e, safe, valid, inv_t, torch.float64)
        zz2 = z.clone().requires_grad_(True)
        lq = zz2.log_softmax(-1)
        obj = (torch.where(valid, lq.gather(1, safe).squeeze(1), 0.0) * g_lp).sum()
        if need_entropy:
            obj = obj + (torch.where(valid, -(lq.exp() * lq).sum(-1), 0.0) * g_ent).sum()
        obj.backward()
        torch.testing.assert_close(grad, zz2.grad * inv_t)
    # an entropy-only upstream
    zc = z.clone()
    _, ent, m, log_s = ep.stats(zc, safe, valid, True)
    if in_place:
        m = log_s = None
    grad = ep.grad(zc, m, log_s, ent, None, g_ent, safe, valid, 1.0, torch.float64)
    zz3 = z.clone().requires_grad_(True)
    lq = zz3.log_softmax(-1)
    (torch.where(valid, -(lq.exp() * lq).sum(-1), 0.0) * g_ent).sum().backward()
    torch.testing.assert_close(grad, zz3.grad)


def test_chunk_epilogues_in_place_and_fusible_match_autograd():
    """The in-place epilogues (CPU) and the fusible ones (compiled on CUDA), run eagerly."""
    from types import SimpleNamespace

    from logitless.ops import _chunk_epilogues as E

    _epilogue_checks(E.epilogues_for(torch.zeros(1)), in_place=True)
    _epilogue_checks(SimpleNamespace(ce=E.ce_fusible, stats=E.stats_fusible, grad=E.grad_fusible), in_place=False)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_compiled_chunk_epilogues_equal_the_eager_ones():
    """What CUDA runs, compiled by inductor (here for the CPU): the same numbers as eager."""
    from types import SimpleNamespace

    from logitless.ops import _chunk_epilogues as E

    torch._dynamo.reset()
    compiled = SimpleNamespace(**{k: torch.compile(getattr(E, f"{k}_fusible"), dynamic=True)
                                  for k in ("ce", "stats", "grad")})
    _epilogue_checks(compiled, in_place=False)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_epilogues_take_raw_half_logits_and_divide_by_the_temperature(half):
    """CUDA's compiled epilogues get the chunk's logits in the inputs' half dtype, undivided: upcast,
    divided by T, they give float64 autograd's log-probs, entropies, losses and gradients w.r.t. the
    raw logits to fp32 rounding, as the in-place ones do on the float32 logits."""
    from logitless.ops import _chunk_epilogues as E

    z64, labels, valid, safe, g_lp, g_ent = _epilogue_case(offset=3.0)
    z = z64.to(half)  # the GEMM's half logits
    t, coef = 0.7, 0.25
    zz = z.double().requires_grad_(True)
    logq = (zz / t).log_softmax(-1)
    r_logp = torch.where(valid, logq.gather(1, safe).squeeze(1), 0.0)
    r_ent = torch.where(valid, -(logq.exp() * logq).sum(-1), 0.0)
    ((r_logp * g_lp).sum() + (r_ent * g_ent).sum()).backward()
    zc = z.double().requires_grad_(True)
    r_loss = (torch.nn.functional.cross_entropy(zc / t, labels, reduction="none") * valid).sum()
    r_loss.backward()
    tol = dict(rtol=2e-5, atol=2e-6)
    for name, raw in (("fusible", z), ("in place", z.float())):
        ce, stats, grad = (getattr(E, f"{k}_{'fusible' if name == 'fusible' else 'eager'}") for k in ("ce", "stats", "grad"))
        loss, dz = ce(raw.clone(), safe, valid, coef / t, torch.float32, temperature=t)
        torch.testing.assert_close(loss.double() * coef, r_loss.detach() * coef, **tol)
        torch.testing.assert_close(dz.double(), zc.grad * coef, **tol)
        zs = raw.clone()
        logp, ent, m, log_s = stats(zs, safe, valid, True, temperature=t)
        torch.testing.assert_close(logp.double(), r_logp.detach(), **tol)
        torch.testing.assert_close(ent.double(), r_ent.detach(), **tol)
        if name == "in place":  # zs holds log q: the gradient takes it as it is
            dz = grad(zs, None, None, ent, g_lp.float(), g_ent.float(), safe, valid, 1.0 / t, torch.float32,
                      temperature=t)
        else:
            dz = grad(raw, m, log_s, ent, g_lp.float(), g_ent.float(), safe, valid, 1.0 / t, torch.float32,
                      temperature=t)
        torch.testing.assert_close(dz.double(), zz.grad, **tol)
