"""bench_sft.py measures every variant on the tiny model (CPU smoke test of the GPU benchmark)."""

import math
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_sft")


@pytest.mark.parametrize("variant", ["no_head", "torchtune_chunked", "torchtune_plain", "logitless_chunked",
                                     "logitless_fused"])
def test_variant_runs_one_step(bench, variant):
    a = SimpleNamespace(model="tiny", batch=2, seq=64, steps=1, warmup=0, dtype="fp32", device="cpu",
                        ac=True, variant=variant, fused_impl="auto", chunks=4)
    r = bench.run_child(a)
    assert r["status"] == "ok" and math.isfinite(r["loss"]) and r["step_ms"] > 0
    if variant != "no_head":  # a next-token CE of a random-init tied model: above ln(V)
        assert r["loss"] > math.log(2048)


def test_all_cross_entropy_variants_compute_the_same_loss(bench):
    losses = {}
    for v in ["torchtune_chunked", "torchtune_plain", "logitless_chunked", "logitless_fused"]:
        a = SimpleNamespace(model="tiny", batch=2, seq=32, steps=1, warmup=0, dtype="fp32", device="cpu",
                            ac=False, variant=v, fused_impl="auto", chunks=4)
        losses[v] = bench.run_child(a)["loss"]
    ref = losses["torchtune_plain"]
    for v, l in losses.items():
        assert l == pytest.approx(ref, rel=1e-5), (v, losses)


def test_compiled_torchtune_loss_and_compiled_layers_compute_the_same_loss(bench, monkeypatch):
    """``torchtune_chunked_compiled`` (torchtune's compile_loss) and ``--compile`` (compile_model)
    change how the step runs, not what it computes."""
    import torch

    monkeypatch.setenv("TORCH_COMPILE_BACKEND", "aot_eager")  # torchtune's compile helpers read it
    torch._dynamo.reset()
    try:
        def loss(variant, compile_layers):
            a = SimpleNamespace(model="tiny", batch=2, seq=32, steps=1, warmup=0, dtype="fp32", device="cpu",
                                ac=True, variant=variant, fused_impl="auto", chunks=4, compile=compile_layers)
            r = bench.run_child(a)
            assert r["status"] == "ok"
            return r["loss"]

        plain = loss("torchtune_chunked", False)
        assert loss("torchtune_chunked_compiled", False) == pytest.approx(plain, rel=1e-6)
        assert loss("torchtune_chunked_compiled", True) == pytest.approx(plain, rel=1e-6)
    finally:
        torch._dynamo.reset()


def test_results_csv_gains_new_columns_without_shifting_old_rows(bench, tmp_path):
    import csv

    path = tmp_path / "sft.csv"
    path.write_text("model,variant,step_ms,extra\nqwen,no_head,858.0,x\n")
    header = bench._add_columns(path, ["model", "variant", "compile", "step_ms"])
    assert header == ["model", "variant", "compile", "step_ms", "extra"]
    rows = list(csv.DictReader(open(path)))
    assert rows == [{"model": "qwen", "variant": "no_head", "compile": "", "step_ms": "858.0", "extra": "x"}]
