"""bench_decode_mlp.py at a tiny MLP (CPU smoke test of the GPU microbenchmark) and its kernel's
arithmetic against float64 at odd shapes."""

import csv
import math

import pytest
import torch
from torch.nn import functional as F


@pytest.fixture(scope="module")
def bench(load_experiment):
    return load_experiment("bench_decode_mlp")


@pytest.mark.parametrize("n,k,m,programs,splits,gated", [
    (200, 96, 5, 7, 1, False),    # 29 rows a program: a 16-row and a 16-row block (13 used)
    (200, 96, 5, 7, 1, True),     # gated: 100 columns, gate and up rows of each range
    (90, 200, 3, 2, 3, False),    # split-K, K not a multiple of the block
    (300, 64, 17, 4, 1, False),   # 75 rows a program: 64 + 16 (11 used); 17 rows pad to 32
    (40, 72, 5, 1, 4, False),     # more splits than k blocks: empty splits write zeros
])
def test_balanced_linear_matches_float64(bench, n, k, m, programs, splits, gated):
    torch.manual_seed(0)
    x, w = torch.randn(m, k), torch.randn(n, k)
    n_out = n // 2 if gated else n
    out = torch.full((splits, m, n_out), float("nan"))
    bench.balanced_linear(x, w, out, programs, splits, gated=gated, block_k=32)
    ref = x.double() @ w.double().T
    if gated:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    torch.testing.assert_close(out.sum(0).double(), ref, rtol=1e-5, atol=1e-5 * math.sqrt(k))


def test_row_blocks_cover_the_rows_with_two_power_of_two_blocks(bench):
    for rows in (1, 15, 16, 17, 68, 128, 136, 287):
        a, b = bench.row_blocks(rows)
        assert a & (a - 1) == 0 and b & (b - 1) == 0 and a >= 16 and b >= 16
        assert a + b >= rows and (a <= rows or rows < 16)


def test_every_section_writes_its_rows_within_float64(bench, tmp_path):
    out = tmp_path / "mlp.csv"
    assert bench.main(["--device", "cpu", "--models", "tiny", "--rows", "5", "--layers", "2", "--reps", "1",
                       "--iters", "1", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    products = [(r["product"], r["variant"]) for r in rows if r["section"] == "product"]
    assert ("gate_up", "cublas") in products and ("gate_up", "cublas+act") in products
    assert any(v.startswith("gated") for p, v in products) and any(p == "down" and "partials" in v
                                                                   for p, v in products)
    chain = [r["variant"] for r in rows if r["section"] == "chain"]
    assert chain == ["cublas", "balanced partials"]  # programmatic launches and atomics need CUDA
    for r in rows:
        assert float(r["us"]) > 0 and float(r["rel_err"]) < 1e-5, r


@pytest.mark.parametrize("argv,message", [
    (["--rows", "0"], "--rows: expected 1 to 128, got 0"),
    (["--rows", "129"], "--rows: expected 1 to 128, got 129"),
    (["--layers", "0"], "--layers: expected a positive integer, got 0"),
])
def test_bad_arguments_are_named(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err
