"""probe_persistent_mlp.py: the persistent MLP kernel's phases (separate launches under the Triton
interpreter) against float64 at odd shapes, and the probe's CPU smoke run."""

import csv
import math

import pytest
import torch


@pytest.fixture(scope="module")
def probe(load_experiment):
    return load_experiment("probe_persistent_mlp")


@pytest.mark.parametrize("m,d,inter,nprog,fixup,spans", [
    (5, 40, 72, 4, False, None),   # 18 rows a program (16 + 16 blocks), 2 spans of the down reduction
    (5, 40, 72, 4, True, None),    # the last span of each column block sums the spans
    (3, 100, 200, 3, True, 3),     # two column blocks (64 + 36), spans over 4 k blocks of 64 (the last partial)
    (17, 70, 130, 5, False, 2),    # 17 rows pad to 32; 26 intermediate rows a program
])
def test_persistent_mlp_matches_float64(probe, m, d, inter, nprog, fixup, spans):
    torch.manual_seed(0)
    h = torch.randn(m, d)
    wgu, wd = torch.randn(2 * inter, d) / math.sqrt(d), torch.randn(d, inter) / math.sqrt(inter)
    mlp = probe.PersistentMLP(m, d, inter, torch.device("cpu"), torch.float32, nprog, fixup=fixup, spans=spans)
    sync = torch.zeros(mlp.sync_words(), dtype=torch.int32)
    mlp.act.fill_(float("nan"))  # a read before its write shows
    mlp.part.fill_(float("nan"))
    out = torch.full((m, d), float("nan"))
    mlp(h, wgu, wd, out, sync)
    ref = probe.chain_reference(h, [wgu], [wd])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * math.sqrt(inter))
    if fixup:  # every span of every column block arrived once
        assert sync[2:].tolist() == [mlp.spans] * mlp.n_blocks


def test_variant_options_parse_and_reject_unknown_keys(probe):
    assert probe.variant_options("fixup=1,prefetch=0,stages=6") == {"fixup": True, "prefetch": 0, "stages": 6}
    assert probe.variant_options("") == {}
    with pytest.raises(ValueError, match="unknown option 'fix' in 'fix=1'"):
        probe.variant_options("fix=1")


def test_smoke_run_writes_every_variant_within_float64(probe, tmp_path):
    out = tmp_path / "persistent.csv"
    assert probe.main(["--device", "cpu", "--models", "tiny", "--rows", "5", "--layers", "2", "--reps", "1",
                       "--iters", "1", "--variants", "fixup=0;fixup=1,spans=2", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["variant"] for r in rows] == ["cublas", "fixup=0", "fixup=1,spans=2"]
    for r in rows:
        assert float(r["us_per_layer"]) > 0 and float(r["rel_err"]) < 1e-5, r
