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


@pytest.mark.parametrize("vocab,want", [(152064, 192), (128256, 192), (151936, 128), (32000, 128),
                                        (256000, 128), (32001, 0), (50257, 0)])
def test_stats_tile_n_is_the_first_choice_that_divides_the_vocabulary(vocab, want):
    """Qwen2.5-7B, Llama-3, Qwen2.5-0.5B, Llama-2, Gemma, and two vocabularies no tile divides."""
    assert quack_head.stats_tile_n(vocab) == want
    if want:
        assert vocab % want == 0
        assert all(vocab % t for t in quack_head.TILE_N_CHOICES[:quack_head.TILE_N_CHOICES.index(want)])


def test_outputs_apply_needs_a_dividing_tile(monkeypatch):
    monkeypatch.setattr(quack_head, "forward_applies", lambda hidden, weight, mode: True)
    assert quack_head.outputs_apply(torch.zeros(4, 8), torch.zeros(384, 8), "quack")
    assert not quack_head.outputs_apply(torch.zeros(4, 8), torch.zeros(385, 8), "quack")


def _assert_aligned(*tensors):
    assert all(t.data_ptr() % 16 == 0 for t in tensors), [t.data_ptr() % 16 for t in tensors]


def _emulated_epilogue(hidden, weight, labels, log2e_over_t, *, round_logits, tile_n, tile_max, sum_exp,
                       sum_exp_x, target_acc, logits=None):
    """What QuACK's statistics epilogue writes (``_quack_epilogues.tile_entropy_stats``), in torch;
    QuACK refuses operands whose data is not 16-byte aligned."""
    _assert_aligned(hidden, weight, labels, tile_max, sum_exp, target_acc,
                    *([] if sum_exp_x is None else [sum_exp_x]))
    assert sum_exp_x is not None or round_logits
    raw = hidden.float() @ weight.float().T
    acc = raw.bfloat16().float() if round_logits else raw
    if logits is not None:  # the one pass's chunk: the rounded logits stored, rows 16-byte aligned
        assert round_logits and logits.stride(0) * logits.element_size() % 16 == 0
        _assert_aligned(logits)
        logits.copy_(acc)
    rows, vocab = acc.shape
    tiles = acc.view(rows, vocab // tile_n, tile_n)
    top = raw.view(rows, vocab // tile_n, tile_n).amax(-1)  # the prepass sees the raw accumulator
    x = (tiles - top[..., None]) * log2e_over_t
    e = torch.exp2(x)
    tile_max.copy_(top)
    sum_exp.copy_(e.sum(-1))
    if sum_exp_x is not None:
        sum_exp_x.copy_((e * x).sum(-1))
    hit = (labels >= 0) & (labels < vocab)
    target_acc[hit] = acc[hit, labels[hit]]


def _emulated_slab_dlogits(hidden, weight_slab, out, row_inputs, slab_label, label_acc, inv_temperature):
    """What QuACK's dlogits epilogue writes (``_quack_epilogues.slab_dlogits``), in torch."""
    _assert_aligned(hidden, weight_slab, out, *row_inputs, slab_label, label_acc)
    a = (hidden.float() @ weight_slab.float().T).bfloat16().float()
    lse_hi, lse_lo, c_lp, c_ent, ent = (v[:, None] for v in row_inputs)
    logp = (a * inv_temperature - lse_hi) - lse_lo
    p = torch.exp2(logp * 1.4426950408889634)
    out.copy_(-p * (c_lp + c_ent * (logp + ent)))
    hit = slab_label >= 0
    label_acc[hit] = a[hit, slab_label[hit]]


def _emulated_dw_accumulate(dw, dl, h_c, first):
    """What ``_quack_epilogues.dw_accumulate`` writes, in torch: the product rounded to dW's dtype by
    the GEMM's store, then added to dW by the reduce-add (rounded again)."""
    _assert_aligned(dw, dl, h_c)
    assert dl.stride(0) * dl.element_size() % 16 == 0
    prod = (dl.float().T @ h_c.float()).to(dw.dtype)
    dw.copy_(prod if first else (dw.float() + prod.float()).to(dw.dtype))


@pytest.fixture
def emulated_quack(monkeypatch):
    """``forward_outputs`` with the emulated epilogue in place of QuACK's kernel (CPU)."""
    import sys
    import types

    fake = types.ModuleType("logitless.ops._quack_epilogues")
    fake.tile_entropy_stats = _emulated_epilogue
    fake.slab_dlogits = _emulated_slab_dlogits
    fake.dw_accumulate = _emulated_dw_accumulate
    monkeypatch.setitem(sys.modules, "logitless.ops._quack_epilogues", fake)
    import logitless.ops

    monkeypatch.setattr(logitless.ops, "_quack_epilogues", fake, raising=False)


def _float64_outputs(acc, labels, temperature):
    z = acc.double() / temperature
    lse = torch.logsumexp(z, -1)
    p = torch.softmax(z, -1)
    ent = lse - (p * z).sum(-1)
    logp = z.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) - lse
    valid = labels != IGN
    return torch.where(valid, logp, 0.0), torch.where(valid, ent, 0.0), lse


@pytest.mark.parametrize("vocab,compact,for_backward,budget_rows", [
    (384, False, False, 300), (384, True, True, 300), (640, True, False, 300), (640, False, True, 300),
    (640, True, False, 2000), (640, False, True, 2000)])
def test_forward_outputs_fold_the_tile_statistics_into_float64s_values(emulated_quack, vocab, compact,
                                                                       for_backward, budget_rows):
    """Row blocks (a budget of 300 rows: 3 launches over 700 rows; of 2000: one launch of every row, an
    odd count of an odd count of tiles), compacted rows or all, fp32 or bf16-rounded logits: log-probs,
    entropy and LSE of the logits the epilogue saw, against float64, at a temperature and with the row's
    max in a different tile from row to row."""
    from logitless.ops.triton import head

    g = torch.Generator().manual_seed(vocab)
    n, hid, temperature = 701, 16, 0.7
    hidden = torch.randn(n, hid, generator=g).bfloat16()
    weight = (torch.randn(vocab, hid, generator=g) * 2).bfloat16()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = IGN
    idx = torch.nonzero(labels != IGN).squeeze(1) if compact else None
    tile_n = quack_head.stats_tile_n(vocab)
    row_bytes = 3 * (vocab // tile_n) * 4 + 4 + (hid * 2 if compact else 0)
    logp, ent, lse = head.row_outputs(hidden, n)
    quack_head.forward_outputs(hidden, weight, labels, idx, 1.0 / temperature, IGN, for_backward, logp, ent, lse,
                               budget=budget_rows * row_bytes)
    acc = hidden.double() @ weight.double().T
    if for_backward:
        acc = (hidden.float() @ weight.float().T).bfloat16().double()
    want_logp, want_ent, want_lse = _float64_outputs(acc, labels, temperature)
    torch.testing.assert_close(logp.double(), want_logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=2e-5)
    rows = torch.arange(n) if idx is None else idx
    torch.testing.assert_close(lse[rows], want_lse[rows], rtol=0, atol=2e-5)
    if idx is not None:
        assert (lse[labels == IGN] == 0).all()


def test_gradients_through_the_quack_forward_equal_float64s(monkeypatch, emulated_quack):
    """``impl="triton"`` with QuACK's forward (emulated) and the cuBLAS-path backward: the backward gets
    the LSE of the bf16 logits it recomputes, so dh, dW of log-probs + entropy match float64 as the
    cuBLAS-only path does."""
    monkeypatch.setattr(quack_head, "quack_installed", lambda: True)
    monkeypatch.setattr(quack_head, "outputs_apply", lambda hidden, weight, mode: True)
    g = torch.Generator().manual_seed(1)
    n, hid, vocab, temperature = 96, 16, 384, 0.8
    hidden = torch.randn(n, hid, generator=g).bfloat16()
    weight = (torch.randn(vocab, hid, generator=g) * 2).bfloat16()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::5] = IGN
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def grads(impl_mode):
        monkeypatch.setenv("LOGITLESS_HEAD_GEMM", impl_mode)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = logitless.linear_log_probs(h, w, labels, temperature=temperature, return_entropy=True,
                                               impl="triton")
        ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return logp.detach(), ent.detach(), h.grad.double(), w.grad.double()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want_lp, want_ent = reference.log_probs(h64, w64, labels, ignore_index=IGN, temperature=temperature)
    ((want_lp * g_lp.double()).sum() + (want_ent * g_ent.double()).sum()).backward()
    calls = []
    real = quack_head.forward_outputs
    monkeypatch.setattr(quack_head, "forward_outputs", lambda *a, **k: calls.append(1) or real(*a, **k))
    logp, ent, dh, dw = grads("quack")
    assert calls, "the forward did not go through forward_outputs"
    monkeypatch.setattr(quack_head, "outputs_apply", lambda hidden, weight, mode: False)
    logp_cublas, ent_cublas, dh_cublas, dw_cublas = grads("cublas")
    torch.testing.assert_close(logp, logp_cublas, rtol=0, atol=1e-5)  # the same bf16 logits
    torch.testing.assert_close(ent, ent_cublas, rtol=0, atol=1e-5)
    for got, ref_path, exact in ((dh, dh_cublas, h64.grad), (dw, dw_cublas, w64.grad)):
        err, err_cublas = (got - exact).norm() / exact.norm(), (ref_path - exact).norm() / exact.norm()
        assert err <= 1.05 * err_cublas + 1e-6, (err.item(), err_cublas.item())


@pytest.mark.parametrize("objective,compact", [("logp_ent", True), ("logp_ent", False), ("logp", True), ("ce", True)])
def test_backward_on_the_dlogits_epilogue_equals_the_cublas_path(monkeypatch, emulated_quack, objective, compact):
    """The recompute backward with QuACK's dlogits GEMM (emulated), label
    entries written after it in fp32: dh and dW as the cuBLAS path's, within 1.05x its error against
    float64 (log-probs + entropy with per-row upstreams, log-probs alone, mean cross-entropy), row blocks of
    41 and V slabs of 64 columns."""
    from logitless.ops.triton import head

    monkeypatch.setattr(head, "MIN_SLAB", 64)
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 8000)
    monkeypatch.setenv("LOGITLESS_TRITON_COMPACT", "1" if compact else "0")
    g = torch.Generator().manual_seed(3)
    n, hid, vocab, temperature = 200, 16, 520, 0.9
    hidden = torch.randn(n, hid, generator=g).bfloat16()
    weight = (torch.randn(vocab, hid, generator=g) * 2).bfloat16()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.15] = IGN
    assert head.backward_tiles(n, vocab, hid, 2, 8000, True) == (41, 64)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    _, ent, lse = head.head_forward(hidden, weight, labels, IGN, temperature, for_backward=True)
    valid = labels != IGN
    idx = head.valid_rows(labels, IGN)

    def backward(on_quack):
        monkeypatch.setattr(quack_head, "dlogits_apply", lambda hidden, weight, mode: on_quack)
        if objective == "ce":
            coef = (1.0 / valid.sum()).float().reshape(())
            return head._slab_backward(hidden, weight, labels, idx, lse, None, None, None, coef, 1 / temperature, IGN,
                                       True, True)
        return head.head_backward(hidden, weight, labels, lse, ent, g_lp, g_ent if objective == "logp_ent" else None,
                                  IGN, temperature, True, True)

    calls = []
    real = quack_head.SlabDlogits.__call__
    monkeypatch.setattr(quack_head.SlabDlogits, "__call__", lambda self, *a: calls.append(a[5:7]) or real(self, *a))
    dh, dw = backward(True)
    rows = n if idx is None or (not compact and objective != "ce") else idx.numel()
    assert len(calls) == -(-rows // 41) * 9
    dh_cublas, dw_cublas = backward(False)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, ent64 = reference.log_probs(h64, w64, labels, ignore_index=IGN, temperature=temperature)
    if objective == "ce":
        (-lp64[valid].mean()).backward()
    else:
        obj = (lp64 * g_lp.double()).sum() + ((ent64 * g_ent.double()).sum() if objective == "logp_ent" else 0)
        obj.backward()
    for got, cublas, exact in ((dh, dh_cublas, h64.grad), (dw, dw_cublas, w64.grad)):
        err, err_cublas = ((t.double() - exact).norm() / exact.norm() for t in (got, cublas))
        assert err <= 1.05 * err_cublas + 1e-7, (err.item(), err_cublas.item())


@pytest.mark.parametrize("block,m", [(41, 41), (41, 13), (8192, 8191)])
def test_slab_row_inputs_start_16_byte_aligned(block, m):
    """QuACK refuses an epilogue operand whose data is not 16-byte aligned (it did at the 7B head's 7373 valid rows)."""
    rows = quack_head.SlabDlogits(block, torch.device("cpu")).rows[:, :m]
    assert all(r.data_ptr() % 16 == 0 and r.is_contiguous() for r in rows.unbind(0))


@pytest.mark.parametrize("vocab,itemsize,budget", [(152064, 2, 224 << 20), (151936, 2, 224 << 20),
                                                   (128256, 2, 224 << 20), (384, 2, 60000), (128256, 2, 100 << 20),
                                                   (640, 4, 3000)])
def test_one_pass_chunks_on_quack_are_the_largest_even_tile_count_within_the_budget(vocab, itemsize, budget):
    """The largest multiple of 64 rows (above 256) whose logits fit the budget and whose 128-row tiles
    pair up in the GEMM's (2, 1) clusters, by search."""
    got = quack_head.chunk_rows_on_quack(1 << 20, vocab, itemsize, budget)
    fits = budget // (vocab * itemsize)
    if fits <= 256:
        assert got == max(1, fits)
    else:
        want = max(r for r in range(64, fits + 1, 64) if -(-r // 128) % 2 == 0)
        assert got == want
    assert got * vocab * itemsize <= budget or got == 1
    assert quack_head.chunk_rows_on_quack(5, vocab, itemsize, budget) == min(5, got)


@pytest.fixture
def chunks_on_emulated_quack(monkeypatch, emulated_quack):
    """The one pass's chunks on QuACK (emulated epilogue and dW GEMM), with small chunks; returns the
    chunk sizes each ``ChunkStats.logits`` call saw."""
    from logitless.ops.triton import head

    monkeypatch.setattr(quack_head, "quack_installed", lambda: True)
    monkeypatch.setattr(quack_head, "outputs_apply", lambda hidden, weight, mode: mode in ("quack", "auto"))
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 60000)
    seen = []
    real = quack_head.ChunkStats.logits
    monkeypatch.setattr(quack_head.ChunkStats, "logits", lambda self, h_c, *a: seen.append(h_c.shape[0]) or
                        real(self, h_c, *a))
    real_init = quack_head.ChunkStats.__init__
    monkeypatch.setattr(quack_head.ChunkStats, "__init__", lambda self, *a: seen.append(("entropy", a[-1])) or
                        real_init(self, *a))
    return seen


def _ce_inputs(seed, n=700, hid=16, vocab=384):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hid, generator=g).bfloat16()
    weight = (torch.randn(vocab, hid, generator=g) * 2).bfloat16()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.1] = IGN
    return hidden, weight, labels


