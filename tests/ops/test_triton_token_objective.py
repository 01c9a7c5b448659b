"""The Triton ``linear_token_objective`` (gradients in the forward) against float64 autograd.

Without CUDA the kernels run in Triton's CPU interpreter (set up by ``tests/conftest.py``).
"""


import pytest
import torch

_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
pytest.importorskip("triton")
from logitless.ops.triton import head  # noqa: E402
import logitless.ops  # noqa: E402
from logitless.ops import reference  # noqa: E402
from logitless.ops import triton as T  # noqa: E402


DEV = "cuda" if _CUDA else "cpu"
IGN = -100
TOL = 1e-4  # fp32 inputs against float64


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    # Small buffers so that every call crosses several row chunks and column splits.
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 24 * 64 * 4)
    monkeypatch.setattr(head, "FORWARD_WORKSPACE_BYTES", 16 * 64 * 4)
    monkeypatch.setattr(head, "MAX_BLOCK_ROWS", 8)
    monkeypatch.setattr(head, "MIN_SLAB", 32)


@pytest.fixture(params=[1000, "pinned", 0], ids=["onepass", "pinned", "twopass"])
def path(monkeypatch, request):
    # 1000: one pass per row chunk (3 GEMMs); "pinned": the same with the labels' dlogits kept out
    # of the per-chunk dW rounding (head.PinnedColumns); 0: the slab forward + slab backward fallback.
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 0 if request.param == 0 else 1000)
    if request.param == "pinned":
        monkeypatch.setattr(head, "PINNED_COLUMNS", 3)  # most labels' own entries move on their own
    return request.param


