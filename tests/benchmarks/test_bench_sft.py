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
