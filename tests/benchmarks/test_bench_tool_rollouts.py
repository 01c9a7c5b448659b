"""bench_tool_rollouts.py on the tiny model (CPU smoke test of the GPU benchmark)."""

import csv

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_tool_rollouts")


@pytest.mark.slow  # ~20 s: the compiled samplers' CPU runs and an update on each kind of rollout
def test_multi_and_single_turn_rows_and_the_update(bench, tmp_path):
    out = tmp_path / "tools.csv"
    assert bench.main(["--models", "tiny", "--device", "cpu", "--no-compile", "--rows", "8", "--turns", "3",
                       "--turn-tokens", "4", "--tool-tokens", "3", "--prompt-len", "6", "--latency-ms", "0,20",
                       "--segment-prefill-tokens", "none,3", "--update", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["what"], r["sampler"], r["segment_prefill_tokens"], r["latency_ms"]) for r in rows] == [
        ("multi_turn", "eager_turns", "", "0.0"), ("multi_turn", "eager_turns", "", "20.0"),
        ("multi_turn", "eager_turns", "3", "0.0"), ("multi_turn", "eager_turns", "3", "20.0"),
        ("multi_turn", "compiled_turns", "", "0.0"), ("multi_turn", "compiled_turns", "", "20.0"),
        ("multi_turn", "compiled_turns", "3", "0.0"), ("multi_turn", "compiled_turns", "3", "20.0"),
        ("single_turn", "eager", "", ""), ("single_turn", "compiled", "", "")]
    for r in rows:
        assert r["status"] == "ok" and float(r["tokens_per_s"]) > 0
        if r["what"] == "multi_turn":
            assert 1 < float(r["mean_turns"]) <= 3 and int(r["appended"]) > 0  # tool tokens were appended
            assert int(r["sampled"]) + int(r["appended"]) == round(float(r["mean_len"]) * 8)
            assert float(r["same_as_instant"]) == 1.0  # the tools' latency does not change the rollout
        assert float(r["mean_len"]) <= int(r["max_len"])
        if r["sampler"] in ("eager", "compiled") or r["sampler"] == "compiled_turns" and not r["segment_prefill_tokens"]:
            assert int(r["decode_steps"]) >= int(r["max_len"])  # the longest row sets the steps
        if r["update_s"]:
            assert float(r["update_s"]) > 0 and r["logits_gib"] != ""
    # the two multi-turn samplers sample the same rollouts; the single-turn rows decode their mean length
    assert rows[0]["mean_len"] == rows[4]["mean_len"] and rows[2]["mean_len"] == rows[6]["mean_len"]
    assert float(rows[8]["mean_len"]) == round(sum(float(r["mean_len"]) for r in rows[:8]) / 8)


@pytest.mark.parametrize("value", ["none,1", "often"])
def test_bad_segment_prefill_tokens_are_named(bench, value, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--segment-prefill-tokens", value])
    assert f"--segment-prefill-tokens: expected a comma list of ints >= 2, 'none' or 'auto', got '{value}'" in (
        capsys.readouterr().err)


def test_segment_prefill_tokens_parse(bench):
    assert bench.parse_args(["--segment-prefill-tokens", "auto,None,64"]).segment_prefill_tokens == ["auto", None, 64]


def test_turn_stop_tokens_hold_the_share_of_the_vocabulary(bench):
    stops = bench.turn_stop_tokens(1000, 50)
    assert len(stops) == 20 and len(set(stops)) == 20 and 0 not in stops
