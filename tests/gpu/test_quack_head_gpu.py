"""``LOGITLESS_HEAD_GEMM=quack`` on a Hopper GPU at real shapes (skipped without CUDA, sm_90 or QuACK).

Forward-only log-probs and loss (no entropy, no gradient) through QuACK's GEMM with the log-sum-exp in
its epilogue, and log-probs + entropy (with and without gradients) through the per-tile statistics
epilogue, against float64 computed in row chunks, within 1.5x plain PyTorch's error (bf16 logits,
fp32 softmax) on the same inputs, or within 1.05x the cuBLAS path's gradient error; spies check
which path ran.
"""

import pytest
import torch

from logitless.ops import quack_head

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                       reason="QuACK's head GEMM runs on sm_90"),
    pytest.mark.skipif(not quack_head.quack_installed(), reason="needs quack-kernels"),
]

IGN = -100


def _inputs(n, h, v, seed=0, ignore_frac=0.1, logit_std=2.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * (logit_std / h**0.5)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[torch.rand(n, device="cuda", generator=g) < ignore_frac] = IGN
    return hidden, weight, labels


def _log_probs(hidden, weight, labels, temperature, dtype, rows=1024):
    """Plain PyTorch's log-probs: logits in ``dtype`` (float64: the exact reference), softmax in fp32
    (float64 for float64), row chunk by row chunk; 0 at ignored rows."""
    out = []
    for s in range(0, hidden.shape[0], rows):
        y = labels[s:s + rows]
        logits = (hidden[s:s + rows].to(dtype) @ weight.to(dtype).T).to(
            torch.float64 if dtype == torch.float64 else torch.float32) / temperature
        logp = torch.log_softmax(logits, -1).gather(1, y.clamp(min=0)[:, None]).squeeze(1)
        out.append(torch.where(y != IGN, logp, 0.0).double())
    return torch.cat(out)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def quack_calls(monkeypatch):
    calls = []
    real = quack_head.log_probs

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(quack_head, "log_probs", spy)
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "quack")
    return calls


@pytest.mark.parametrize("n,h,v,temperature,rows_per_launch", [
    (4096, 3584, 152064, 1.0, 8192), (4096, 3584, 152064, 0.7, 8192), (8192, 896, 151936, 1.0, 8192),
    (2048, 1024, 32001, 0.7, 768), (1000, 4096, 128256, 1.3, 8192), (20000, 896, 151936, 1.0, 8192)])
def test_forward_log_probs_and_loss_within_plain_pytorch(monkeypatch, quack_calls, n, h, v, temperature,
                                                         rows_per_launch):
    """Row blocks of ``rows_per_launch`` (the last one shorter where it does not divide ``n``)."""
    import logitless

    monkeypatch.setattr(quack_head, "ROWS_PER_LAUNCH", rows_per_launch)
    hidden, weight, labels = _inputs(n, h, v)
    exact = _log_probs(hidden, weight, labels, temperature, torch.float64)
    plain = _log_probs(hidden, weight, labels, temperature, torch.bfloat16)
    with torch.no_grad():
        logp, ent = logitless.linear_log_probs(hidden, weight, labels, temperature=temperature,
                                               return_entropy=False, impl="triton")
        loss = logitless.linear_cross_entropy(hidden, weight, labels, temperature=temperature, impl="triton")
    assert len(quack_calls) == 2 and ent is None
    assert logp.dtype == torch.float32 and logp.shape == (n,)
    assert torch.all(logp[labels == IGN] == 0)
    assert _rel(logp, exact) <= 1.5 * _rel(plain, exact) + 1e-7, (_rel(logp, exact), _rel(plain, exact))
    valid = labels != IGN
    want = -exact[valid].mean()
    assert abs(loss.item() - want.item()) <= 1.5 * abs(-plain[valid].mean().item() - want.item()) + 1e-6 * abs(want.item())


def test_entropy_or_gradients_leave_the_log_prob_epilogue(quack_calls):
    """Calls that need entropy or gradients do not take the log-sum-exp-only epilogue."""
    import logitless

    hidden, weight, labels = _inputs(512, 896, 151936)
    with torch.no_grad():
        logitless.linear_log_probs(hidden, weight, labels, return_entropy=True, impl="triton")
    logp, _ = logitless.linear_log_probs(hidden.requires_grad_(), weight, labels, return_entropy=False,
                                         impl="triton")
    logp.sum().backward()
    assert quack_calls == []
    assert hidden.grad is not None


@pytest.fixture
def outputs_calls(monkeypatch):
    calls = []
    real = quack_head.forward_outputs

    def spy(*args, **kwargs):
        calls.append(args[6])  # for_backward
        return real(*args, **kwargs)

    monkeypatch.setattr(quack_head, "forward_outputs", spy)
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "quack")
    return calls


