"""A NaN or inf in the hidden state of a row whose label is ignored changes nothing.

For every implementation and every op: the outputs, dh at the other rows and dW equal exactly those
of the same call with that row finite, and dh at the ignored row is 0 (``0 * NaN = NaN`` inside a
GEMM would otherwise spread the row over all of dW).
"""

import pytest
import torch

import logitless
from logitless.ops import linear_token_objective

IGN = -100
_CUDA = torch.cuda.is_available()
DEV = "cuda" if _CUDA else "cpu"


def _impls():
    impls = ["reference", "chunked"]
    try:
        import triton  # noqa: F401

        impls += ["triton", "triton-uncompacted"]
    except ImportError:
        pass
    return impls


@pytest.fixture(params=_impls())
def impl(request, monkeypatch):
    if request.param.startswith("triton"):
        from logitless.ops.triton import head

        # small buffers: several row chunks; without compaction ignored rows go through the GEMMs
        monkeypatch.setattr(head, "WORKSPACE_BYTES", 4 * 37 * 4)
        monkeypatch.setattr(head, "FORWARD_WORKSPACE_BYTES", 4 * 37 * 4)
        monkeypatch.setattr(head, "MAX_BLOCK_ROWS", 4)
        if request.param == "triton-uncompacted":
            monkeypatch.setenv("LOGITLESS_TRITON_COMPACT", "0")
        return "triton"
    return request.param


def _inputs(dtype, seed=0, n=9, h=8, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[1, 4, 5]] = IGN
    up = torch.randn(2, n, generator=g)
    return hidden, weight, labels, up


def _ops(impl, up):
    adv = up[0].to(DEV)

    def objective(lp, ent, rows):
        return -(adv[rows] * lp).sum() - 0.1 * (up[1].to(DEV)[rows] * ent).sum()

    return {
        "ce_mean": lambda h, w, y: (logitless.linear_cross_entropy(h, w, y, impl=impl, chunk_size=4),),
        "ce_sum": lambda h, w, y: (logitless.linear_cross_entropy(h, w, y, reduction="sum", temperature=0.7,
                                                                  impl=impl, chunk_size=4),),
        "ce_none": lambda h, w, y: (logitless.linear_cross_entropy(h, w, y, reduction="none", impl=impl,
                                                                   chunk_size=4),),
        "log_probs": lambda h, w, y: logitless.linear_log_probs(h, w, y, temperature=0.9, impl=impl, chunk_size=4),
        "token_objective": lambda h, w, y: linear_token_objective(
            h, w, y, objective, need_entropy=True, impl=impl, chunk_size=4)[:1],
    }


def _run(fn, hidden, weight, labels, up):
    h = hidden.clone().to(DEV).requires_grad_()
    w = weight.clone().to(DEV).requires_grad_()
    outs = fn(h, w, labels.to(DEV))
    total = sum((o.float() * (u.to(DEV) if o.dim() else 1.0)).sum() for o, u in zip(outs, up))
    total.backward()
    return [o.detach().cpu() for o in outs], h.grad.cpu(), w.grad.cpu()


@pytest.mark.parametrize("op", ["ce_mean", "ce_sum", "ce_none", "log_probs", "token_objective"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_ignored_row_changes_nothing(impl, op, bad, dtype):
    if impl == "triton" and dtype == torch.bfloat16 and not _CUDA and op != "ce_mean":
        pytest.skip("interpreter time: bf16 runs one op on the CPU")
    hidden, weight, labels, up = _inputs(dtype)
    fn = _ops(impl, up)[op]
    want_out, want_dh, want_dw = _run(fn, hidden, weight, labels, up)
    dirty = hidden.clone()
    dirty[4] = bad  # row 4 is ignored
    dirty[1, 0] = -bad  # and one element of row 1
    got_out, got_dh, got_dw = _run(fn, dirty, weight, labels, up)
    for a, b in zip(got_out, want_out):
        assert torch.equal(a, b), (a, b)
    assert torch.isfinite(want_dw).all() and want_dw.abs().max() > 0
    assert torch.equal(got_dw, want_dw)
    keep = torch.ones(len(labels), dtype=torch.bool)
    keep[[1, 4]] = False
    assert torch.equal(got_dh[keep], want_dh[keep])
    assert torch.count_nonzero(got_dh[~keep]) == 0 and torch.count_nonzero(want_dh[labels == IGN]) == 0
