"""The fused Triton head against the float64 reference, on small odd shapes.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before anything imports triton).
"""


import pytest
import torch

_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
pytest.importorskip("triton")
from logitless.ops.triton import head  # noqa: E402
import logitless  # noqa: E402
from logitless.ops import reference  # noqa: E402
from logitless.ops import triton as T  # noqa: E402


DEV = "cuda" if _CUDA else "cpu"
IGN = -100
TOL = 1e-4  # fp32 inputs: logits of |z| ~ 80 carry ~1e-5 relative rounding


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    # Small buffers so that every test crosses several row chunks and column splits.
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 24 * 64 * 4)
    monkeypatch.setattr(head, "FORWARD_WORKSPACE_BYTES", 16 * 64 * 4)
    monkeypatch.setattr(head, "MAX_BLOCK_ROWS", 8)
    monkeypatch.setattr(head, "MIN_SLAB", 32)


@pytest.fixture(params=["pinned", "fused", "twopass"])
def ce_path(monkeypatch, request):
    # The one-pass 3-GEMM cross-entropy with its labels' dlogits pinned (the default where they
    # fit: the 3 most frequent labels' columns and every other row's own label entry) and
    # without; the two-pass slab path (forward + backward).
    one_pass = request.param != "twopass"
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 1000 if one_pass else 0)
    monkeypatch.setattr(head, "PINNED_MAX_CHUNKS", 1000 if one_pass else 0)
    if request.param == "fused":
        monkeypatch.setattr(head, "PINNED_BYTES", 0)
    else:
        monkeypatch.setattr(head, "PINNED_COLUMNS", 3)  # most labels' own entries move on their own
    return request.param


@pytest.fixture(params=[True, False], ids=["prefetch", "noprefetch"])
def stats_kernel(monkeypatch, request):
    monkeypatch.setattr(head, "PREFETCH", request.param)
    return request.param


def _inputs(n, h, v, dtype=torch.float32, ignore_frac=0.25, seed=0, negative=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / h**0.5)
    if negative:
        # A constant feature with a large negative weight: every logit is negative.
        hidden[:, 0] = 1.0
        weight[:, 0] = -40.0 - weight[:, 0].abs()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = IGN
    cast = lambda t: t.to(dtype).to(DEV).requires_grad_(True)  # noqa: E731
    return cast(hidden), cast(weight), labels.to(DEV)


def _ref64(hidden, weight):
    return (hidden.detach().double().cpu().requires_grad_(True),
            weight.detach().double().cpu().requires_grad_(True))


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("v,temperature,negative", [(151, 1.0, False), (37, 0.7, True), (200, 1.3, False)])
def test_log_probs_forward_backward_any_upstream(v, temperature, negative, stats_kernel):
    hidden, weight, labels = _inputs(29, 24, v, negative=negative, seed=v)
    logp, ent = T.linear_log_probs(hidden, weight, labels, ignore_index=IGN,
                                   temperature=temperature, return_entropy=True)
    h64, w64 = _ref64(hidden, weight)
    rlogp, rent = reference.log_probs(h64, w64, labels.cpu(), ignore_index=IGN, temperature=temperature)
    assert logp.dtype == torch.float32 and logp.shape == (29,)
    assert _rel(logp, rlogp) < TOL and _rel(ent, rent) < TOL
    ignored = (labels == IGN).cpu()
    assert (logp.detach().cpu()[ignored] == 0).all() and (ent.detach().cpu()[ignored] == 0).all()
    g1 = torch.randn(29, dtype=torch.float64)
    g2 = torch.randn(29, dtype=torch.float64)
    (logp * g1.float().to(DEV) + ent * g2.float().to(DEV)).sum().backward()
    ((rlogp * g1) + (rent * g2)).sum().backward()
    assert _rel(hidden.grad, h64.grad) < TOL
    assert _rel(weight.grad, w64.grad) < TOL


def test_log_probs_without_entropy_and_single_upstream():
    hidden, weight, labels = _inputs(17, 16, 99, seed=3)
    logp, ent = T.linear_log_probs(hidden, weight, labels, ignore_index=IGN, temperature=1.0,
                                   return_entropy=False)
    assert ent is None
    (logp * 3.0).sum().backward()
    h64, w64 = _ref64(hidden, weight)
    rlogp, _ = reference.log_probs(h64, w64, labels.cpu(), ignore_index=IGN, return_entropy=False)
    (rlogp * 3.0).sum().backward()
    assert _rel(hidden.grad, h64.grad) < TOL and _rel(weight.grad, w64.grad) < TOL


