"""bench_decode_attention.py on a tiny shape (CPU smoke test of the GPU microbenchmark)."""

import csv
import math

import pytest


@pytest.fixture(scope="module")
def bench(load_experiment):
    return load_experiment("bench_decode_attention")


def test_every_method_runs_agrees_with_sdpa_and_writes_a_row(bench, tmp_path):
    out = tmp_path / "attn.csv"
    assert bench.main(["--models", "tiny", "--device", "cpu", "--rows", "2", "--cache-len", "64", "--filled", "9,64",
                       "--split-lens", "16", "--reps", "1", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    hq, hkv, dim = bench.SHAPES["tiny"]
    from logitless.generation.kernels.decode_attention.plan import BLOCK_N, NUM_STAGES, NUM_WARPS

    block_n, warps, stages = map(str, (BLOCK_N, NUM_WARPS, NUM_STAGES))  # no launch flag: the defaults, recorded
    assert [(r["filled"], r["method"], r["split_len"], r["block_n"], r["num_warps"], r["num_stages"])
            for r in rows] == [
        (f, m, s, b, w, st) for f in ("9", "64")
        for m, s, b, w, st in (("sdpa_window", "", "", "", ""), ("sdpa_full", "", "", "", ""),
                               ("split_k", "auto", block_n, warps, stages), ("split_k", "16", "16", warps, stages))]
    for r in rows:
        assert r["status"] == "ok" and float(r["us"]) > 0
        assert float(r["max_diff"]) < 1e-5  # fp32 on the CPU: every method is the same attention
        assert int(r["bytes"]) == 2 * hkv * int(r["filled"]) * dim * 2 * 4 + 2 * 2 * hq * dim * 4
        assert r["of_copy_bw"] == "" and math.isnan(float(r["copy_gbps"]))  # no copy bandwidth off CUDA
    from logitless.generation.kernels.decode_attention.plan import FILL_MIN_SPLIT, MAX_SPLIT, fill_split_len

    # the length split-K ran with: the one the kernels choose from the fill (at least one block), or the one asked for
    floor = max(int(block_n), FILL_MIN_SPLIT)
    assert [r["resolved_split_len"] for r in rows if r["method"] == "split_k"] == [
        str(fill_split_len(9, 2 * hkv, 132, floor, max(floor, MAX_SPLIT))), "16",
        str(fill_split_len(64, 2 * hkv, 132, floor, max(floor, MAX_SPLIT))), "16"]


def test_launch_flags_sweep_every_combination_and_are_recorded(bench, tmp_path):
    out = tmp_path / "attn.csv"
    assert bench.main(["--models", "tiny", "--device", "cpu", "--rows", "2", "--cache-len", "64", "--filled", "40",
                       "--methods", "split_k", "--split-lens", "32", "--block-ns", "16,64", "--stages", "2",
                       "--warps", "2", "--programmatic", "1,0", "--reps", "1", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    got = [(r["split_len"], r["block_n"], r["num_warps"], r["num_stages"], r["programmatic"]) for r in rows]
    # a block longer than the split given is cut to it
    assert got == [(s, b, "2", "2", p) for s, bs in (("auto", ("16", "64")), ("32", ("16", "32")))
                   for b in bs for p in ("1", "0")]
    assert all(r["status"] == "ok" and float(r["max_diff"]) < 1e-5 for r in rows)


def test_bad_flags_are_refused(bench):
    for bad in (["--models", "13b"], ["--methods", "flash"], ["--filled", "5000"], ["--programmatic", "2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