def _log_probs_entropy(hidden, weight, labels, temperature, dtype, rows=1024):
    """Plain PyTorch's log-probs and entropy (logits in ``dtype``, softmax in fp32; float64 for
    float64), row chunk by row chunk; 0 at ignored rows."""
    logps, ents = [], []
    for s in range(0, hidden.shape[0], rows):
        y = labels[s:s + rows]
        logits = (hidden[s:s + rows].to(dtype) @ weight.to(dtype).T).to(
            torch.float64 if dtype == torch.float64 else torch.float32) / temperature
        logp_all = torch.log_softmax(logits, -1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        logp = logp_all.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
        logps.append(torch.where(y != IGN, logp, 0.0).double())
        ents.append(torch.where(y != IGN, ent, 0.0).double())
    return torch.cat(logps), torch.cat(ents)


@pytest.mark.parametrize("n,h,v,temperature,ignore_frac", [
    (4096, 3584, 152064, 1.0, 0.1), (4096, 3584, 152064, 0.7, 0.1), (8192, 896, 151936, 1.0, 0.1),
    (1000, 4096, 128256, 1.3, 0.1), (20000, 896, 151936, 1.0, 0.1), (1001, 896, 151936, 1.0, 0.0)])
def test_forward_with_entropy_within_plain_pytorch(outputs_calls, n, h, v, temperature, ignore_frac):
    """No-grad log-probs + entropy on the statistics epilogue (fp32 logits), several row launches at
    20000 rows, one launch of an odd number of rows and tiles at 1001 x 151936, against float64 within
    1.5x plain PyTorch's error."""
    import logitless

    hidden, weight, labels = _inputs(n, h, v, ignore_frac=ignore_frac)
    exact_lp, exact_ent = _log_probs_entropy(hidden, weight, labels, temperature, torch.float64)
    plain_lp, plain_ent = _log_probs_entropy(hidden, weight, labels, temperature, torch.bfloat16)
    with torch.no_grad():
        logp, ent = logitless.linear_log_probs(hidden, weight, labels, temperature=temperature,
                                               return_entropy=True, impl="triton")
    assert outputs_calls == [False]
    assert torch.all(logp[labels == IGN] == 0) and torch.all(ent[labels == IGN] == 0)
    assert _rel(logp, exact_lp) <= 1.5 * _rel(plain_lp, exact_lp) + 1e-7, (_rel(logp, exact_lp), _rel(plain_lp, exact_lp))
    assert _rel(ent, exact_ent) <= 1.5 * _rel(plain_ent, exact_ent) + 1e-7, (_rel(ent, exact_ent), _rel(plain_ent, exact_ent))


@pytest.mark.parametrize("n,h,v,temperature,logit_std", [(2048, 3584, 152064, 1.0, 2.0), (2048, 896, 151936, 0.7, 2.0),
                                                         (1024, 4096, 128256, 1.0, 2.0), (2048, 896, 151936, 1.0, 8.0)])
def test_gradients_on_quack_match_the_cublas_path(monkeypatch, n, h, v, temperature, logit_std):
    """Log-probs + entropy with gradients: the forward on QuACK (bf16-rounded statistics) gives the
    cuBLAS path's log-probs and entropy, and the backward on QuACK's dlogits GEMM dh, dW within 1.05x
    its error against float64 (logits of std 8: rows whose top probability is near 1)."""
    import logitless

    calls, slabs = [], []
    real, real_slab = quack_head.forward_outputs, quack_head.SlabDlogits.__call__
    monkeypatch.setattr(quack_head, "forward_outputs", lambda *a, **k: calls.append(a[6]) or real(*a, **k))
    monkeypatch.setattr(quack_head.SlabDlogits, "__call__", lambda self, *a: slabs.append(a[6]) or real_slab(self, *a))
    hidden, weight, labels = _inputs(n, h, v, logit_std=logit_std)
    g = torch.Generator(device="cuda").manual_seed(5)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)

    def run(mode):
        monkeypatch.setenv("LOGITLESS_HEAD_GEMM", mode)
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = logitless.linear_log_probs(hh, ww, labels, temperature=temperature, return_entropy=True,
                                               impl="triton")
        ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return logp.detach(), ent.detach(), hh.grad.double(), ww.grad.double()

    lp_q, ent_q, dh_q, dw_q = run("quack")
    assert calls == [True] and len(slabs) > 0 and slabs[0] == 0
    n_slabs = len(slabs)
    lp_c, ent_c, dh_c, dw_c = run("cublas")
    assert calls == [True] and len(slabs) == n_slabs
    torch.testing.assert_close(lp_q, lp_c, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent_q, ent_c, rtol=0, atol=2e-5)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, ent64 = [], []
    for s in range(0, n, 512):  # float64 logits in row chunks
        z = (h64[s:s + 512] @ w64.T) / temperature
        lsm = torch.log_softmax(z, -1)
        y = labels[s:s + 512]
        lp = torch.where(y != IGN, lsm.gather(1, y.clamp(min=0)[:, None]).squeeze(1), 0.0)
        en = torch.where(y != IGN, -(lsm.exp() * lsm).sum(-1), 0.0)
        ((lp * g_lp[s:s + 512].double()).sum() + (en * g_ent[s:s + 512].double()).sum()).backward()
    for got, cublas, exact in ((dh_q, dh_c, h64.grad), (dw_q, dw_c, w64.grad)):
        err, err_c = _rel(got, exact), _rel(cublas, exact)
        assert err <= 1.05 * err_c + 1e-7, (err, err_c)