def test_entropy_only_upstream_and_frozen_weight():
    hidden, weight, labels = _inputs(21, 16, 75, seed=4)
    weight.requires_grad_(False)
    _, ent = T.linear_log_probs(hidden, weight, labels, ignore_index=IGN, temperature=0.9,
                                return_entropy=True)
    ent.mean().backward()
    h64, _ = _ref64(hidden, weight)
    _, rent = reference.log_probs(h64, weight.double().cpu(), labels.cpu(), ignore_index=IGN,
                                  temperature=0.9)
    rent.mean().backward()
    assert weight.grad is None
    assert _rel(hidden.grad, h64.grad) < TOL


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_cross_entropy_matches_float64(reduction, temperature, ce_path):
    hidden, weight, labels = _inputs(31, 20, 131, seed=11)
    loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction=reduction,
                                  temperature=temperature)
    h64, w64 = _ref64(hidden, weight)
    ref = reference.cross_entropy(h64, w64, labels.cpu(), ignore_index=IGN, reduction=reduction,
                                  temperature=temperature)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert _rel(loss, ref) < TOL
    up = torch.randn(ref.shape, dtype=torch.float64) if reduction == "none" else torch.tensor(2.5)
    (loss * up.float().to(DEV)).sum().backward()
    (ref * up.double()).sum().backward()
    assert _rel(hidden.grad, h64.grad) < TOL
    assert _rel(weight.grad, w64.grad) < TOL


def test_cross_entropy_all_ignored_is_zero_with_zero_grads(ce_path):
    hidden, weight, labels = _inputs(9, 8, 33, seed=5)
    labels = torch.full_like(labels, IGN)
    loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction="mean",
                                  temperature=1.0)
    loss.backward()
    assert loss.item() == 0.0
    assert (hidden.grad == 0).all() and (weight.grad == 0).all()


@pytest.mark.parametrize("compact", ["0", "1"])
def test_cross_entropy_no_grad_and_uncompacted_paths(monkeypatch, compact, ce_path):
    monkeypatch.setenv("LOGITLESS_TRITON_COMPACT", compact)
    hidden, weight, labels = _inputs(19, 12, 65, seed=6, ignore_frac=0.5)
    h64, w64 = _ref64(hidden, weight)
    ref = reference.cross_entropy(h64, w64, labels.cpu(), ignore_index=IGN, reduction="mean")
    with torch.no_grad():
        loss_ng = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction="mean",
                                         temperature=1.0)
    loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction="mean",
                                  temperature=1.0)
    loss.backward()
    ref.backward()
    assert _rel(loss_ng, ref) < TOL and _rel(loss, ref) < TOL
    assert _rel(hidden.grad, h64.grad) < TOL and _rel(weight.grad, w64.grad) < TOL


@pytest.mark.parametrize("ignore_frac", [0.0, 0.4])
def test_caller_count_of_valid_rows_gives_the_counted_result(ignore_frac, ce_path):
    # valid_rows with the caller's count (no sync) compacts exactly the rows nonzero() finds, and
    # the ops given that count match the float64 reference in forward and recompute backward.
    hidden, weight, labels = _inputs(23, 12, 65, seed=11, ignore_frac=ignore_frac)
    n_valid = int((labels != IGN).sum())
    counted = head.valid_rows(labels, IGN)
    given = head.valid_rows(labels, IGN, n_valid)
    assert (counted is None) == (given is None) == (n_valid == labels.numel())
    if counted is not None:
        assert torch.equal(counted, given)
    h64, w64 = _ref64(hidden, weight)
    g = torch.randn(23, generator=torch.Generator().manual_seed(2)).to(DEV)
    logp, ent = T.linear_log_probs(hidden, weight, labels, ignore_index=IGN, temperature=0.9,
                                   return_entropy=True, n_valid=n_valid)
    ref_lp, ref_ent = reference.log_probs(h64, w64, labels.cpu(), ignore_index=IGN, temperature=0.9)
    (logp * g + ent).sum().backward()
    (ref_lp * g.cpu().double() + ref_ent).sum().backward()
    assert _rel(logp, ref_lp) < TOL and _rel(ent, ref_ent) < TOL
    assert _rel(hidden.grad, h64.grad) < TOL and _rel(weight.grad, w64.grad) < TOL
    hidden.grad = weight.grad = None
    loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction="mean",
                                  temperature=1.0, n_valid=n_valid)
    loss.backward()
    h64.grad = w64.grad = None
    ref = reference.cross_entropy(h64, w64, labels.cpu(), ignore_index=IGN, reduction="mean")
    ref.backward()
    assert _rel(loss, ref) < TOL
    assert _rel(hidden.grad, h64.grad) < TOL and _rel(weight.grad, w64.grad) < TOL


