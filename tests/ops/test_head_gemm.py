"""``LOGITLESS_HEAD_GEMM=triton``: the head's GEMMs with their epilogues inside (gemm_epilogues).

Small odd shapes in Triton's CPU interpreter (``tests/conftest.py``): the knob switches the path
(spies count the kernels' launches), inputs a tensor descriptor cannot read fall back to cuBLAS,
each kernel against float64, and the public ops with the knob on equal the knob off. Accuracy
relative to plain PyTorch: ``tests/ops/test_head_accuracy.py::test_head_gemm_within_plain_pytorch``.
"""

import collections

import pytest
import torch

pytest.importorskip("triton")
import logitless  # noqa: E402
from logitless.ops import reference  # noqa: E402
from logitless.ops.triton import gemm_epilogues, head  # noqa: E402
from logitless.settings import settings  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
IGN = -100
KERNELS = ("logits_stats", "logits_dlogits", "dw_accumulate")


@pytest.fixture
def launches(monkeypatch):
    """Counts the calls of each Triton GEMM (wrapping the module functions head.py calls)."""
    counts = collections.Counter()
    for name in KERNELS:
        real = getattr(gemm_epilogues, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(gemm_epilogues, name, spy)
    # Small buffers: several launches of row blocks, V slabs and row chunks.
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 24 * 64 * 4)
    monkeypatch.setattr(head, "FORWARD_WORKSPACE_BYTES", 16 * 64 * 4)
    monkeypatch.setattr(head, "MAX_BLOCK_ROWS", 8)
    monkeypatch.setattr(head, "MIN_SLAB", 32)
    return counts


def _inputs(n, h, v, dtype, seed=0, ignore_frac=0.1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / h**0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = IGN
    return hidden.to(dtype).to(DEV), weight.to(dtype).to(DEV), labels.to(DEV)


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _log_probs_and_grads(hidden, weight, labels, temperature, g1, g2):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, ent = logitless.linear_log_probs(h, w, labels, temperature=temperature, impl="triton")
    ((logp * g1.to(logp)).sum() + (ent * g2.to(ent)).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _cross_entropy_and_grads(hidden, weight, labels, temperature, reduction="mean"):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = logitless.linear_cross_entropy(h, w, labels, temperature=temperature, reduction=reduction,
                                          impl="triton")
    (loss if loss.dim() == 0 else loss.sum()).backward()
    return loss.detach(), h.grad, w.grad


def test_knob_values_and_bad_value_names_the_variable(monkeypatch):
    assert settings.head_gemm == "auto"
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "Triton")
    assert settings.head_gemm == "triton"
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "cutlass")
    with pytest.raises(ValueError, match="LOGITLESS_HEAD_GEMM='cutlass'.*cublas.*triton.*auto"):
        settings.head_gemm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_knob_switches_every_gemm_and_results_match_float64(monkeypatch, launches, dtype):
    """Knob on: log-probs + entropy run the statistics GEMM, the dlogits GEMM and the dW GEMM (every
    output against float64); knob off ("cublas", and "auto" while no measurement is committed): none."""
    hidden, weight, labels = _inputs(37, 16, 257, dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    g1, g2 = torch.randn(37, generator=g, dtype=torch.float64), torch.randn(37, generator=g, dtype=torch.float64)
    h64 = hidden.detach().double().cpu().requires_grad_()
    w64 = weight.detach().double().cpu().requires_grad_()
    rlogp, rent = reference.log_probs(h64, w64, labels.cpu(), ignore_index=IGN, temperature=0.7)
    ((rlogp * g1).sum() + (rent * g2).sum()).backward()
    for mode in ("cublas", "auto"):
        monkeypatch.setenv("LOGITLESS_HEAD_GEMM", mode)
        _log_probs_and_grads(hidden, weight, labels, 0.7, g1, g2)
        assert sum(launches.values()) == 0, mode
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "triton")
    logp, ent, dh, dw = _log_probs_and_grads(hidden, weight, labels, 0.7, g1, g2)
    assert all(launches[k] > 0 for k in KERNELS), dict(launches)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: dh and dW are rounded to bf16
    assert _rel(logp, rlogp) < 1e-5 and _rel(ent, rent) < 1e-5  # fp32 logits, bf16 inputs exact
    assert _rel(dh, h64.grad) < tol and _rel(dw, w64.grad) < tol


