"""``LOGITLESS_HEAD_GEMM=quack|auto``: which calls go to QuACK's GEMM, and the error without it.

QuACK's kernels need an sm_90 GPU; their values are checked against float64 on one in
``tests/gpu/test_quack_head_gpu.py``. Here (CPU, Triton's interpreter): the routing rule, the knob's
values, and that a call the rule keeps on the Triton path gives that path's values.
"""

import pytest
import torch

pytest.importorskip("triton")
import logitless  # noqa: E402
from logitless.ops import quack_head, reference  # noqa: E402
from logitless.settings import settings  # noqa: E402

IGN = -100


def _inputs(n=13, h=16, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = IGN
    return hidden, weight, labels


def test_knob_accepts_quack_and_names_it_in_the_error(monkeypatch):
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "QUACK")
    assert settings.head_gemm == "quack"
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "cute")
    with pytest.raises(ValueError, match="LOGITLESS_HEAD_GEMM='cute'.*quack"):
        settings.head_gemm


@pytest.mark.parametrize("mode", ["cublas", "triton", "quack", "auto"])
def test_cpu_tensors_never_go_to_quack(monkeypatch, mode):
    monkeypatch.setattr(quack_head, "quack_installed", lambda: True)
    hidden, weight, _ = _inputs()
    assert not quack_head.forward_applies(hidden.bfloat16(), weight.bfloat16(), mode)


def test_quack_requested_without_quack_installed_is_an_error_naming_the_knob(monkeypatch):
    monkeypatch.setattr(quack_head, "quack_installed", lambda: False)
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "quack")
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="LOGITLESS_HEAD_GEMM='quack' needs quack-kernels"):
        logitless.linear_log_probs(hidden, weight, labels, return_entropy=False, impl="triton")
    with pytest.raises(ValueError, match="LOGITLESS_HEAD_GEMM='quack' needs quack-kernels"):
        logitless.linear_cross_entropy(hidden, weight, labels, impl="triton")


@pytest.mark.parametrize("entropy,grad", [(False, False), (True, False), (False, True)])
def test_auto_without_a_hopper_gpu_keeps_the_triton_path_and_its_values(monkeypatch, entropy, grad):
    """``auto`` where QuACK does not apply (here: CPU) runs the Triton path; its log-probs equal float64's."""
    calls = []
    monkeypatch.setattr(quack_head, "log_probs", lambda *a, **k: calls.append(a))
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "auto")
    hidden, weight, labels = _inputs()
    h = hidden.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        logp, ent = logitless.linear_log_probs(h, weight, labels, temperature=0.7, return_entropy=entropy,
                                               impl="triton")
    want, want_ent = reference.log_probs(hidden.double(), weight.double(), labels, ignore_index=IGN,
                                         temperature=0.7)
    assert calls == []
    torch.testing.assert_close(logp.double(), want, rtol=1e-5, atol=1e-5)
    assert (ent is None) != entropy
    if entropy:
        torch.testing.assert_close(ent.double(), want_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,installed,want", [("auto", True, True), ("quack", True, True),
                                                  ("auto", False, False), ("cublas", True, False),
                                                  ("triton", True, False)])
def test_routing_rule_on_a_hopper_gpu(monkeypatch, mode, installed, want):
    """The rule's own conditions, with the device's answers patched: sm_90 and bf16 with H % 8 == 0
    go to QuACK under 'quack'/'auto' when installed; other dtypes, H or capabilities do not."""
    monkeypatch.setattr(quack_head, "quack_installed", lambda: installed)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    class FakeCuda(torch.Tensor):  # a CPU tensor that reports a CUDA device to the rule
        @property
        def is_cuda(self):
            return True

    def as_cuda(t):
        return t.as_subclass(FakeCuda)

    h16, w16 = as_cuda(torch.randn(4, 16, dtype=torch.bfloat16)), as_cuda(torch.randn(9, 16, dtype=torch.bfloat16))
    assert quack_head.forward_applies(h16, w16, mode) is want
    if want:
        h12, w12 = as_cuda(torch.randn(4, 12, dtype=torch.bfloat16)), as_cuda(torch.randn(9, 12, dtype=torch.bfloat16))
        assert not quack_head.forward_applies(h12, w12, mode)  # H % 8 != 0
        assert not quack_head.forward_applies(as_cuda(h16.float()), as_cuda(w16.float()), mode)  # fp32
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        assert not quack_head.forward_applies(h16, w16, mode)  # not sm_90