def test_frozen_head_weight_takes_the_one_pass_at_any_chunk_count(monkeypatch):
    # Without dW nothing is rounded across chunks, so cross-entropy keeps the one-pass path
    # (logits, dlogits, dh: no recompute) even past FUSED_MAX_CHUNKS. The token objective keeps
    # its chunk limit (a Python call per chunk) and recomputes: same float64 results.
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 0)

    def no_recompute(*args, **kwargs):
        raise AssertionError("the recompute backward ran")

    slab_backward = head._slab_backward
    monkeypatch.setattr(head, "_slab_backward", no_recompute)
    hidden, weight, labels = _inputs(29, 12, 65, seed=12, ignore_frac=0.3)
    weight.requires_grad_(False)
    h64, w64 = _ref64(hidden, weight)
    w64.requires_grad_(False)
    loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction="mean",
                                  temperature=0.8)
    loss.backward()
    ref = reference.cross_entropy(h64, w64, labels.cpu(), ignore_index=IGN, reduction="mean",
                                  temperature=0.8)
    ref.backward()
    assert _rel(loss, ref) < TOL and _rel(hidden.grad, h64.grad) < TOL
    hidden.grad, h64.grad = None, None
    monkeypatch.setattr(head, "_slab_backward", slab_backward)
    adv = torch.randn(29, generator=torch.Generator().manual_seed(3))
    objective = lambda lp, ent, rows: -(adv.to(lp.device)[rows] * lp).sum()  # noqa: E731
    value, _, _ = T.linear_token_objective(hidden, weight, labels, objective, ignore_index=IGN,
                                           temperature=0.8, need_entropy=False)
    value.backward()
    lp64, _ = reference.log_probs(h64, w64, labels.cpu(), ignore_index=IGN, temperature=0.8)
    (-(adv.double() * lp64).sum()).backward()
    assert _rel(hidden.grad, h64.grad) < TOL