@pytest.mark.parametrize("n,h,v", [(1, 16, 9), (37, 64, 257)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_knob_on_equals_knob_off(monkeypatch, launches, n, h, v, dtype):
    """Public ops end to end: log-probs + entropy, cross-entropy (two-pass, one-pass with the dW GEMM,
    reduction none) agree with the cuBLAS path within each dtype's rounding."""
    hidden, weight, labels = _inputs(n, h, v, dtype, seed=n + v, ignore_frac=0.1 if n > 1 else 0.0)
    g = torch.Generator().manual_seed(3)
    g1, g2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for mode_kwargs in ({"FUSED_MAX_CHUNKS": 0, "PINNED_MAX_CHUNKS": 0}, {"FUSED_MAX_CHUNKS": 1000}):
        for k, val in mode_kwargs.items():
            monkeypatch.setattr(head, k, val)
        outs = {}
        for mode in ("cublas", "triton"):
            monkeypatch.setenv("LOGITLESS_HEAD_GEMM", mode)
            outs[mode] = (_log_probs_and_grads(hidden, weight, labels, 1.3, g1, g2)
                          + _cross_entropy_and_grads(hidden, weight, labels, 1.3)
                          + _cross_entropy_and_grads(hidden, weight, labels, 0.8, reduction="none"))
        for a, b in zip(outs["triton"], outs["cublas"]):
            assert _rel(a, b) < tol
    assert all(launches[k] > 0 for k in KERNELS), dict(launches)


@pytest.mark.parametrize("dtype,h", [(torch.bfloat16, 12), (torch.float32, 6)])
def test_misaligned_rows_fall_back_to_cublas(monkeypatch, launches, dtype, h):
    """H * itemsize not a multiple of 16 bytes: no tensor descriptor, the cuBLAS path runs instead."""
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "triton")
    hidden, weight, labels = _inputs(19, h, 65, dtype, seed=4)
    assert not gemm_epilogues.supported(hidden, weight)
    loss, dh, dw = _cross_entropy_and_grads(hidden, weight, labels, 1.0)
    logitless.linear_log_probs(hidden, weight, labels, impl="triton")
    assert sum(launches.values()) == 0
    h64 = hidden.detach().double().cpu().requires_grad_()
    w64 = weight.detach().double().cpu().requires_grad_()
    ref = reference.cross_entropy(h64, w64, labels.cpu(), ignore_index=IGN)
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(loss, ref) < tol and _rel(dh, h64.grad) < tol and _rel(dw, w64.grad) < tol


def test_unaligned_base_is_not_supported():
    w = torch.randn(9 * 16 + 1, dtype=torch.bfloat16)[1:].view(9, 16)  # 2-byte offset base
    assert not gemm_epilogues.supported(torch.randn(3, 16, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("compact", ["0", "1"])
def test_ignored_rows_with_nan_hidden(monkeypatch, launches, compact):
    """An ignored row's hidden state may be NaN: compacted away, or (no compaction) its outputs are 0
    and its zeroed copy keeps the NaN out of dW, as on the cuBLAS path."""
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "triton")
    monkeypatch.setenv("LOGITLESS_TRITON_COMPACT", compact)
    hidden, weight, labels = _inputs(21, 16, 65, torch.float32, seed=5, ignore_frac=0.3)
    hidden[labels == IGN] = float("nan")
    h64 = hidden.detach().double().cpu().requires_grad_()
    w64 = weight.detach().double().cpu().requires_grad_()
    logp, ent = logitless.linear_log_probs(hidden, weight, labels, temperature=0.9, impl="triton")
    for t in (logp, ent):
        assert torch.isfinite(t).all() and (t[labels == IGN] == 0).all()
    monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", 0)
    monkeypatch.setattr(head, "PINNED_MAX_CHUNKS", 0)
    loss, dh, dw = _cross_entropy_and_grads(hidden, weight, labels, 0.9)
    ref = reference.cross_entropy(h64.nan_to_num(0.0), w64, labels.cpu(), ignore_index=IGN, temperature=0.9)
    ref.backward()
    assert _rel(loss, ref) < 1e-5 and _rel(dw, w64.grad) < 1e-5
    assert torch.isfinite(dh).all() and _rel(dh, h64.grad) < 1e-5
    assert launches["logits_stats"] > 0 and launches["dw_accumulate"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_dw_gemm_rounds_once_like_addmm(dtype, accumulate):
    """``dW (+)= dl.T @ h``: the accumulator starts from dW's tile, one rounding; error against
    float64 within 1.5x that of torch's ``addmm_`` (also one rounding per call), K rows not a
    multiple of the block, a slab of dW not starting at row 0."""
    g = torch.Generator().manual_seed(6)
    rows, vocab, hid = 37, 75, 64
    dl = torch.randn(rows, 80, generator=g).to(dtype).to(DEV)[:, :vocab]  # row stride 80: aligned
    h = torch.randn(rows, hid, generator=g).to(dtype)
    dw = torch.randn(vocab + 8, hid, generator=g).to(dtype)
    exact = dw[8:].double() * accumulate + dl.cpu().double().t() @ h.double()
    ours = dw.clone().to(DEV)
    gemm_epilogues.dw_accumulate(ours[8:], dl, h.to(DEV), accumulate)
    plain = dw[8:].clone()
    plain.addmm_(dl.cpu().t(), h, beta=float(accumulate))
    assert torch.equal(ours[:8].cpu(), dw[:8])  # rows outside the slab untouched
    assert _rel(ours[8:], exact) <= 1.5 * _rel(plain, exact) + 1e-7


def test_statistics_gemm_partials_merge_to_float64():
    """The statistics GEMM alone: per-row (max, sum exp, sum exp * shifted logit) over V tiles and
    row launches merge into the float64 log-sum-exp and entropy, label logit included."""
    hidden, weight, labels = _inputs(37, 64, 1001, torch.float32, seed=7)
    z = hidden.double().cpu() @ weight.double().cpu().t() / 0.6
    state = torch.empty(37, 3, device=DEV)
    z_y = torch.zeros(37, device=DEV)
    for r0 in (0, 32):  # two launches: rows [0, 32) and [32, 37)
        r1 = min(r0 + 32, 37)
        gemm_epilogues.logits_stats(hidden[r0:r1], weight, labels, None, r0, state, z_y, 1 / 0.6, IGN)
    m, s, t = state.double().cpu().unbind(1)
    lse = m + s.log()
    assert _rel(lse, z.logsumexp(1)) < 1e-6
    p = (z - z.logsumexp(1, keepdim=True)).exp()
    assert _rel(s.log() - t / s, -(p * p.log()).sum(1)) < 1e-5
    valid = (labels != IGN).cpu()
    assert _rel(z_y.cpu()[valid], z.gather(1, labels.cpu().clamp(min=0)[:, None])[:, 0][valid]) < 1e-6


def test_token_objective_knob_on_equals_knob_off(monkeypatch, launches):
    """The fused GRPO objective shares head.py's paths: its forward + recompute fallback and its
    one-pass chunks run the Triton GEMMs with the knob on, with the knob-off values and gradients."""
    hidden, weight, labels = _inputs(29, 16, 131, torch.bfloat16, seed=8)
    adv = torch.randn(29, generator=torch.Generator().manual_seed(9)).to(DEV)

    def objective(lp, ent, rows):
        return -(adv[rows] * lp).sum() - 0.01 * ent.sum()

    for max_chunks in (0, 1000):
        monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", max_chunks)
        monkeypatch.setattr(head, "PINNED_MAX_CHUNKS", max_chunks)
        outs = {}
        for mode in ("cublas", "triton"):
            monkeypatch.setenv("LOGITLESS_HEAD_GEMM", mode)
            h = hidden.detach().clone().requires_grad_()
            w = weight.detach().clone().requires_grad_()
            value, logp, ent = logitless.ops.triton.linear_token_objective(
                h, w, labels, objective, ignore_index=IGN, temperature=0.9, need_entropy=True)
            value.backward()
            outs[mode] = (value.detach(), logp, ent, h.grad, w.grad)
        for a, b in zip(outs["triton"], outs["cublas"]):
            assert _rel(a, b) < 2e-2
    assert all(launches[k] > 0 for k in KERNELS), dict(launches)


_COMPILE_FOR_H200 = """
import importlib, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
hg = importlib.import_module("logitless.ops.triton.gemm_epilogues")
ROWS = {"labels_ptr": "i64", "idx_ptr": "i64", "lse_ptr": "fp64", "part_ptr": "fp32", "zy_ptr": "fp32"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ONES = ("M", "ROWS", "row0", "col0", "num_tiles", "plane")
KERNELS = (("stats", hg.logits_stats_kernel, dict(HAS_IDX=True)),
           ("dlogits", hg.logits_dlogits_kernel, dict(MODE_CE=False, HAS_GLP=True, HAS_GENT=True, HAS_IDX=True)),
           ("dlogits", hg.logits_dlogits_kernel, dict(MODE_CE=True, HAS_GLP=False, HAS_GENT=False, HAS_IDX=False)),
           ("dw", hg.dw_accumulate_kernel, dict(ACCUMULATE=True)))
# each kind at its default blocks, and warp-specialised at 128-row tiles of 8 warps (the sweep's
# warp-specialised shape; Triton 3.9 cannot warp-specialise the dW GEMM's 4-warp 64 x 256 tile)
WS_TILE = {"bf16": (128, 128, 64, 8, 8, 3, 1), "fp16": (128, 128, 64, 8, 8, 3, 1), "fp32": (64, 128, 32, 8, 8, 3, 1)}
for dtype, torch_dtype in DTYPES.items():
    for kind, kernel, extra in KERNELS:
        for bm, bn, bk, group, warps, stages, ws in {hg.BLOCKS[(kind, torch_dtype)], WS_TILE[dtype]}:
            constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, NUM_PROGRAMS=132,
                              PRECISION=hg._precision(torch_dtype), WARP_SPECIALIZE=bool(ws), **extra)
            signature = {name: "constexpr" if name in constexprs else
                         "*" + ROWS.get(name, dtype) if name.endswith("_ptr") else
                         "fp32" if name == "inv_t" else "i64" if name in ("row0", "plane") else "i32"
                         for name in kernel.arg_names}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
            ptx = compiled.asm["ptx"]
            name = (kernel.__name__, dtype, ws)
            assert "cp.async.bulk.tensor" in ptx, ("no TMA load", name)
            assert dtype == "fp32" or "wgmma.mma_async" in ptx, ("no wgmma", name)
            assert "st.local" not in ptx, ("register spills", name)
            # Triton makes an integer argument equal to 1 a compile-time constant (one row, one tile)
            ones = {n: 1 for n in ONES if n in kernel.arg_names}
            triton.compile(ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(ones, "constexpr")},
                                     constexprs={**constexprs, **ones}), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages})
for ones in ({}, {n: 1 for n in ONES if n in hg.merge_tiles_kernel.arg_names}):
    merge = triton.compile(ASTSource(fn=hg.merge_tiles_kernel, signature={
        n: "constexpr" if n.startswith("BLOCK") or n in ones else "*fp32" if n.endswith("_ptr") else
        "i64" if n in ("row0", "plane") else "i32" for n in hg.merge_tiles_kernel.arg_names},
        constexprs=dict(BLOCK_R=64, BLOCK_T=32, **ones)), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert merge.asm["cubin"]
print("compiled")
"""


def test_kernels_compile_for_an_h200(compile_for_sm90):
    """The interpreter does not compile: every kernel is built for sm_90 as on an H200 (Triton's own
    ptxas, no device; a fresh process without the interpreter) at the default blocks of each dtype,
    and warp-specialised at a 128-row tile, and with the arguments that can be 1 (one row, one V tile)
    as the constants Triton then makes of them; bf16/fp16 must load through TMA into wgmma, none may spill."""
    compile_for_sm90(_COMPILE_FOR_H200)


def test_scratch_allocator_is_set_in_every_thread():
    """Device-side tensor descriptors take global scratch from Triton's allocator, a context variable:
    autograd runs CUDA backwards on its own threads, which do not see one set in the forward's thread.
    Each thread that launches must find one (set here only where none is; no GPU needed to check)."""
    import threading

    from triton.runtime import _allocation

    seen = {}

    def launch_setup(name):
        gemm_epilogues._launch_setup(torch.device("cuda"))
        seen[name] = _allocation._allocator.get()

    for name in ("forward", "backward"):
        thread = threading.Thread(target=launch_setup, args=(name,))
        thread.start()
        thread.join()
    assert not any(isinstance(a, _allocation.NullAllocator) for a in seen.values()), seen


def test_backward_runs_the_gemms_its_forward_ran_whatever_the_knob_says_then(launches):
    """The Triton forward's statistics come from fp32 logits, the cuBLAS backward's probabilities from
    logits rounded to the input dtype: mixed, they do not sum to 1. A forward under
    ``settings.override(head_gemm="triton")`` whose backward runs after the block keeps the Triton
    GEMMs for its backward (and the other way round)."""
    hidden, weight, labels = _inputs(37, 64, 257, torch.bfloat16, seed=5)
    g = torch.Generator().manual_seed(6)
    g1, g2 = torch.randn(37, generator=g), torch.randn(37, generator=g)
    with settings.override(head_gemm="triton"):
        expected = _log_probs_and_grads(hidden, weight, labels, 0.7, g1, g2)
    launches.clear()
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    with settings.override(head_gemm="triton"):
        logp, ent = logitless.linear_log_probs(h, w, labels, temperature=0.7, impl="triton")
    ((logp * g1.to(logp)).sum() + (ent * g2.to(ent)).sum()).backward()  # knob back at cublas
    assert launches["logits_dlogits"] > 0 and launches["dw_accumulate"] > 0
    torch.testing.assert_close(h.grad, expected[2], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, expected[3], rtol=0, atol=0)

    launches.clear()
    h.grad = w.grad = None
    logp, ent = logitless.linear_log_probs(h, w, labels, temperature=0.7, impl="triton")  # cublas forward
    with settings.override(head_gemm="triton"):
        ((logp * g1.to(logp)).sum() + (ent * g2.to(ent)).sum()).backward()
    assert sum(launches.values()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dw_gemm_refuses_a_row_stride_tma_cannot_read(dtype):
    """dl with 75 columns packed (75 * itemsize bytes a row, not a multiple of 16): a clear error
    naming the argument before any launch, never a GEMM over misread rows."""
    dl = torch.randn(37, 75, device=DEV).to(dtype)
    h = torch.randn(37, 64, device=DEV).to(dtype)
    dw = torch.zeros(75, 64, device=DEV, dtype=dtype)
    with pytest.raises(ValueError, match=r"dw_accumulate: dl of shape \(37, 75\), strides \(75, 1\)"):
        gemm_epilogues.dw_accumulate(dw, dl, h, accumulate=False)
    assert (dw == 0).all()


def test_gemm_backend_argument_chooses_the_gemms_over_the_knob(monkeypatch, launches):
    """``gemm_backend`` of the ops and of the loss components picks the GEMMs of that call, whatever
    LOGITLESS_HEAD_GEMM says (the knob is only the default), forward and backward alike."""
    from logitless.losses import LinearCrossEntropyLoss, TokenLogProbs
    from logitless.modules import HeadInput

    hidden, weight, labels = _inputs(29, 16, 129, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    g1, g2 = torch.randn(29, generator=g), torch.randn(29, generator=g)

    def run(gemm_backend):
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach().clone().requires_grad_()
        logp, ent = logitless.linear_log_probs(h, w, labels, impl="triton", gemm_backend=gemm_backend)
        ((logp * g1).sum() + (ent * g2).sum()).backward()
        loss = LinearCrossEntropyLoss(impl="triton", gemm_backend=gemm_backend)(HeadInput(h, w), labels)
        loss.backward()
        lp, _ = TokenLogProbs(impl="triton", gemm_backend=gemm_backend)(HeadInput(h.detach(), w.detach()),
                                                                       labels)
        return logp.detach(), ent.detach(), loss.detach(), lp, h.grad, w.grad

    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "cublas")
    via_argument = run("triton")
    assert all(launches[k] > 0 for k in KERNELS), dict(launches)
    launches.clear()
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "triton")
    via_knob = run(None)
    assert all(launches[k] > 0 for k in KERNELS), dict(launches)
    launches.clear()
    on_cublas = run("cublas")
    assert sum(launches.values()) == 0  # the argument wins over the knob
    for a, b in zip(via_argument, via_knob):
        assert torch.equal(a, b)  # the same kernels, the same bits
    for a, b in zip(via_argument, on_cublas):
        assert _rel(a, b) < 1e-5


def test_gemm_backend_reaches_the_token_objective(monkeypatch):
    """The fused objective computes its gradients in its forward, inside the call's backend: the GEMM
    choices its one pass makes see the argument, not the setting, which is left as it was."""
    from logitless.ops import quack_head

    seen = []
    monkeypatch.setattr(quack_head, "outputs_apply", lambda hidden, weight, mode: seen.append(mode) or False)
    hidden, weight, labels = _inputs(23, 16, 129, torch.float32, seed=9)
    adv = torch.randn(23, generator=torch.Generator().manual_seed(10)).to(DEV)
    objective = lambda lp, ent, rows: -(adv[rows] * lp).sum()  # noqa: E731
    monkeypatch.setenv("LOGITLESS_HEAD_GEMM", "auto")
    for backend, expected in (("cublas", "cublas"), (None, "auto")):
        seen.clear()
        h = hidden.detach().clone().requires_grad_()
        loss, _, _ = logitless.ops.linear_token_objective(h, weight, labels, objective, impl="triton",
                                                          gemm_backend=backend)
        loss.backward()
        assert seen and set(seen) == {expected}, (backend, seen)
    assert settings.head_gemm == "auto"  # the call's backend does not leak into the setting
