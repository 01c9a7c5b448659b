"""bench_generation.py on the tiny model (CPU smoke test of the GPU benchmark) and its byte count."""

import csv

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_generation")


def test_every_sampler_and_mix_runs_and_writes_a_row(bench, tmp_path):
    out = tmp_path / "gen.csv"
    assert bench.main(["--models", "tiny", "--device", "cpu", "--no-compile", "--rows", "16", "--prompt-len", "8",
                       "--new-tokens", "6", "--samplers", "compiled,baseline,eager", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["sampler"], r["mix"]) for r in rows] == [(s, m) for s in ("compiled", "baseline", "eager")
                                                        for m in ("uniform", "mix")]
    for r in rows:
        assert r["status"] == "ok" and float(r["tokens_per_s"]) > 0
        assert int(r["generated"]) == (16 * 6 if r["mix"] == "uniform" else int(r["generated"]))
        assert 1 <= float(r["mean_len"]) <= 6


def test_qwen3_1_7b_is_a_model_choice(bench):
    from torchtune.config._utils import _get_component_from_path

    from logitless.models import qwen3_1_7b

    assert _get_component_from_path(bench.MODELS["qwen3_1_7b"]) is qwen3_1_7b


def test_step_bytes_count_each_weight_once_and_the_filled_cache(bench):
    from logitless.models import qwen2_5_tiny, qwen2_5_tiny_untied

    dims = dict(vocab_size=100, num_layers=3, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=48)
    tied, untied = qwen2_5_tiny(**dims), qwen2_5_tiny_untied(**dims)
    head_dim = 32 // 4
    # per layer: q (32x32 + 32), k and v (16x32 + 16 each), o (32x32), mlp 3 x 32x48, two norms of 32
    layer = (32 * 32 + 32) + 2 * (16 * 32 + 16) + 32 * 32 + 3 * 32 * 48 + 2 * 32
    weights = 3 * layer + 100 * 32 + 32  # + embedding (the tied head) + final norm
    kv = 3 * 2 * 2 * head_dim * 4  # layers x (K, V) x kv heads x head_dim x fp32 bytes, per token and row
    rows, prompt, new = 5, 7, 10
    expected = 4 * weights + rows * kv * (prompt + new / 2)
    assert bench.step_bytes(tied, rows, prompt, new) == pytest.approx(expected)
    # untied: the head is read whole, the embedding table only at the rows' tokens
    assert bench.step_bytes(untied, rows, prompt, new) == pytest.approx(expected + 4 * rows * 32)


def test_mix_stop_tokens_give_a_third_of_the_maximum_on_average(bench):
    import math

    stops = bench.mix_stop_tokens(30000, 512)
    p = len(stops) / 30000 * 1.0  # per-step stop probability under a uniform distribution
    mean = (1 - (1 - p) ** 512) / p  # mean of a geometric length capped at 512
    assert 0 not in stops and len(set(stops)) == len(stops)
    assert mean == pytest.approx(512 / 3, rel=0.02) and math.isfinite(mean)


def test_bad_rows_are_refused_naming_the_flag(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "20"])


def test_compiled_options_reach_the_sampler(bench):
    args = bench.parse_args(["--compiled-options", "graph_sampling=False,attention_window=None,min_bucket=4"])
    assert args.compiled_options == {"graph_sampling": False, "attention_window": None, "min_bucket": 4}
    sampler = bench.make_samplers(["compiled"], False, 64, args.compiled_options)["compiled", "sdpa"]
    assert (sampler.config.graph_sampling, sampler.config.attention_window, sampler.config.min_bucket) == \
        (False, None, 4)
    with pytest.raises(SystemExit):
        bench.parse_args(["--compiled-options", "graph_sampling"])