@pytest.mark.parametrize("n, ignore_frac, reduction, temperature, pinned", [
    (40, 0.2, "mean", 1.0, False),  # compacted rows: a 16-row cached block, then 8-row chunks
    (40, 0.2, "mean", 1.0, True),   # the same where label columns could be pinned: not with a cached block
    (40, 0.0, "sum", 0.7, False),   # no ignored row
    (14, 0.0, "mean", 1.3, False),  # every row fits in the cached block
])
def test_one_pass_ce_with_the_first_block_cached_in_dw(monkeypatch, n, ignore_frac, reduction, temperature,
                                                       pinned):
    # The first block's logits live (transposed) in dW's unwritten buffer: pass 1 takes the
    # statistics, pass 2 walks V slabs from the end writing dW over the consumed logits. Its
    # results equal float64, and those of the uncached one-pass path.
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 8 * 65 * 4)  # 8-row chunks of V = 65 (fp32)
    monkeypatch.setattr(head, "PINNED_BYTES", 128 << 20 if pinned else 0)
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 1000)
    monkeypatch.setattr(head, "CACHED_SLAB", 24)  # several V slabs in the statistics pass
    monkeypatch.setattr(head, "CACHE_FIRST_BLOCK", True)
    used = []
    cached_block = head._cached_block
    monkeypatch.setattr(head, "_cached_block", lambda *a: used.append(a[4]) or cached_block(*a))
    hidden, weight, labels = _inputs(n, 16, 65, seed=13, ignore_frac=ignore_frac)
    h64, w64 = _ref64(hidden, weight)
    loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction=reduction,
                                  temperature=temperature)
    loss.backward()
    valid = int((labels != IGN).sum())
    assert used == [min(valid, 16)]
    ref = reference.cross_entropy(h64, w64, labels.cpu(), ignore_index=IGN, reduction=reduction,
                                  temperature=temperature)
    ref.backward()
    assert _rel(loss, ref) < TOL
    assert _rel(hidden.grad, h64.grad) < TOL and _rel(weight.grad, w64.grad) < TOL
    got = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    monkeypatch.setattr(head, "CACHE_FIRST_BLOCK", False)
    hidden.grad = weight.grad = None
    uncached = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction=reduction,
                                      temperature=temperature)
    uncached.backward()
    assert used == [min(valid, 16)]  # not called again
    for a, b in zip(got, (uncached.detach(), hidden.grad, weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_pinned_columns_rule(monkeypatch):
    # The min(rows, V, PINNED_COLUMNS) most frequent labels are pinned where their (rows, k)
    # dlogits fit the budget, dW is rounded more than once and no first block is cached, whatever
    # H; with pins the one pass runs up to PINNED_MAX_CHUNKS chunks, else FUSED_MAX_CHUNKS.
    monkeypatch.setattr(head, "PINNED_BYTES", 128 << 20)
    monkeypatch.setattr(head, "PINNED_COLUMNS", 1024)
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 8)
    monkeypatch.setattr(head, "PINNED_MAX_CHUNKS", 96)
    assert head.pinned_columns(8192, 152064, 11, 2) == 1024     # the most frequent labels
    assert head.pinned_columns(65536, 152064, 11, 2) == 1024    # exactly 128 MiB of bf16
    assert head.pinned_columns(65537, 152064, 11, 2) == 0       # one row over the budget
    assert head.pinned_columns(65536, 152064, 11, 4) == 0       # fp32 dlogits: twice the bytes
    assert head.pinned_columns(100, 50, 11, 2) == 50            # at most V distinct labels
    assert head.pinned_columns(700, 152064, 11, 2) == 700       # at most one per row
    assert head.pinned_columns(8192, 152064, 1, 2) == 0         # one chunk: one rounding
    assert head.pinned_columns(8192, 151936, 11, 2) == 1024     # 0.5B's V: the rule reads no H
    vocab = 152064
    assert head.one_pass_pins(8192, 768, 0, vocab, need_dw=True, itemsize=2) == 1024
    assert head.one_pass_pins(8192, 768, 0, vocab, need_dw=False, itemsize=2) == 0
    assert head.one_pass_pins(8192, 768, 3584, vocab, need_dw=True, itemsize=2) == 0   # cached: no pins, 1 + 6 chunks
    assert head.one_pass_pins(65536, 768, 0, vocab, need_dw=True, itemsize=2) == 1024  # 86 chunks
    assert head.one_pass_pins(73729, 768, 0, vocab, need_dw=True, itemsize=2) == -1    # 97 chunks
    monkeypatch.setattr(head, "PINNED_BYTES", 0)
    assert head.one_pass_pins(6000, 768, 0, vocab, need_dw=True, itemsize=2) == 0    # 8 chunks, unpinned
    assert head.one_pass_pins(6200, 768, 0, vocab, need_dw=True, itemsize=2) == -1   # 9 chunks


def test_cached_block_without_dh(monkeypatch):
    # A frozen hidden (dh not wanted): the cached block still writes dW and the loss.
    monkeypatch.setattr(head, "CACHE_FIRST_BLOCK", True)
    hidden, weight, labels = _inputs(30, 16, 65, seed=14, ignore_frac=0.0)
    hidden.requires_grad_(False)
    h64, w64 = _ref64(hidden, weight)
    saved = head.WORKSPACE_BYTES, head.FUSED_MAX_CHUNKS
    head.WORKSPACE_BYTES, head.FUSED_MAX_CHUNKS = 8 * 65 * 4, 1000
    try:
        loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction="mean",
                                      temperature=1.0)
        loss.backward()
    finally:
        head.WORKSPACE_BYTES, head.FUSED_MAX_CHUNKS = saved
    ref = reference.cross_entropy(h64, w64, labels.cpu(), ignore_index=IGN, reduction="mean")
    ref.backward()
    assert _rel(loss, ref) < TOL and _rel(weight.grad, w64.grad) < TOL


