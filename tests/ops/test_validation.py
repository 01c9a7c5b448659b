"""Bad input raises a ValueError naming the argument, before any computation."""

import pytest
import torch

import logitless

H, V = 8, 20


def _ok():
    return torch.randn(4, H), torch.randn(V, H), torch.randint(0, V, (4,))


@pytest.mark.parametrize("fn", [logitless.linear_cross_entropy, logitless.linear_log_probs])
@pytest.mark.parametrize(
    "change,match",
    [
        (lambda h, w, y: (h, w, torch.tensor([0, 1, V, 2])), "labels must be in"),
        (lambda h, w, y: (h, w, torch.tensor([0, -1, 3, 2])), "labels must be in"),
        (lambda h, w, y: (h, w, y.float()), "labels must be int64"),
        (lambda h, w, y: (h, w, y[:3]), "labels must have shape"),
        (lambda h, w, y: (h, w.unsqueeze(0), y), "weight must be 2-D"),
        (lambda h, w, y: (h[:, :5], w, y), "hidden must have shape"),
        (lambda h, w, y: (h, w.double(), y), "weight dtype must equal hidden dtype"),
        (lambda h, w, y: (h.long(), w, y), "hidden must be float16"),
    ],
)
def test_bad_tensors(fn, change, match):
    h, w, y = change(*_ok())
    with pytest.raises(ValueError, match=match):
        fn(h, w, y)


@pytest.mark.parametrize("fn", [logitless.linear_cross_entropy, logitless.linear_log_probs])
@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"temperature": -1.0}, "temperature must be > 0"),
    ({"temperature": float("nan")}, "temperature must be > 0"),
    ({"impl": "cuda"}, "impl must be one of"),
    ({"chunk_size": 0}, "chunk_size must be"),
])
def test_bad_options(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*_ok(), **kwargs)


def test_bad_reduction():
    with pytest.raises(ValueError, match="reduction must be one of"):
        logitless.linear_cross_entropy(*_ok(), reduction="avg")


def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors"):
        logitless.linear_cross_entropy(*_ok(), impl="triton")


def test_ignore_index_label_is_accepted():
    h, w, _ = _ok()
    y = torch.tensor([0, -100, 3, -100])
    assert torch.isfinite(logitless.linear_cross_entropy(h, w, y))


def test_label_check_returns_the_valid_count_it_read():
    # The count comes back from validation's one host read, so the fused head needs no second.
    from logitless.ops import _validate

    h, w, _ = _ok()
    y = torch.tensor([[0, -100, 3], [-100, -100, 19]])
    hh = torch.randn(2, 3, H)
    assert _validate.check_head_inputs(hh, w, y, ignore_index=-100) == 3
    assert _validate.check_head_inputs(hh, w, y, ignore_index=-100, check_label_range=False) is None
    assert _validate.check_head_inputs(h[:0], w, y.reshape(-1)[:0], ignore_index=-100) == 0
