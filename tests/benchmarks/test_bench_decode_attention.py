"""bench_decode_attention.py on a tiny shape (CPU smoke test of the GPU microbenchmark)."""

import csv
import math

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_decode_attention")


def test_every_method_runs_agrees_with_sdpa_and_writes_a_row(bench, tmp_path):
    out = tmp_path / "attn.csv"
    assert bench.main(["--models", "tiny", "--device", "cpu", "--rows", "2", "--cache-len", "64", "--filled", "9,64",
                       "--split-lens", "16", "--reps", "1", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["filled"], r["method"], r["split_len"], r["block_n"]) for r in rows] == [
        (f, m, s, b) for f in ("9", "64") for m, s, b in (("sdpa_window", "", ""), ("sdpa_full", "", ""),
                                                          ("split_k", "auto", "64"), ("split_k", "16", "16"))]
    hq, hkv, dim = bench.SHAPES["tiny"]
    for r in rows:
        assert r["status"] == "ok" and float(r["us"]) > 0
        assert float(r["max_diff"]) < 1e-5  # fp32 on the CPU: every method is the same attention
        assert int(r["bytes"]) == 2 * hkv * int(r["filled"]) * dim * 2 * 4 + 2 * 2 * hq * dim * 4
        assert r["of_copy_bw"] == "" and math.isnan(float(r["copy_gbps"]))  # no copy bandwidth off CUDA
    from logitless.ops.triton.decode_attention import default_split_len

    # the length split-K ran with: the automatic rule's (at least one block) or the one asked for
    assert [r["resolved_split_len"] for r in rows if r["method"] == "split_k"] == 2 * [
        str(max(64, default_split_len(2, hkv, 64))), "16"]


def test_bad_flags_are_refused(bench):
    for bad in (["--models", "13b"], ["--methods", "flash"], ["--filled", "5000"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
