"""Bad input raises a ValueError naming the argument, before any computation."""

import pytest
import torch
from omegaconf import OmegaConf

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
    ({"temperature": 0.0}, r"temperature must be > 0 \(a finite number in \[0.0001, 10000.0\]\)"),
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


_ENTRIES = {
    "linear_cross_entropy": lambda h, w, y, **k: logitless.linear_cross_entropy(h, w, y, **k),
    "linear_log_probs": lambda h, w, y, **k: logitless.linear_log_probs(h, w, y, **k),
    "linear_token_objective": lambda h, w, y, **k: logitless.ops.linear_token_objective(
        h, w, y, lambda lp, ent, rows: lp.sum(), **k),
}


@pytest.mark.parametrize("entry", sorted(_ENTRIES))
@pytest.mark.parametrize("shapes,match", [
    (((4, H), (0, H), (4,)), r"weight must have at least one row \(V >= 1\), got shape \(0, 8\)"),
    (((4, 0), (V, 0), (4,)), r"hidden size H = weight.shape\[1\] must be >= 1, got shape \(20, 0\)"),
])
def test_empty_vocab_or_hidden_is_rejected(entry, shapes, match):
    (hs, ws, ys) = shapes
    h, w, y = torch.randn(hs), torch.randn(ws), torch.full(ys, -100)
    with pytest.raises(ValueError, match=match):
        _ENTRIES[entry](h, w, y)


@pytest.mark.parametrize("entry", sorted(_ENTRIES))
@pytest.mark.parametrize("temperature", [float("inf"), float("-inf"), 1e-30, 9.9e-5, 1.01e4, 1e30])
def test_absurd_temperature_is_rejected(entry, temperature):
    with pytest.raises(ValueError, match=r"temperature must be (> 0 \()?a finite number in \[0.0001, 10000.0\]"):
        _ENTRIES[entry](*_ok(), temperature=temperature)


