"""bench_counter_draw.py at a tiny vocabulary (CPU smoke test of the GPU microbenchmark)."""

import csv
import shutil

import pytest

from logitless.generation.kernels import counter_sampling


@pytest.fixture(scope="module")
def bench(load_experiment):
    return load_experiment("bench_counter_draw")


def test_every_section_writes_its_rows_and_the_draw_matches_float64(bench, tmp_path):
    before = tmp_path / "counter_sampling_before.py"  # a copy of this draw, loaded under another op name
    shutil.copy(counter_sampling.__file__, before)
    out = tmp_path / "draw.csv"
    assert bench.main(["--device", "cpu", "--rows", "3", "--vocab", "300", "--steps", "2", "--near-steps", "2",
                       "--gumbel-stride", "4099", "--reps", "1", "--before", str(before), "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    gumbel = [r for r in rows if r["section"] == "gumbel"]
    assert [r["variant"] for r in gumbel] == ["accurate"]  # the lg2.approx variants need CUDA
    assert gumbel[0]["finite"] == gumbel[0]["monotone"] == "True" and float(gumbel[0]["max_err_ulps"]) <= 3
    draws = [r for r in rows if r["section"] == "draw"]
    assert [(r["code"], r["temperature"]) for r in draws] == [
        (c, t) for t in ("1.0", "0.7", "0.0") for c in ("now", "before")]
    for r in draws:
        assert float(r["us"]) > 0
        if r["code"] == "now":
            assert r["same_tokens"] == r["draws"] == "6" and float(r["logp_max_err"]) < 1e-5
    near = [r for r in rows if r["section"] == "near_certain"]
    assert [(r["code"], r["other_tokens"], r["draws"]) for r in near] == [("now", "0", "6"), ("before", "0", "6")]


@pytest.mark.parametrize("flag", ["--steps", "--vocab", "--gumbel-stride"])
def test_a_non_positive_count_is_named(bench, flag, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([flag, "0"])
    assert f"{flag}: expected a positive integer, got 0" in capsys.readouterr().err
