"""``LOGITLESS_HEAD_GEMM=quack`` on a Hopper GPU at real shapes (skipped without CUDA, sm_90 or QuACK).

Forward-only log-probs and loss (no entropy, no gradient) through QuACK's GEMM with the statistics in
its epilogue, against float64 computed in row chunks, within 1.5x plain PyTorch's error (bf16
logits, fp32 softmax) on the same inputs; a spy checks that QuACK's path ran.
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


def _inputs(n, h, v, seed=0, ignore_frac=0.1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h**0.5)).bfloat16()
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


def test_entropy_or_gradients_keep_the_triton_path(quack_calls):
    import logitless

    hidden, weight, labels = _inputs(512, 896, 151936)
    with torch.no_grad():
        logitless.linear_log_probs(hidden, weight, labels, return_entropy=True, impl="triton")
    logp, _ = logitless.linear_log_probs(hidden.requires_grad_(), weight, labels, return_entropy=False,
                                         impl="triton")
    logp.sum().backward()
    assert quack_calls == []
    assert hidden.grad is not None