def _inputs(n, h, v, seed, ignore_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / h**0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = IGN
    consts = {
        "old": torch.randn(n, generator=g, dtype=torch.float64) * 0.3 - 4.0,
        "ref": torch.randn(n, generator=g, dtype=torch.float64) * 0.3 - 4.0,
        "adv": torch.randn(n, generator=g, dtype=torch.float64),
        "w": torch.rand(n, generator=g, dtype=torch.float64) / n,
    }
    return hidden, weight, labels, consts


def _policy_terms(lp, ent, c, ent_coef):
    # A clipped-ratio objective with k3 KL and an entropy bonus: non-linear in logp and ent.
    ratio = torch.exp(lp - c["old"])
    terms = -torch.minimum(ratio * c["adv"], ratio.clamp(0.8, 1.28) * c["adv"])
    d = c["ref"] - lp
    terms = terms + 0.1 * (torch.exp(d) - d - 1)
    if ent is not None:
        terms = terms - ent_coef * ent
    return (terms * c["w"]).sum()


def _recording_objective(consts, seen):
    """The policy objective on the device; appends each call's rows (on the CPU) to ``seen``."""
    c32 = {k: c.float().to(DEV) for k, c in consts.items()}

    def objective(lp, ent, rows):
        seen.append(rows.cpu())
        assert lp.dtype == torch.float32 and lp.shape == rows.shape
        return _policy_terms(lp, ent, {k: c[rows] for k, c in c32.items()}, 0.05)

    return objective


def _reference(hidden, weight, labels, consts, temperature, need_entropy):
    """float64 log-probs and entropies through plain autograd, the objective on the valid rows:
    ``(h64, w64, lp, ent, want)``, with ``want.backward()`` done."""
    valid = labels != IGN
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = reference.log_probs(h64, w64, labels, ignore_index=IGN, temperature=temperature)
    want = _policy_terms(lp[valid], ent[valid] if need_entropy else None,
                         {k: c[valid] for k, c in consts.items()}, 0.05)
    want.backward()
    return h64, w64, lp, ent, want


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("need_entropy", [True, False])
@pytest.mark.parametrize("v,temperature", [(151, 0.7), (37, 1.3)])
def test_matches_float64_autograd(need_entropy, v, temperature, path):
    n, hd = 29, 24
    hidden, weight, labels, consts = _inputs(n, hd, v, seed=v)
    valid = labels != IGN
    h64, w64, lp, ent, want = _reference(hidden, weight, labels, consts, temperature, need_entropy)

    seen = []
    objective = _recording_objective(consts, seen)

    h = hidden.float().to(DEV).requires_grad_()
    w = weight.float().to(DEV).requires_grad_()
    got, got_lp, got_ent = T.linear_token_objective(
        h, w, labels.to(DEV), objective, ignore_index=IGN, temperature=temperature,
        need_entropy=need_entropy,
    )
    (got * 1.7).backward()
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(float(got) - float(want)) <= TOL * max(abs(float(want)), 1e-3)
    assert _rel(got_lp, lp) < TOL
    assert (got_ent is not None) == need_entropy
    if need_entropy:
        assert _rel(got_ent, ent) < TOL
        assert bool((got_ent.cpu()[~valid] == 0).all())
    assert bool((got_lp.cpu()[~valid] == 0).all())
    assert _rel(h.grad / 1.7, h64.grad) < TOL and _rel(w.grad / 1.7, w64.grad) < TOL
    assert bool((h.grad.cpu()[~valid] == 0).all())  # ignored rows: no gradient
    # the objective saw every non-ignored row exactly once, never an ignored one
    assert torch.equal(torch.cat(seen).sort().values, torch.nonzero(valid).squeeze(1))


def test_public_dispatcher_shapes_and_no_grad():
    hidden, weight, labels, consts = _inputs(2 * 9, 16, 53, seed=3)
    c32 = {k: c.float().reshape(-1).to(DEV) for k, c in consts.items()}

    def objective(lp, ent, rows):
        return _policy_terms(lp, ent, {k: c[rows] for k, c in c32.items()}, 0.02)

    h3 = hidden.float().reshape(2, 9, 16).to(DEV)
    w = weight.float().to(DEV)
    y2 = labels.reshape(2, 9).to(DEV)

    def objective64(lp, ent, rows):
        return _policy_terms(lp, ent, {k: c.to(DEV)[rows] for k, c in consts.items()}, 0.02)

    # impl="reference": the float64 reference log-probs and the objective through plain autograd
    want, want_lp, want_ent = logitless.ops.linear_token_objective(
        h3.double(), w.double(), y2, objective64, need_entropy=True, impl="reference", temperature=0.9,
    )
    assert want.dtype == torch.float64 and want_lp.shape == (2, 9)
    with torch.no_grad():  # forward-only slab pass: value, logp, entropy
        got, got_lp, got_ent = logitless.ops.linear_token_objective(
            h3, w, y2, objective, need_entropy=True, impl="triton", temperature=0.9,
        )
    assert got_lp.shape == (2, 9) and got_ent.shape == (2, 9)
    assert abs(float(got) - float(want)) <= TOL * abs(float(want))
    assert _rel(got_lp, want_lp) < TOL and _rel(got_ent, want_ent) < TOL


def test_all_ignored_gives_zero_and_zero_grads(path):
    hidden, weight, labels, _ = _inputs(7, 8, 19, seed=1)
    labels[:] = IGN
    h = hidden.float().to(DEV).requires_grad_()
    w = weight.float().to(DEV).requires_grad_()
    calls = []

    def objective(lp, ent, rows):
        calls.append(rows.numel())
        return lp.sum()

    got, lp, _ = T.linear_token_objective(h, w, labels.to(DEV), objective, ignore_index=IGN,
                                          temperature=1.0, need_entropy=False)
    got.backward()
    assert float(got) == 0.0 and sum(calls) == 0
    assert bool((h.grad == 0).all()) and bool((w.grad == 0).all()) and bool((lp == 0).all())


def test_second_backward_and_bad_objective_raise():
    hidden, weight, labels, _ = _inputs(6, 8, 19, seed=2, ignore_frac=0.0)
    h = hidden.float().to(DEV).requires_grad_()
    w = weight.float().to(DEV)
    loss, _, _ = T.linear_token_objective(h, w, labels.to(DEV), lambda lp, ent, rows: -lp.sum(),
                                          ignore_index=IGN, temperature=1.0, need_entropy=False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()
    with pytest.raises(ValueError, match="scalar"):
        T.linear_token_objective(h, w, labels.to(DEV), lambda lp, ent, rows: -lp, ignore_index=IGN,
                                 temperature=1.0, need_entropy=False)
    with pytest.raises(ValueError, match="token_objective"):
        logitless.ops.linear_token_objective(h, w, labels.to(DEV), "not callable", impl="triton")
    with pytest.raises(ValueError, match="need_entropy"):
        logitless.ops.linear_token_objective(h, w, labels.to(DEV), lambda *a: a[0].sum(), need_entropy=1)


@pytest.mark.parametrize("need_entropy", [True, False])
def test_cached_first_block_then_chunks(monkeypatch, need_entropy):
    # H = 8 < the valid rows: the first 8 valid rows take the cached block (logits in dW's buffer),
    # the rest 10-row chunks; the objective sees each row once; float64 gradients.
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 1000)
    monkeypatch.setattr(head, "CACHED_SLAB", 24)  # several V slabs in the statistics pass
    monkeypatch.setattr(head, "CACHE_FIRST_BLOCK", True)
    blocks = []
    cached_block = head._cached_block
    monkeypatch.setattr(head, "_cached_block", lambda *a, **k: blocks.append(a[4]) or cached_block(*a, **k))
    n, hd, v, temperature = 41, 8, 151, 0.9
    hidden, weight, labels, consts = _inputs(n, hd, v, seed=5)
    valid = labels != IGN
    h64, w64, lp, _, want = _reference(hidden, weight, labels, consts, temperature, need_entropy)
    seen = []
    objective = _recording_objective(consts, seen)

    h = hidden.float().to(DEV).requires_grad_()
    w = weight.float().to(DEV).requires_grad_()
    got, got_lp, _ = T.linear_token_objective(h, w, labels.to(DEV), objective, ignore_index=IGN,
                                              temperature=temperature, need_entropy=need_entropy)
    got.backward()
    assert blocks == [hd]
    assert abs(float(got) - float(want)) <= TOL * max(abs(float(want)), 1e-3)
    assert _rel(got_lp, lp) < TOL
    assert _rel(h.grad, h64.grad) < TOL and _rel(w.grad, w64.grad) < TOL
    assert torch.equal(torch.cat(seen).sort().values, torch.nonzero(valid).squeeze(1))


@pytest.mark.parametrize("replayable", [True, False])
@pytest.mark.parametrize("need_dw", [True, False])
def test_path_past_the_one_pass_chunk_limit(monkeypatch, need_dw, replayable):
    # Past FUSED_MAX_CHUNKS chunks, where the per-chunk objective calls are replayed (CUDA), the
    # objective follows cross-entropy's rule: a trained head (dW) keeps the one pass with pinned
    # label columns, a frozen head the plain one pass; where they run eagerly, the two passes.
    # Either way the values match float64 autograd.
    from logitless.ops.triton import token_objective as TO

    monkeypatch.setattr(TO.ChunkUpstreams, "replayable", staticmethod(lambda *a: replayable))
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 1)
    monkeypatch.setattr(head, "PINNED_COLUMNS", 3)
    calls = {"two_pass": 0, "pinned": 0}
    forward, pinned = head._forward, head.PinnedColumns

    def spy_forward(*a, **k):
        calls["two_pass"] += 1
        return forward(*a, **k)

    def spy_pinned(*a, **k):
        calls["pinned"] += 1
        return pinned(*a, **k)

    monkeypatch.setattr(head, "_forward", spy_forward)
    monkeypatch.setattr(head, "PinnedColumns", spy_pinned)
    n, hd, v, temperature = 61, 24, 151, 0.8
    hidden, weight, labels, consts = _inputs(n, hd, v, seed=11)
    h64, w64, lp, _, want = _reference(hidden, weight, labels, consts, temperature, True)
    chunks = []
    objective = _recording_objective(consts, chunks)

    h = hidden.float().to(DEV).requires_grad_()
    w = weight.float().to(DEV).requires_grad_(need_dw)
    got, got_lp, _ = T.linear_token_objective(h, w, labels.to(DEV), objective, ignore_index=IGN,
                                              temperature=temperature, need_entropy=True)
    got.backward()
    if not replayable:
        assert calls == {"two_pass": 1, "pinned": 0} and len(chunks) == 1
    else:
        assert calls == {"two_pass": 0, "pinned": int(need_dw)} and len(chunks) > 1
    # either way the objective saw every valid row once
    assert torch.equal(torch.cat(chunks).sort().values, torch.nonzero(labels != IGN).squeeze(1))
    assert abs(float(got) - float(want)) <= TOL * max(abs(float(want)), 1e-3)
    assert _rel(got_lp, lp) < TOL and _rel(h.grad, h64.grad) < TOL
    if need_dw:
        assert _rel(w.grad, w64.grad) < TOL