def test_a_vocabulary_no_tile_divides_keeps_the_triton_path(outputs_calls):
    import logitless

    hidden, weight, labels = _inputs(512, 1024, 32001)
    exact_lp, exact_ent = _log_probs_entropy(hidden, weight, labels, 1.0, torch.float64)
    with torch.no_grad():
        logp, ent = logitless.linear_log_probs(hidden, weight, labels, return_entropy=True, impl="triton")
    assert outputs_calls == []
    assert _rel(ent, exact_ent) < 1e-2


def _ce_float64(hidden, weight, labels, rows=512):
    """Mean cross-entropy of float64 logits and its gradients, row chunk by row chunk."""
    h64, w64 = hidden.double(), weight.double()
    valid = labels != IGN
    count = valid.sum().double()
    loss, dh, dw = 0.0, torch.zeros_like(h64), torch.zeros_like(w64)
    for s in range(0, hidden.shape[0], rows):
        y, ok = labels[s:s + rows], valid[s:s + rows]
        lsm = torch.log_softmax(h64[s:s + rows] @ w64.T, -1)
        loss = loss - lsm.gather(1, y.clamp(min=0)[:, None]).squeeze(1)[ok].sum()
        d = lsm.exp()
        d[torch.arange(y.numel(), device=y.device)[ok], y[ok]] -= 1
        d[~ok] = 0
        dh[s:s + rows] = d @ w64 / count
        dw += d.T @ h64[s:s + rows] / count
    return loss / count, dh, dw


@pytest.mark.parametrize("n,h,v", [(8192, 3584, 152064), (16384, 896, 151936), (8192, 4096, 128256)])
def test_one_pass_cross_entropy_on_quack_matches_the_cublas_path(monkeypatch, n, h, v):
    """Cross-entropy's one pass with the chunks' logits and dW GEMMs on QuACK (the 7B, 0.5B and 8B heads,
    10% ignored labels, N * V > 2^31 at 0.5B): the loss of the cuBLAS path, dh and dW within 1.1x its
    error against float64."""
    import logitless
    from logitless.ops.triton import head

    chunks = []
    real = quack_head.ChunkStats.logits
    monkeypatch.setattr(quack_head.ChunkStats, "logits", lambda self, h_c, *a: chunks.append(h_c.shape[0]) or
                        real(self, h_c, *a))
    hidden, weight, labels = _inputs(n, h, v)

    def run(mode):
        monkeypatch.setenv("LOGITLESS_HEAD_GEMM", mode)
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = logitless.linear_cross_entropy(hh, ww, labels, impl="triton")
        loss.backward()
        return loss.detach().double(), hh.grad, ww.grad

    loss_q, dh_q, dw_q = run("quack")
    rows = int((labels != IGN).sum())
    n_c = quack_head.chunk_rows_on_quack(rows, v, 2, head.WORKSPACE_BYTES)
    assert chunks == [n_c] * (rows // n_c) + ([rows % n_c] if rows % n_c else [])
    loss_c, dh_c, dw_c = run("cublas")
    assert len(chunks) == -(-rows // n_c)
    loss64, dh64, dw64 = _ce_float64(hidden, weight, labels)
    torch.testing.assert_close(loss_q, loss_c, rtol=2e-6, atol=0)
    torch.testing.assert_close(loss_q, loss64, rtol=1e-4, atol=0)
    for got, cublas, exact in ((dh_q, dh_c, dh64), (dw_q, dw_c, dw64)):
        err, err_c = _rel(got, exact), _rel(cublas, exact)
        assert err <= 1.1 * err_c + 1e-7, (err, err_c)