def test_unfused_sampler_is_the_compiled_one_without_fused_projections(bench):
    samplers = bench.make_samplers(["compiled", "unfused"], False, 64, {"min_bucket": 4})
    compiled, unfused = samplers["compiled", "sdpa"], samplers["unfused", "sdpa"]
    assert (compiled.config.fused_projections, unfused.config.fused_projections) == ("shared", False)
    assert unfused.config.min_bucket == 4


def test_decode_attention_runs_compiled_once_per_choice_and_says_which(bench, tmp_path, monkeypatch):
    import importlib

    # the plumbing is tested here, the kernel in tests/generation/kernels: its plain PyTorch fallback keeps this fast
    kernels = importlib.import_module("logitless.generation.kernels.decode_attention.op")
    monkeypatch.setattr(kernels, "triton_interpreting", lambda: False)
    out = tmp_path / "gen.csv"
    assert bench.main(["--models", "tiny", "--device", "cpu", "--no-compile", "--rows", "16", "--prompt-len", "4",
                       "--new-tokens", "4", "--samplers", "compiled,baseline", "--decode-attention", "sdpa,split_k",
                       "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["sampler"], r["decode_attention"], r["mix"]) for r in rows] == [
        (s, a, m) for s, a in (("compiled", "sdpa"), ("compiled", "split_k"), ("baseline", "sdpa"))
        for m in ("uniform", "mix")]
    assert all(r["status"] == "ok" for r in rows)
    samplers = bench.make_samplers(["compiled", "eager"], False, 64, {}, ("sdpa", "split_k"))
    assert samplers["compiled", "split_k"].config.decode_attention == "split_k" and ("eager", "-") in samplers
    for bad in (["--decode-attention", "flash"], ["--compiled-options", "decode_attention='split_k'"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_rows_appended_to_an_older_csv_line_up_with_their_columns(bench, tmp_path):
    out = tmp_path / "gen.csv"
    old_fields = [f for f in bench.FIELDS if f != "decode_attention"]  # a results file from before the column
    old_row = {f: f"old-{f}" for f in old_fields}
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=old_fields)
        w.writeheader()
        w.writerow(old_row)
    assert bench.main(["--models", "tiny", "--device", "cpu", "--no-compile", "--rows", "16", "--prompt-len", "4",
                       "--new-tokens", "4", "--samplers", "compiled", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 3 and all(None not in r for r in rows)  # no value without a column
    assert {k: v for k, v in rows[0].items() if k in old_fields} == old_row and rows[0]["decode_attention"] == ""
    assert [(r["sampler"], r["decode_attention"], r["mix"]) for r in rows[1:]] == [
        ("compiled", "sdpa", "uniform"), ("compiled", "sdpa", "mix")]


def test_random_weights_are_the_same_in_every_run(bench):
    # the mix's lengths come from the model's distribution: unseeded weights made them (and its
    # tokens/s) differ from run to run
    import torch

    first, second = bench.build_model("tiny", torch.device("cpu")), bench.build_model("tiny", torch.device("cpu"))
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    other = bench.build_dotted(bench.MODELS["tiny"], torch.device("cpu"), seed=1)
    assert not torch.equal(other.tok_embeddings.weight, first.tok_embeddings.weight)


def test_step_breakdown_is_the_difference_of_two_calls_per_step(bench, monkeypatch):
    # a 5-token call and a one-token call share the prefill: what one decode step costs is their
    # difference over 4 steps, per category and per kernel name
    import kernel_breakdown
    import torch

    long_call = [("nvjet_gemm_prefill", 0.0, 100.0)] + [
        k for step in range(4) for k in (("nvjet_gemm_a", 200.0 + 50 * step, 230.0 + 50 * step),
                                         ("decode_partial_kernel", 230.0 + 50 * step, 240.0 + 50 * step))]
    short_call = [("nvjet_gemm_prefill", 0.0, 100.0)]
    calls = iter([(long_call, 420.0), (short_call, 120.0)])
    monkeypatch.setattr(kernel_breakdown, "profile_kernels", lambda fn, device: next(calls))
    monkeypatch.setattr(bench, "sample", lambda *a, **k: None)
    model = bench.build_model("tiny", torch.device("cpu"))
    split = bench.step_breakdown(model, None, [[1]], 5, torch.device("cpu"))
    assert split["us"]["gemm"] == 30.0 and split["us"]["attention"] == 10.0
    assert split["us"]["wall"] == (420.0 - 120.0) / 4 and split["us"]["busy"] == 40.0
    assert split["us"]["idle"] == split["us"]["wall"] - 40.0
    assert split["launches"]["gemm"] == 1 and split["launches"]["attention"] == 1
    assert split["top"][0] == ("nvjet_gemm_a", 30.0, 1.0)
    assert [name for name, _, _ in split["top"]] == ["nvjet_gemm_a", "decode_partial_kernel", "nvjet_gemm_prefill"]
    table = bench.step_breakdown_table(split)
    assert "| gemm | 30.0 | 1.0 | 30.00 |" in table and "| attention | 10.0 | 1.0 | 10.00 |" in table
    assert "overlap" not in table


def test_step_breakdown_never_reports_negative_idle_when_kernel_spans_overlap(bench, monkeypatch):
    # a programmatic launch starts before the kernel it waits for ends: spans overlap the wall
    import kernel_breakdown
    import torch

    long_call = [("nvjet_gemm_a", 0.0, 30.0), ("decode_partial_kernel", 10.0, 40.0),
                 ("nvjet_gemm_a", 40.0, 70.0), ("decode_partial_kernel", 50.0, 80.0)]
    calls = iter([(long_call, 60.0), ([], 0.0)])
    monkeypatch.setattr(kernel_breakdown, "profile_kernels", lambda fn, device: next(calls))
    monkeypatch.setattr(bench, "sample", lambda *a, **k: None)
    split = bench.step_breakdown(bench.build_model("tiny", torch.device("cpu")), None, [[1]], 3,
                                 torch.device("cpu"))
    assert split["us"]["busy"] == 40.0 and split["us"]["wall"] == 30.0 and split["us"]["idle"] == 0.0
    assert "kernel spans sum to 60.0 us: they overlap" in bench.step_breakdown_table(split)


def test_gemm_backends_reach_inductor_for_the_run_only_and_are_recorded(bench, tmp_path, monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(bench, "bench_config", lambda *a, **k: seen.append(
        torch._inductor.config.max_autotune_gemm_backends) or [dict(model="tiny", status="ok")])
    before = torch._inductor.config.max_autotune_gemm_backends
    out = tmp_path / "gen.csv"
    assert bench.main(["--models", "tiny", "--device", "cpu", "--no-compile", "--rows", "16", "--prompt-len", "8",
                       "--new-tokens", "6", "--samplers", "compiled", "--gemm-backends", "TRITON",
                       "--compiled-options", "mode='max-autotune'", "--out", str(out)]) == 0
    assert seen == ["TRITON"] and torch._inductor.config.max_autotune_gemm_backends == before
    assert [r["options"] for r in csv.DictReader(out.open())] == ["mode=max-autotune gemm_backends=TRITON"]


def test_save_rows_writes_each_row_after_the_run_metadata(bench, tmp_path):
    import torch

    out = tmp_path / "probe.csv"
    fields = ["date", "gpu", "torch", "cublaslt", "check", "stale"]
    bench.save_rows("probe", fields, [dict(check="race", stale=3), dict(check="chain", stale=0)],
                    torch.device("cpu"), str(out), cublaslt=130100)
    rows = list(csv.DictReader(out.open()))
    assert [(r["check"], r["stale"], r["cublaslt"], r["torch"]) for r in rows] == [
        ("race", "3", "130100", torch.__version__), ("chain", "0", "130100", torch.__version__)]
    assert bench.results_csv("probe", "NVIDIA H200").endswith("results/probe_nvidia_h200.csv")