@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("need_entropy", [True, False])
@pytest.mark.parametrize("entropy_coef", [0.05, 0.0])
def test_functorch_upstreams_equal_autograd(compiled, need_entropy, entropy_coef):
    # The one pass's per-chunk (value, a, b) by torch.func.grad_and_value (compiled or not, as
    # ChunkUpstreams runs it on CUDA) against the eager autograd call, for an objective that reads
    # per-row constants by `rows` and detaches the log-prob (GRPO without old log-probs). Given the
    # entropy, torch.func returns b even where the objective ignores it: zeros, as autograd's None means.
    from logitless.ops.triton import token_objective as TO

    n = 40
    _, _, _, consts = _inputs(n, 4, 7, seed=2)
    c32 = {k: c.float() for k, c in consts.items()}
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(n, generator=g) * 5
    ent = torch.rand(n, generator=g) * 3

    def objective(lp, en, rows):
        c = {k: v[rows] for k, v in c32.items()}
        value = _policy_terms(lp, en if entropy_coef else None, c, entropy_coef)
        return value + (torch.exp(lp - lp.detach()) * c["adv"] * c["w"]).sum()

    rows = torch.arange(7, 31)
    want = TO._coefficients(objective, logp[rows], ent[rows] if need_entropy else None, rows, True)
    fn = TO._compiled() if compiled else TO._upstreams_of
    got = fn(objective, logp, ent if need_entropy else None, rows)
    assert (got[2] is None) == (not need_entropy)
    assert (want[2] is None) == (not (need_entropy and entropy_coef))
    if got[2] is not None and want[2] is None:
        want = (*want[:2], torch.zeros_like(got[2]))
    for a, b in zip(got, want):
        if b is not None:
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)


