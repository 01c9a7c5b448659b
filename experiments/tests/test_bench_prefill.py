"""bench_prefill.py on the tiny model (CPU smoke test of the GPU benchmark)."""

import csv

import pytest


@pytest.fixture(scope="module")
def bench(load_experiment):
    return load_experiment("bench_prefill")


def test_every_setting_runs_and_writes_a_row(bench, tmp_path):
    out = tmp_path / "prefill.csv"
    assert bench.main(["--models", "tiny", "--device", "cpu", "--prompts", "1,2", "--widths", "40",
                       "--chunk-tokens", "16,none", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["prompts"], r["rows"], r["chunk_tokens"]) for r in rows] == [
        ("1", "16", "16"), ("1", "16", "none"), ("2", "32", "16"), ("2", "32", "none")]
    for r in rows:
        assert r["status"] == "ok" and r["prompt_len"] == "40" and r["gpu"] and r["torch"]
        assert float(r["prefill_s"]) > 0 and float(r["call_s"]) > 0


def test_bad_chunk_tokens_are_refused_naming_the_flag(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--chunk-tokens", "0"])
    assert "--chunk-tokens" in capsys.readouterr().err
    assert bench.parse_args(["--chunk-tokens", "4096,None"]).chunk_tokens == [4096, None]


def test_each_timed_prefill_follows_an_untimed_one_of_its_shape(bench, monkeypatch):
    # the first prefill at a shape pays kernel selection and allocator growth: a setting measured
    # first would be charged for them
    import torch

    from logitless.generation import prefill as prefill_module

    calls, real = [], prefill_module.prefill

    def counting(model, tokens, **kwargs):
        calls.append((tuple(tokens.shape), int(model.layers[0].attn.kv_cache.cache_pos[0])))
        return real(model, tokens, **kwargs)

    monkeypatch.setattr(prefill_module, "prefill", counting)
    model = bench.build_model("tiny", torch.device("cpu"))
    bench.measure_prefill(model, bench.prompts_of(model, 2, 24), 16, torch.device("cpu"))
    assert calls == [((2, 24), 0), ((2, 24), 0)]  # the timed one also writes from column 0
