"""generation_tables.py: the docs tables computed from the committed H200 CSVs."""

import csv
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "results"


@pytest.fixture(scope="module")
def tables(load_experiment):
    return load_experiment("generation_tables")


def test_decode_step_table_pairs_uniform_and_mix_rows(tables, tmp_path):
    fields = ["date", "model", "rows", "new_tokens", "decode_attention", "options", "mix", "step_ms", "roofline_ms",
              "roofline_frac", "tokens_per_s", "mean_len"]
    rows = [dict(zip(fields, v)) for v in (
        ("2026-11-23T15", "7b", "64", "512", "split_k", "", "uniform", "6.2", "4.4", "0.71", "9906", "512"),
        ("2026-11-23T15", "7b", "64", "512", "split_k", "", "mix", "", "", "", "3151.2", "146.2"),
        ("2026-11-23T15", "7b", "64", "512", "split_k", "x=1", "uniform", "7", "4.4", "0.63", "9000", "512"),
        ("2026-11-23T15", "0.5b", "16", "2048", "sdpa", "", "uniform", "1.5", "0.5", "0.3", "100", "2048"),
        ("2026-11-22T10", "0.5b", "16", "512", "split_k", "", "uniform", "9", "9", "0.9", "1", "512"),  # before --since
    )]
    lines = tables.decode_step_table(rows, "2026-11-23T14").splitlines()
    assert lines[2:] == ["| Qwen2.5-0.5B | 16 | 2048 | sdpa | 1.500 | 0.500 | 30.0% | 100 | - |  | 2026-11-23 15h |",
                         "| Qwen2.5-7B | 64 | 512 | split_k | 6.200 | 4.400 | 71.0% | 9,906 | 3,151 (146) |  | "
                         "2026-11-23 15h |",
                         "| Qwen2.5-7B | 64 | 512 | split_k | 7.000 | 4.400 | 63.0% | 9,000 | - | x=1 | 2026-11-23 15h |"]


def test_programmatic_launch_table_pairs_each_setting_with_its_mix(tables):
    fields = ["date", "model", "setting", "mix", "step_ms", "roofline_frac", "seconds", "tokens_per_s"]
    rows = [dict(zip(fields, v)) for v in (
        ("2026-11-23T19:30:21", "1.5b", "off", "uniform", "2.856", "0.454", "1.7", "21741.9"),
        ("2026-11-23T19:30:21", "1.5b", "off", "mix", "", "", "1.291", "8596.5"),
        ("2026-11-23T19:31:27", "1.5b", "on", "uniform", "2.676", "0.482", "1.6", "23153.8"),
        ("2026-11-23T19:31:27", "1.5b", "on", "mix", "", "", "1.194", "9295.2"),
    )]
    assert tables.programmatic_launch_table(rows).splitlines()[2:] == [
        "| 2026-11-23 19:30 | Qwen2.5-1.5B | off | 2.856 | 45.4% | 1.291 | 8,596 |",
        "| 2026-11-23 19:31 | Qwen2.5-1.5B | on | 2.676 | 48.2% | 1.194 | 9,295 |"]


def test_step_breakdown_table_has_a_column_per_run_and_the_wall_first(tables):
    fields = ["model", "code", "wall_us", "category", "us_per_step", "launches_per_step"]
    rows = [dict(zip(fields, v)) for v in (
        ("1.5b", "before", "2989.2", "gemm", "1278.0", "141.0"),
        ("1.5b", "before", "2989.2", "attention", "895.7", "112.0"),
        ("0.5b", "before", "1728.0", "gemm", "663.3", "121.0"),
    )]
    assert tables.step_breakdown_table(rows).splitlines() == [
        "| us / step (launches) | Qwen2.5-1.5B, before | Qwen2.5-0.5B, before |", "|---|---:|---:|",
        "| wall | 2989 | 1728 |", "| gemm | 1278 (141) | 663 (121) |", "| attention | 896 (112) | - |"]


def test_committed_attention_table_ratio_is_the_csv_ratio(tables):
    with open(RESULTS / "decode_attention_h200.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    table = tables.attention_table(rows).splitlines()[2:]
    split = [r for r in rows if r["method"] == "split_k"]
    assert len(table) == len(split)
    r = next(r for r in split if (r["model"], r["rows"], r["filled"]) == ("1.5b", "64", "3584"))
    window = next(w for w in rows if (w["model"], w["rows"], w["filled"], w["method"]) == ("1.5b", "64", "3584", "sdpa_window"))
    line = next(t for t in table if t.startswith("| Qwen2.5-1.5B | 64 | 3584 |"))
    assert line.split("|")[7].strip() == f"{float(r['us']) / float(window['us']):.2f}"


def test_split_length_table_sets_the_first_runs_rule_against_the_last(tables):
    fields = ["date", "model", "rows", "filled", "method", "split_len", "resolved_split_len", "block_n", "us", "status"]
    rows = [dict(zip(fields, v)) for v in (
        ("2026-11-23T17:34", "1.5b", "8", "2048", "split_k", "auto", "64", "64", "20.0", "ok"),
        ("2026-11-23T17:34", "1.5b", "8", "2048", "split_k", "64", "64", "64", "19.0", "ok"),
        ("2026-11-23T17:34", "1.5b", "8", "2048", "split_k", "256", "256", "64", "13.0", "ok"),
        ("2026-11-23T17:34", "1.5b", "8", "2048", "split_k", "256", "256", "32", "1.0", "ok"),  # other block_n
        ("2026-11-23T17:57", "1.5b", "8", "2048", "split_k", "auto", "256", "64", "12.0", "ok"),
        ("2026-11-23T17:57", "1.5b", "8", "2048", "split_k", "256", "256", "64", "12.5", "ok"),  # the latest wins
        ("2026-11-23T17:57", "1.5b", "8", "2048", "sdpa_full", "", "", "", "90.0", "ok"),
    )]
    lines = tables.split_length_table(rows).splitlines()
    assert lines[0].count("split 64 (us)") == 1 and "split 256 (us)" in lines[0]
    assert lines[2:] == ["| Qwen2.5-1.5B | 8 | 2048 | 19.0 | 12.5 | 64, 20.0 | 256, 12.0 | 0.60 |"]


def test_prefill_table_sets_chunked_beside_one_forward_and_shows_a_failure(tables):
    fields = ["model", "prompts", "G", "prompt_len", "chunk_tokens", "prefill_s", "prefill_extra_gib",
              "prompt_cache_gib", "call_peak_gib", "status"]
    rows = [dict(zip(fields, v)) for v in (
        ("7b", "4", "16", "32768", "8192", "6.6349", "2.719", "7.0", "122.638", "ok"),
        ("7b", "4", "16", "32768", "none", "9.3684", "21.375", "7.0", "", "OOM"),
        ("1.5b", "1", "16", "8192", "none", "0.0955", "0.566", "0.219", "4.402", "ok"),
    )]
    lines = tables.prefill_table(rows).splitlines()
    assert lines[2:] == ["| Qwen2.5-1.5B | 1 x 16 | 8192 | - | 0.10 | - | 0.57 | 0.22 | - | 4.4 |",
                         "| Qwen2.5-7B | 4 x 16 | 32768 | 6.63 | 9.37 | 2.72 | 21.38 | 7.00 | 122.6 | OOM |"]