def _rel(got, exact):
    return ((got.double() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("compact,temperature", [(True, 1.0), (False, 0.7)])
def test_one_pass_cross_entropy_on_quack_matches_float64_as_the_cublas_path(monkeypatch, chunks_on_emulated_quack,
                                                                           compact, temperature):
    """Cross-entropy's one pass with its chunks' logits GEMM (stored logits + per-tile statistics) and dW
    GEMMs (product rounded, then reduce-added) on QuACK, emulated: chunks of ``chunk_rows_on_quack``
    rows; loss equal to the cuBLAS path's, dh and dW within 1.1x its error against float64."""
    from logitless.ops.triton import head

    monkeypatch.setenv("LOGITLESS_TRITON_COMPACT", "1" if compact else "0")
    hidden, weight, labels = _ce_inputs(5)
    n, vocab = hidden.shape[0], weight.shape[0]
    rows = int((labels != IGN).sum()) if compact else n
    n_c = quack_head.chunk_rows_on_quack(rows, vocab, 2, head.WORKSPACE_BYTES)
    assert n_c == head.WORKSPACE_BYTES // (vocab * 2) == 78

    def run(mode):
        monkeypatch.setenv("LOGITLESS_HEAD_GEMM", mode)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = logitless.linear_cross_entropy(h, w, labels, temperature=temperature, impl="triton")
        loss.backward()
        return loss.detach().double(), h.grad, w.grad

    loss, dh, dw = run("quack")
    # no entropy sums for cross-entropy
    assert chunks_on_emulated_quack == [("entropy", False)] + [n_c] * (rows // n_c) + ([rows % n_c] if rows % n_c
                                                                                         else [])
    loss_cublas, dh_cublas, dw_cublas = run("cublas")
    assert len(chunks_on_emulated_quack) == 1 + -(-rows // n_c)  # the cuBLAS path does not call it
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, _ = reference.log_probs(h64, w64, labels, ignore_index=IGN, temperature=temperature)
    loss64 = -lp64[labels != IGN].mean()
    loss64.backward()
    torch.testing.assert_close(loss, loss64.detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, loss_cublas, rtol=1e-6, atol=0)
    for got, cublas, exact in ((dh, dh_cublas, h64.grad), (dw, dw_cublas, w64.grad)):
        assert _rel(got, exact) <= 1.1 * _rel(cublas, exact) + 1e-7, (_rel(got, exact), _rel(cublas, exact))


def test_one_pass_token_objective_on_quack_matches_the_cublas_path(monkeypatch, chunks_on_emulated_quack):
    """The GRPO token objective's one pass (per-row upstreams from each chunk's log-probs and entropies)
    on QuACK, emulated: value equal to the cuBLAS path's, dh and dW within 1.1x its error against float64."""
    from logitless.ops.triton import token_objective

    hidden, weight, labels = _ce_inputs(6, n=400)
    g = torch.Generator().manual_seed(7)
    adv, old = torch.randn(hidden.shape[0], generator=g), -torch.rand(hidden.shape[0], generator=g) * 5

    def objective(logp, ent, rows):
        ratio = torch.exp(logp - old[rows].to(logp.dtype))
        return -(ratio * adv[rows].to(logp.dtype)).sum() - 0.01 * ent.sum()

    def run(mode):
        monkeypatch.setenv("LOGITLESS_HEAD_GEMM", mode)
        value, _, _, dh, dw = token_objective.token_objective_fused(hidden, weight, labels, objective, IGN, 1.0, True,
                                                                    True, True)
        return value.double(), dh, dw

    value, dh, dw = run("quack")
    assert chunks_on_emulated_quack == [("entropy", True)] + [78] * 4 + [55]  # one pass over 367 valid rows
    value_cublas, dh_cublas, dw_cublas = run("cublas")
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, ent64 = reference.log_probs(h64, w64, labels, ignore_index=IGN, temperature=1.0)
    rows = torch.nonzero(labels != IGN).squeeze(1)
    objective(lp64[rows], ent64[rows], rows).backward()
    # the value of the bf16 logits both paths compute, in float64
    lp_b, ent_b, _ = _float64_outputs((hidden.float() @ weight.float().T).bfloat16(), labels, 1.0)
    torch.testing.assert_close(value, objective(lp_b[rows], ent_b[rows], rows), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(value, value_cublas, rtol=1e-5, atol=1e-5)
    for got, cublas, exact in ((dh, dh_cublas, h64.grad), (dw, dw_cublas, w64.grad)):
        assert _rel(got, exact) <= 1.1 * _rel(cublas, exact) + 1e-7, (_rel(got, exact), _rel(cublas, exact))