def test_second_backward_through_fused_ce_raises():
    hidden, weight, labels = _inputs(8, 8, 21, seed=7)
    loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction="sum",
                                  temperature=1.0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_plain_pytorch(dtype, ce_path):
    # Gradients come back in the inputs' dtype, and every output's error, pooled over independent
    # problems, is within 1.5x plain PyTorch's. One problem's scalar loss is a single draw: on a GPU
    # the small tiles' GEMMs round a few logits one bf16 ulp otherwise than plain PyTorch's GEMM
    # (the same logits at real tile sizes), which moved one seed's loss error from 6e-5 to 1.7e-4.
    sq, norm = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for seed in range(6):
        hidden, weight, labels = _inputs(24, 16, 97, dtype=dtype, seed=20 + seed)
        h64, w64 = _ref64(hidden, weight)
        ref = reference.cross_entropy(h64, w64, labels.cpu(), ignore_index=IGN)
        ref.backward()
        hp, wp = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
        plain = reference.cross_entropy(hp, wp, labels, ignore_index=IGN)  # logits in dtype, loss fp32
        plain.backward()
        loss = T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN, reduction="mean",
                                      temperature=1.0)
        loss.backward()
        assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
        exact = (ref, h64.grad, w64.grad)
        for row, outs in enumerate(((loss, hidden.grad, weight.grad), (plain, hp.grad, wp.grad))):
            sq[row] += torch.stack([(a.detach().double().cpu() - b.detach()).square().sum()
                                    for a, b in zip(outs, exact)])
        norm += torch.stack([b.detach().square().sum() for b in exact])
    ours, theirs = (sq / norm).sqrt()
    for name, a, b in zip(("loss", "dh", "dW"), ours.tolist(), theirs.tolist()):
        assert a <= 1.5 * b + 1e-6, f"{name}: relative error {a:.3g} > 1.5 x plain PyTorch's {b:.3g}"


def test_public_api_impl_triton_and_noncontiguous():
    hidden, weight, labels = _inputs(2 * 13, 16, 57, seed=9)
    h3 = hidden.detach().reshape(2, 13, 16).transpose(0, 1).requires_grad_(True)  # non-contiguous
    y2 = labels.reshape(2, 13).t()
    logp, ent = logitless.linear_log_probs(h3, weight, y2, impl="triton", temperature=0.8)
    rlogp, rent = reference.log_probs(h3.detach().double().cpu(), weight.detach().double().cpu(),
                                      y2.cpu(), temperature=0.8)
    assert logp.shape == (13, 2) and _rel(logp, rlogp) < TOL and _rel(ent, rent) < TOL
    loss = logitless.linear_cross_entropy(h3, weight, y2, impl="triton")
    assert _rel(loss, reference.cross_entropy(h3.detach().double().cpu(),
                                              weight.detach().double().cpu(), y2.cpu())) < TOL


def test_torch_compile_fullgraph_matches_eager():
    hidden, weight, labels = _inputs(16, 16, 45, seed=10)

    def step(h, w, y):
        ce = T.linear_cross_entropy(h, w, y, ignore_index=IGN, reduction="mean", temperature=1.0)
        logp, ent = T.linear_log_probs(h, w, y, ignore_index=IGN, temperature=0.7,
                                       return_entropy=True)
        return ce + (logp * 0.3).sum() + ent.mean()

    step(hidden, weight, labels).backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(hidden, weight, labels)
    out.backward()
    assert _rel(hidden.grad, gh) < 1e-6 and _rel(weight.grad, gw) < 1e-6


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(weight_dtype=torch.float16), "weight.dtype"),
        (dict(dtype=torch.float64), "hidden.dtype"),
        (dict(reduction="avg"), "reduction"),
        (dict(temperature=0.0), "temperature"),
        (dict(h_cols=7), "shapes"),
    ],
)
def test_bad_input_raises_before_kernels(kwargs, match):
    dtype = kwargs.get("dtype", torch.float32)
    hidden = torch.randn(4, kwargs.get("h_cols", 8), dtype=dtype, device=DEV)
    weight = torch.randn(11, 8, dtype=kwargs.get("weight_dtype", dtype), device=DEV)
    labels = torch.zeros(4, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=match):
        T.linear_cross_entropy(hidden, weight, labels, ignore_index=IGN,
                               reduction=kwargs.get("reduction", "mean"),
                               temperature=kwargs.get("temperature", 1.0))


def test_tile_formulas(monkeypatch):
    monkeypatch.setattr(head, "MAX_BLOCK_ROWS", 4096)
    monkeypatch.setattr(head, "MIN_SLAB", 2048)
    assert head.forward_tiles(8192, 152064, 2, 80 << 20) == (4096, 10240)
    assert head.forward_tiles(100, 50, 4, 1 << 20) == (100, 50)
    rows, cols = head.forward_tiles(64, 1000, 4, 4096)
    assert rows * cols * 4 <= 4096 and rows >= 1
    assert T.chunk_rows(8192, 152064, 2, 224 << 20) == 768
    assert head.backward_tiles(8192, 152064, 3584, 2, 224 << 20, True) == (8192, 7168)
    block, cols = head.backward_tiles(29, 151, 24, 4, 6144, True)
    assert block * (cols * 4 + 24 * 4) <= 6144 and block >= 1
    assert T.chunk_rows(10, 152064, 2, 192 << 20) == 10
    assert T.chunk_rows(5, 10**9, 4, 1) == 1