def _row_objective_call(impl, consts, hidden, weight, labels, shape, need_entropy, temperature):
    """``linear_token_objective`` of a RowObjective whose constants have the labels' ``shape``."""
    from logitless.ops import RowObjective

    dtype = torch.float64 if impl == "reference" else torch.float32
    named = {k: c.to(dtype).reshape(shape).to(DEV) for k, c in consts.items()}
    named["unused"] = None  # left out: fn never sees the key
    seen = []

    def fn(lp, ent, c):
        seen.append(sorted(c))
        assert all(v.shape == lp.shape for v in c.values())
        return _policy_terms(lp, ent, c, 0.05)

    objective = RowObjective(fn, named, key=("policy", 0.05))
    h = hidden.to(dtype).reshape(*shape, -1).to(DEV).requires_grad_()
    w = weight.to(dtype).to(DEV).requires_grad_()
    got, got_lp, got_ent = logitless.ops.linear_token_objective(
        h, w, labels.reshape(shape).to(DEV), objective, need_entropy=need_entropy, impl=impl,
        temperature=temperature, chunk_size=5,
    )
    (got * 1.3).backward()
    assert all(names == sorted(consts) for names in seen) and seen
    return got, got_lp.reshape(-1), got_ent, h.grad.reshape(-1, h.shape[-1]) / 1.3, w.grad / 1.3


@pytest.mark.parametrize("need_entropy", [True, False])
def test_row_objective_on_the_triton_head_matches_float64(need_entropy, path):
    # The named-constants form of the objective: constants of the labels' (B, S) shape, gathered
    # at each chunk's rows by the op; float64 autograd on the plain closure form is the reference.
    hidden, weight, labels, consts = _inputs(3 * 9, 16, 53, seed=11)
    h64, w64, lp, ent, want = _reference(hidden, weight, labels, consts, 0.9, need_entropy)
    got, got_lp, _, dh, dw = _row_objective_call("triton", consts, hidden, weight, labels, (3, 9), need_entropy, 0.9)
    assert abs(float(got) - float(want)) <= TOL * abs(float(want))
    assert _rel(got_lp, lp) < TOL and _rel(dh, h64.grad) < TOL and _rel(dw, w64.grad) < TOL


@pytest.mark.parametrize("impl", ["chunked", "reference"])
def test_row_objective_on_the_other_impls_matches_float64(impl):
    hidden, weight, labels, consts = _inputs(2 * 11, 12, 41, seed=12)
    h64, w64, lp, ent, want = _reference(hidden, weight, labels, consts, 1.1, True)
    got, got_lp, got_ent, dh, dw = _row_objective_call(impl, consts, hidden, weight, labels, (2, 11), True, 1.1)
    assert abs(float(got) - float(want)) <= TOL * abs(float(want))
    assert _rel(got_lp, lp) < TOL and _rel(got_ent.reshape(-1), ent) < TOL
    assert _rel(dh, h64.grad) < TOL and _rel(dw, w64.grad) < TOL


def test_row_objective_bad_constants_and_key_raise_before_compute():
    from logitless.ops import RowObjective

    hidden, weight, labels, _ = _inputs(6, 8, 19, seed=2, ignore_frac=0.0)
    h, w, y = hidden.float().to(DEV), weight.float().to(DEV), labels.to(DEV)
    fn = lambda lp, ent, c: (c["adv"] * lp).sum()  # noqa: E731
    short = RowObjective(fn, {"adv": torch.ones(5, device=DEV)}, key=0)
    with pytest.raises(ValueError, match=r"constant 'adv' has 5 values, expected one per label \(6\)"):
        logitless.ops.linear_token_objective(h, w, y, short, impl="triton")
    if _CUDA:
        elsewhere = RowObjective(fn, {"adv": torch.ones(6)}, key=0)
        with pytest.raises(ValueError, match="constant 'adv' is on cpu"):
            logitless.ops.linear_token_objective(h, w, y, elsewhere, impl="triton")
    with pytest.raises(ValueError, match="constant 'adv' must be a tensor or None, got list"):
        RowObjective(fn, {"adv": [1.0] * 6}, key=0)
    with pytest.raises(ValueError, match="key must be hashable"):
        RowObjective(fn, {"adv": torch.ones(6)}, key=[0.2])