@pytest.mark.parametrize("entry", sorted(_ENTRIES))
@pytest.mark.parametrize("temperature", [1e-4, 1e4])
def test_temperature_bounds_are_inclusive(entry, temperature):
    out = _ENTRIES[entry](*_ok(), temperature=temperature)
    value = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(value).all()


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_zero_tokens_are_legitimate(impl):
    # N = 0 is an empty micro-batch (e.g. a rank's share of padding): no error, no token contributes.
    h = torch.randn(0, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.zeros(0, dtype=torch.long)
    loss = logitless.linear_cross_entropy(h, w, y, impl=impl)
    assert loss.item() == 0.0  # "mean" over no tokens is 0.0, as with every label ignored
    loss.backward()
    assert h.grad.shape == (0, H) and torch.count_nonzero(w.grad) == 0
    assert logitless.linear_cross_entropy(h, w, y, impl=impl, reduction="sum").item() == 0.0
    assert logitless.linear_cross_entropy(h, w, y, impl=impl, reduction="none").shape == (0,)
    logp, ent = logitless.linear_log_probs(h, w, y, impl=impl)
    assert logp.shape == ent.shape == (0,)
    value, logp, _ = logitless.ops.linear_token_objective(h, w, y, lambda lp, e, r: lp.sum(), impl=impl)
    assert value.item() == 0.0 and logp.shape == (0,)


@pytest.mark.parametrize("entry", ["linear_cross_entropy", "linear_log_probs", "linear_token_objective"])
def test_chunked_public_entries_check_shapes_and_temperature(entry):
    # The chunked module's own entries (2-D hidden, 1-D labels) are public too: same checks, no sync.
    from logitless.ops import chunked

    fn = getattr(chunked, entry)
    args = (lambda lp, e, r: lp.sum(),) if entry == "linear_token_objective" else ()
    h, w, y = _ok()
    with pytest.raises(ValueError, match=r"weight must have at least one row"):
        fn(h, torch.randn(0, H), torch.full((4,), -100), *args)
    with pytest.raises(ValueError, match=r"hidden size H"):
        fn(torch.randn(4, 0), torch.randn(V, 0), y, *args)
    with pytest.raises(ValueError, match=r"temperature must be a finite number"):
        fn(h, w, y, *args, temperature=float("inf"))


def test_triton_entries_check_shapes_and_temperature():
    # The fused entries validate their metadata without touching a kernel (runs without a GPU).
    pytest.importorskip("triton")
    from logitless.ops import triton as T

    h, w, y = _ok()
    with pytest.raises(ValueError, match=r"weight must have at least one row"):
        T.linear_cross_entropy(h, torch.randn(0, H), y, ignore_index=-100, reduction="mean", temperature=1.0)
    with pytest.raises(ValueError, match=r"hidden size H"):
        T.linear_log_probs(torch.randn(4, 0), torch.randn(V, 0), y, ignore_index=-100, temperature=1.0,
                           return_entropy=True)
    with pytest.raises(ValueError, match=r"temperature must be a finite number"):
        T.linear_token_objective(h, w, y, lambda lp, e, r: lp.sum(), ignore_index=-100, temperature=1e-30,
                                 need_entropy=False)


def test_impl_torch_removed_in_0_2_0_is_refused_and_reference_is_plain_pytorch():
    from logitless.losses import LinearCrossEntropyLoss

    # "torch" was the former name of the plain-PyTorch impl (ops/reference.py), now "reference"
    torch.manual_seed(0)
    h, w = torch.randn(6, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64)
    y = torch.randint(0, V, (6,))
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'triton', 'chunked', 'reference'\), "
                                         r"got 'torch'"):
        logitless.linear_cross_entropy(h, w, y, impl="torch")
    want = torch.nn.functional.cross_entropy(h @ w.T, y)
    assert torch.allclose(logitless.linear_cross_entropy(h, w, y, impl="reference"), want, rtol=1e-12)
    with pytest.raises(ValueError, match="impl must be one of .*got 'torch'"):
        LinearCrossEntropyLoss(impl="torch")
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'triton', 'chunked', 'reference'\), got 'pytorch'"):
        logitless.linear_cross_entropy(h, w, y, impl="pytorch")


def test_a_bad_gemm_backend_is_named_before_any_compute_in_the_ops_and_the_losses():
    from torchtune import config as tune_config

    from logitless.losses import EntropyWithChunkedOutputLoss, GRPOLoss, LinearCrossEntropyLoss, TokenLogProbs

    h, w, y = torch.randn(4, H), torch.randn(V, H), torch.randint(0, V, (4,))
    expected = r"gemm_backend must be None \(the LOGITLESS_HEAD_GEMM setting\) or one of \('cublas', 'triton', " \
               r"'quack', 'auto'\), got 'cutlass'"
    for call in (lambda: logitless.linear_cross_entropy(h, w, y, gemm_backend="cutlass"),
                 lambda: logitless.linear_log_probs(h, w, y, gemm_backend="cutlass"),
                 lambda: logitless.ops.linear_token_objective(h, w, y, lambda lp, ent, rows: lp.sum(),
                                                              gemm_backend="cutlass")):
        with pytest.raises(ValueError, match=expected):
            call()
    for loss in (LinearCrossEntropyLoss, EntropyWithChunkedOutputLoss, GRPOLoss, TokenLogProbs):
        with pytest.raises(ValueError, match=expected):
            loss(gemm_backend="cutlass")
    # a YAML key of the loss: loss.gemm_backend
    node = OmegaConf.create({"_component_": "logitless.losses.LinearCrossEntropyLoss", "gemm_backend": "cublas"})
    assert tune_config.instantiate(node).gemm_backend == "cublas"
    assert LinearCrossEntropyLoss().gemm_backend is None  # None: the LOGITLESS_HEAD_GEMM setting
