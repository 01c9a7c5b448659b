"""generation_tables.py: the docs tables computed from the committed H200 CSVs."""

import csv
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def tables(load_benchmark):
    return load_benchmark("generation_tables")


def test_decode_step_table_pairs_uniform_and_mix_rows(tables, tmp_path):
    fields = ["date", "model", "rows", "decode_attention", "mix", "step_ms", "roofline_ms", "roofline_frac",
              "tokens_per_s", "mean_len"]
    rows = [dict(zip(fields, v)) for v in (
        ("2026-11-23T15", "7b", "64", "split_k", "uniform", "6.2", "4.4", "0.71", "9906", "512"),
        ("2026-11-23T15", "7b", "64", "split_k", "mix", "", "", "", "3151.2", "146.2"),
        ("2026-11-23T15", "0.5b", "16", "sdpa", "uniform", "1.5", "0.5", "0.3", "100", "512"),
        ("2026-11-22T10", "0.5b", "16", "split_k", "uniform", "9", "9", "0.9", "1", "512"),  # before --since
    )]
    lines = tables.decode_step_table(rows, "2026-11-23T14").splitlines()
    assert lines[2:] == ["| Qwen2.5-0.5B | 16 | sdpa | 1.500 | 0.500 | 30.0% | 100 | - |",
                         "| Qwen2.5-7B | 64 | split_k | 6.200 | 4.400 | 71.0% | 9,906 | 3,151 (146) |"]


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
