"""bench_head.py's builders agree with its float64 reference (CPU, fp32, tiny head; the GPU run
only times them)."""

import csv
import os
import shutil

import pytest
import torch

N, H, V = 37, 16, 101
TOL = 1e-4
# Without CUDA, tests/conftest.py runs the Triton kernels in the interpreter.
HAS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_head")


def _make_case(bench, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=gen).requires_grad_(True)
    w = (torch.randn(V, H, generator=gen) * (2.0 / H**0.5)).requires_grad_(True)
    y = torch.randint(0, V, (N,), generator=gen)
    y[torch.rand(N, generator=gen) < 0.25] = bench.IGN
    g1, g2 = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    adv, consts = bench.grpo_inputs(h, w, y, gen)
    # rows=16: several reference chunks, the last one partial
    ref = bench.reference64(h, w, y, g1, g2, adv, consts, rows=16)
    return h, w, y, g1, g2, adv, consts, ref


@pytest.fixture(scope="module")
def case(bench):
    return _make_case(bench, 0)


def _check(bench, case, impl, mode):
    h, w, y, g1, g2, adv, consts, ref = case
    f = bench.build(impl, mode)
    ups = (adv, consts) if mode == "obj" else (g1, g2)
    out = bench.step(f, mode, h, w, y, *ups)
    errs = bench.errors(mode, out, h, w, ref)
    h.grad = w.grad = None
    assert set(errs) == {"err_out", "err_dh", "err_dw"}
    assert max(errs.values()) < TOL, errs


def test_obj_inputs_clip_on_both_sides(bench, case):
    # The objective must exercise both branches of the PPO min, on both signs of the advantage.
    h, w, y, _, _, adv, consts, ref = case
    old = consts["old"]
    valid = y != bench.IGN
    log_ratio = (ref["logp"][0].float() - old)[valid]
    clipped = (log_ratio.exp() - 1).abs() > bench.CLIP_EPS
    assert 0 < clipped.sum() < valid.sum() and (adv[valid] > 0).any() and (adv[valid] < 0).any()
    assert (old[~valid] == 0).all() and (~valid).any()


def test_reference_obj_matches_float64_autograd(bench, case):
    # The reference's hand-written logits gradient against plain float64 autograd of the same loss.
    h, w, y, _, _, adv, consts, ref = case
    h64, w64 = (t.detach().double().requires_grad_(True) for t in (h, w))
    logz = (h64 @ w64.t()).log_softmax(-1)
    valid = y != bench.IGN
    logp = logz.gather(-1, torch.where(valid, y, 0)[:, None]).squeeze(-1) * valid
    ent = -(logz.exp() * logz).sum(-1) * valid
    loss = bench.grpo_terms(logp, ent, torch.arange(N), y, adv, consts)
    loss.backward()
    r_loss, r_dh, r_dw = ref["obj"]
    assert torch.allclose(r_loss, loss, rtol=1e-12)
    assert bench.rel(r_dh, h64.grad) < 1e-6 and bench.rel(r_dw, w64.grad) < 1e-6  # ref kept as fp32


@pytest.mark.parametrize("mode", ["ce", "logp", "obj"])
@pytest.mark.parametrize("impl", ["torch", "chunked"])
def test_torch_and_chunked_match_reference(bench, case, impl, mode):
    _check(bench, case, impl, mode)


@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("impl, max_chunks, workspace", [
    ("triton", None, None),          # one chunk: the one-pass fused path
    ("triton", 0, None),             # FUSED_MAX_CHUNKS exceeded: forward + recompute fallback
    ("triton_fused", None, 3232),    # 8-row chunks forced through the one-pass path
    ("triton_unfused", None, None),  # linear_log_probs + the objective in torch
])
def test_triton_obj_matches_reference(bench, case, monkeypatch, impl, max_chunks, workspace):
    from logitless.ops.triton import head

    if max_chunks is not None:
        monkeypatch.setattr(head, "FUSED_MAX_CHUNKS", max_chunks)
    if workspace is not None:
        monkeypatch.setattr(head, "WORKSPACE_BYTES", workspace)
    _check(bench, case, impl, "obj")


@pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("impl, mode, kernel", [
    ("triton_hgemm", "logp", "logits_dlogits"),     # statistics GEMM, then dlogits GEMM in backward
    ("triton_hgemm", "fwd", "logits_stats"),
    ("triton_fused_hgemm", "obj", "dw_accumulate"),  # one pass: the dW GEMM accumulates over chunks
])
def test_hgemm_peers_run_the_triton_gemms(bench, case, monkeypatch, impl, mode, kernel):
    # The knob must hold through the backward too (it runs after the peer's function returns).
    from logitless.ops.triton import gemm_epilogues, head

    calls = []
    real = getattr(gemm_epilogues, kernel)
    monkeypatch.setattr(gemm_epilogues, kernel, lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(head, "WORKSPACE_BYTES", 3232)  # 8-row chunks: dW accumulated
    if mode == "fwd":
        h, w, y, g1, g2, adv, consts, ref = case
        logp, _ = bench.step(bench.build(impl, mode), mode, h, w, y, g1, g2)
        assert bench.rel(logp, ref["logp"][0]) < TOL
    else:
        _check(bench, case, impl, mode)
    assert calls
    assert bench._kernel_category(f"{kernel}_kernel") == "gemm"


def test_hgemm_blocks_parse_and_name_bad_input(bench):
    assert bench.parse_hgemm_blocks("stats=128x256x64x8x8x3x1,dw=64x128x32x4x4x2x0") == {
        "stats": (128, 256, 64, 8, 8, 3, 1), "dw": (64, 128, 32, 4, 4, 2, 0)}
    with pytest.raises(ValueError, match="--hgemm-blocks.*'logits=128x128'"):
        bench.parse_hgemm_blocks("logits=128x128")


@pytest.fixture
def full_objective(bench):
    """bench_head run with ``--objective full`` (the module's selection restored afterwards)."""
    bench.set_objective("full")
    yield
    bench.set_objective("basic")


@pytest.fixture
def full_case(bench, full_objective):
    return _make_case(bench, 1)


def test_full_objective_has_every_term(bench, full_case):
    # importance weights that vary (token_truncate), a top-20% entropy mask, a reference for the KL
    h, w, y, _, _, adv, consts, ref = full_case
    valid = y != bench.IGN
    loss = bench._grpo()
    assert loss.delta == 4.0 and loss.beta > 0 and loss.kl_estimator == "k3" and loss.top_entropy_quantile == 0.2
    kept = consts["policy_weight"][valid] > 0
    assert 0.15 < kept.float().mean() < 0.3
    assert consts["policy_weight"][valid][kept].std() > 0.01 and (consts["policy_weight"][~valid] == 0).all()
    assert torch.equal(consts["entropy_weight"] > 0, consts["policy_weight"] > 0)
    assert (consts["ref"][valid] != 0).all()


@pytest.mark.parametrize("impl", ["torch", "chunked", pytest.param("triton", marks=pytest.mark.skipif(
    not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1"))])
def test_full_objective_matches_reference(bench, full_case, impl):
    _check(bench, full_case, impl, "obj")


@pytest.mark.parametrize("impl", ["tt_chunked", "liger", "cce"])
def test_obj_is_na_for_peers(bench, impl):
    assert isinstance(bench.build(impl, "obj"), str)


def test_unfused_is_obj_only(bench):
    assert all(isinstance(bench.build("triton_unfused", m), str) for m in ("ce", "logp", "fwd"))


def test_profile_sorts_kernels_and_finds_idle_stretches(bench):
    # The --profile split: cuBLAS names are GEMMs, Triton kernels epilogues, the rest other; idle
    # stretches are the holes in the union of kernel intervals, with the host op spanning them.
    assert bench._kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert bench._kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert bench._kernel_category("row_stats_kernel") == "epilogue"
    assert bench._kernel_category("liger_cross_entropy_kernel") == "epilogue"
    assert bench._kernel_category("void at::native::vectorized_elementwise_kernel<4>") == "other"

    class Ev:
        def __init__(self, name, start, end, cuda):
            self.name = name
            self.time_range = type("R", (), {"start": start, "end": end})()
            self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU

    events = [Ev("a", 0, 10, True), Ev("b", 5, 20, True), Ev("c", 50, 60, True), Ev("d", 62, 70, True),
              Ev("aten::nonzero", 18, 55, False), Ev("outer", 0, 100, False)]
    prof = type("P", (), {"events": lambda self: events})()
    gaps = bench._largest_gaps(prof, 5)
    assert [(g[0], g[1], g[2]) for g in gaps] == [(30, "b", "c"), (2, "c", "d")]
    assert gaps[0][3].startswith("aten::nonzero")


def test_profile_runs_only_the_pairs_of_impls_and_modes(bench, capsys):
    every = bench.profile_cases(bench.IMPLS, bench.MODES)
    assert every == list(bench.PROFILE_CASES)
    assert bench.profile_cases(["chunked", "tt_compiled"], ["logp"]) == [("chunked", "logp"), ("tt_compiled", "logp")]
    with pytest.raises(ValueError, match="no profiled pair has an impl of --impls compile and a mode of --modes ce"):
        bench.profile_cases(["compile"], ["ce"])
    with pytest.raises(SystemExit):  # named before any GPU work
        bench.main(["--profile", "qwen7b", "--impls", "compile", "--modes", "ce"])
    assert "--impls compile" in capsys.readouterr().err


def test_peaked_inputs_look_like_a_trained_lm(bench):
    # A few large logits per row: the top token takes most of the mass, the label is usually it,
    # the entropy is a few nats (a std-2 Gaussian row over 4000 tokens has ~7.5), and the requested
    # share of labels is ignored.
    n, hd, v = 512, 64, 4000
    h, w, y, *_ = bench.head_inputs(None, torch.device("cpu"), "peaked", ignore_frac=0.1, dims=(n, hd, v))
    probs = (h.detach().float() @ w.detach().float().t()).softmax(-1)
    valid = y != bench.IGN
    assert abs((~valid).float().mean().item() - 0.1) < 0.04
    top = probs.max(-1)
    assert top.values.median() > 0.5
    hit = (top.indices == y)[valid].float().mean().item()
    assert 0.45 < hit < 0.75
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    assert ent.median() < 2.0
    hg, wg, yg, *_ = bench.head_inputs(None, torch.device("cpu"), "gaussian", dims=(n, hd, v))
    pg = (hg.detach().float() @ wg.detach().float().t()).softmax(-1)
    assert (-(pg * pg.log()).sum(-1)).median() > 3 * ent.median()
    assert (yg != bench.IGN).all()


def test_zipf_inputs_favour_frequent_tokens(bench):
    # As peaked, but the favoured tokens and the random labels follow Zipf's law over V (token id =
    # frequency rank): under 1/rank, the 10 most frequent of 4000 tokens hold 3.29 / 8.87 = 37% of
    # the mass (uniform ids: 0.25%), and a frequent token is predicted in many rows.
    n, hd, v = 2048, 64, 4000
    h, w, y, *_ = bench.head_inputs(None, torch.device("cpu"), "zipf", ignore_frac=0.1, dims=(n, hd, v))
    valid = y != bench.IGN
    expected = sum(1.0 / r for r in range(1, 11)) / sum(1.0 / r for r in range(1, v + 1))
    labels_top10 = (y[valid] < 10).float().mean().item()
    assert abs(labels_top10 - expected) < 0.06
    probs = (h.detach().float() @ w.detach().float().t()).softmax(-1)
    assert probs.max(-1).values.median() > 0.5
    top = probs.argmax(-1)
    assert torch.bincount(top, minlength=v)[:10].sum().item() > 0.25 * n
    hp, wp, yp, *_ = bench.head_inputs(None, torch.device("cpu"), "peaked", ignore_frac=0.1, dims=(n, hd, v))
    assert (yp[yp != bench.IGN] < 10).float().mean().item() < 0.1 * labels_top10


def test_bad_input_regime_raises(bench):
    with pytest.raises(ValueError, match="logits must be one of"):
        bench.head_inputs(None, torch.device("cpu"), "uniform", dims=(4, 8, 16))
    with pytest.raises(ValueError, match="ignore_frac"):
        bench.head_inputs(None, torch.device("cpu"), "gaussian", ignore_frac=1.5, dims=(4, 8, 16))


@pytest.mark.parametrize("mode", ["ce", "logp"])
def test_tt_chunked_matches_reference(bench, case, mode):
    _check(bench, case, "tt_chunked", mode)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="inductor on CPU needs a C++ compiler")
def test_tt_compiled_matches_reference(bench, case):
    torch._dynamo.reset()
    _check(bench, case, "tt_compiled", "ce")


def test_tables_print_every_measured_row(bench, tmp_path):
    path = tmp_path / "r.csv"
    fields = ["shape", "N", "H", "V", "logits", "ignore_frac", "mode", "impl", "ms", "gemm_ms", "gemms",
              "peak_extra_gib", "err_out", "err_dh", "err_dw", "note"]
    rows = [["qwen7b", 8192, 3584, 152064, "peaked", 0.1, "ce", "triton", 53.3, 12.5, 4.25, 1.38, 1.3e-6, 2.8e-3, 2.8e-3, ""],
            ["qwen7b", 8192, 3584, 152064, "peaked", 0.1, "ce", "liger", "", 12.5, "", "", "", "", "", "n/a"],
            ["qwen7b", 8192, 3584, 152064, "peaked", 0.1, "fwd", "cce", 16.3, 12.5, 1.32, 0.0, 2.4e-4, "", "", ""]]
    path.write_text("\n".join(",".join(map(str, r)) for r in [fields] + rows) + "\n")
    import io

    out = io.StringIO()
    bench.tables(str(path), out)
    text = out.getvalue()
    assert "peaked logits, 10% ignored labels: one GEMM = 12.5 ms" in text
    assert "| ce | **triton** | 53.3 | **4.25** | 1.38 | 1.3e-06 | 2.8e-03 | 2.8e-03 |" in text
    assert "| fwd | cce | 16.3 | 1.32 | 0.00 | 2.4e-04 |  |  |" in text
    assert "liger" not in text  # rows without a time are notes, not table rows


def test_rows_appended_to_an_older_csv_line_up_with_their_columns(bench, tmp_path):
    path = tmp_path / "sweep.csv"
    path.write_text("shape,ms\nqwen7b,1.5\n")  # written before the run metadata was a column
    rows = bench._Rows(str(path), ["shape", "ms", "gpu"])
    rows.append(dict(shape="qwen05b", ms=2.5, gpu="NVIDIA H200"))
    got = list(csv.DictReader(path.open()))
    assert got == [dict(shape="qwen7b", ms="1.5", gpu=""), dict(shape="qwen05b", ms="2.5", gpu="NVIDIA H200")]
