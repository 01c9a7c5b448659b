"""bench_capacity.py's search (doubling, then bisection) against the answer computed directly, and its
trials on the tiny model on CPU with a simulated memory limit and simulated out-of-memory errors."""

import csv
import itertools
import math

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("bench_capacity")


def expected_longest(limit, *, start, max_tokens, resolution, bisect):
    """The longest length <= limit the search can reach, written from its definition: with bisection
    any multiple of the resolution in [start, max_tokens] (or max_tokens itself); without, the doubling
    sequence start, 2 start, ... (max_tokens where it overshoots)."""
    if bisect:
        reachable = set(range(start, max_tokens + 1, resolution)) | {max_tokens}
    else:
        reachable = {min(start * 2 ** k, max_tokens) for k in range(64) if start * 2 ** (k - 1) < max_tokens}
    fitting = [n for n in reachable if n <= limit]
    return max(fitting, default=0)


@pytest.mark.parametrize("bisect", [True, False])
def test_search_finds_the_longest_fitting_length(bench, bisect):
    for start, resolution, max_tokens in [(8, 8, 1024), (16, 8, 200), (8192, 8192, 524288), (24, 8, 24)]:
        for limit in itertools.chain(range(0, 260, 3), [max_tokens - 1, max_tokens, 10 ** 9],
                                     range(0, 600000, 37000)):
            tried = []

            def fits(n):
                tried.append(n)
                return "ok" if n <= limit else "OOM"

            got = bench.search_longest(fits, start=start, max_tokens=max_tokens, resolution=resolution, bisect=bisect)
            want = expected_longest(limit, start=start, max_tokens=max_tokens, resolution=resolution, bisect=bisect)
            assert got == want, (start, resolution, max_tokens, limit, tried)
            assert len(tried) == len(set(tried)) and all(start <= n <= max_tokens for n in tried), tried
            assert all(n % resolution == 0 or n == max_tokens for n in tried), tried
            # doubling, then at most log2(gap / resolution) bisection trials
            assert len(tried) <= 2 + math.log2(max_tokens / start) + math.log2(max(max_tokens, start) / resolution)


def test_a_length_not_measured_stops_the_search_where_it_is(bench):
    tried = []

    def fits(n):
        tried.append(n)
        return "ok" if n <= 32 else "skipped: --max-minutes budget"

    assert bench.search_longest(fits, start=8, max_tokens=1024, resolution=8, bisect=True) == 32
    assert tried == [8, 16, 32, 64]  # no bisection towards a length that was never measured
    with pytest.raises(ValueError, match="--min-tokens 12 must be a positive multiple of --resolution 8"):
        bench.search_longest(fits, start=12, max_tokens=64, resolution=8, bisect=True)


def test_the_budget_predicts_quadratic_step_times(bench):
    budget = bench.Budget(deadline=1e18, trial_cap_s=100.0)
    assert budget.refuses(("m",), 1024, 1) is None  # nothing measured yet
    budget.last[("m",)] = (1024, 10.0)
    assert budget.predicted_s(("m",), 2048) == pytest.approx(40.0)
    assert budget.refuses(("m",), 2048, 2) is None
    assert budget.refuses(("m",), 4096, 1).startswith("skipped: predicted 160 s a step > --trial-cap-s 100")
    assert bench.Budget(deadline=0.0, trial_cap_s=1e9).refuses(("m",), 8, 1) == "skipped: --max-minutes budget"


class OutOfMemoryOver:
    """A simulated GPU: a step over ``limit`` tokens raises torch.OutOfMemoryError where a CUDA step
    would (inside the step, after the forward); the peak is 1 MiB a token."""

    def __init__(self, limit):
        self.limit, self.tokens, self.syncs = limit, 0, 0

    def reset(self, tokens):
        self.tokens, self.syncs = tokens, 0

    def sync(self):
        self.syncs += 1
        if self.syncs == 2 and self.tokens > self.limit:  # the end of the first step
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    def peak_gib(self):
        return self.tokens / 1024


def test_tiny_model_trials_recover_from_out_of_memory_and_write_the_csv(bench, tmp_path):
    """Two losses on one tiny model: a real step per length, out of memory simulated above 20 tokens;
    the search goes on after each, and each loss's longest length is the one computed directly."""
    out = tmp_path / "capacity.csv"
    logged = []
    rows = bench.main(["--models", "tiny", "--losses", "torchtune_chunked,logitless_fused", "--device", "cpu",
                       "--impl", "chunked", "--min-tokens", "8", "--max-tokens", "32", "--resolution", "4",
                       "--bisect", "--warmup", "0", "--steps", "1", "--out", str(out)],
                      meter=OutOfMemoryOver(limit=20), log=logged.append)
    want = expected_longest(20, start=8, max_tokens=32, resolution=4, bisect=True)
    assert want == 20
    for loss in ("torchtune_chunked", "logitless_fused"):
        mine = [r for r in rows if r["loss"] == loss]
        assert [(r["seq_len"], r["status"]) for r in mine] == [(8, "ok"), (16, "ok"), (32, "OOM"), (24, "OOM"),
                                                                (20, "ok")]
        assert [r["seq_len"] for r in mine if r["longest"]] == [want]
        assert all(r["step_s"] > 0 and r["peak_gib"] == pytest.approx(r["seq_len"] / 1024)
                   for r in mine if r["status"] == "ok")
    with open(out, newline="") as fh:
        written = list(csv.DictReader(fh))
    assert len(written) == 10 and {r["gpu"] for r in written} == {"cpu"}
    assert {r["torch"] for r in written} == {torch.__version__} and all(r["date"] and r["torchtune"] for r in written)
    assert any(line.split()[:4] == ["tiny", "full", "logitless_fused", "False"] and line.split()[4] == "20"
               for line in logged), logged
    back = bench.read_rows(out)  # what --plot-csv draws
    assert [(r["loss"], r["seq_len"], r["status"], r["offload"]) for r in back] == [
        (r["loss"], r["seq_len"], r["status"], r["offload"]) for r in rows]
    assert all(r["peak_gib"] == pytest.approx(w["peak_gib"]) for r, w in zip(back, rows) if w["status"] == "ok")


def test_a_peak_over_the_memory_limit_counts_as_not_fitting(bench, tmp_path):
    out = tmp_path / "c.csv"
    rows = bench.main(["--models", "tiny", "--losses", "logitless_fused", "--device", "cpu", "--impl", "chunked",
                       "--min-tokens", "8", "--max-tokens", "16", "--resolution", "8", "--warmup", "0",
                       "--memory-limit-gib", str(12 / 1024), "--out", str(out)],
                      meter=bench.SimulatedMeter(static_gib=0.0, gib_per_token=1 / 1024), log=lambda line: None)
    assert [(r["seq_len"], r["status"], r["longest"]) for r in rows] == [(8, "ok", True), (16, "OOM", False)]
    try:
        import matplotlib  # noqa: F401  (on the GPU machines; not a dependency)
    except ImportError:
        return
    bench.main(["--plot-csv", str(out)], log=lambda line: None)
    assert out.with_suffix(".png").stat().st_size > 0


def test_bad_arguments_are_named(bench, capsys):
    for argv, words in [(["--models", "13b"], "--models: unknown model '13b'"),
                        (["--losses", "cce"], "--losses: unknown loss 'cce'"),
                        (["--min-tokens", "100"], "--min-tokens 100 must be a multiple of --resolution 8192"),
                        (["--max-tokens", "4096"], "--max-tokens 4096 is below --min-tokens 8192")]:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert words in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_allow_length_extends_every_rotary_table(bench, family):
    """Qwen2's and Llama 3's rotary classes share no base class with torchtune's
    ``RotaryPositionalEmbeddings``: each table must still be rebuilt, so a sequence past the builder's
    ``max_seq_len`` runs and equals the model built for that length from the start."""
    from torchtune.models.llama3 import llama3
    from torchtune.models.qwen2 import qwen2

    def build(max_seq_len):
        torch.manual_seed(0)
        args = dict(vocab_size=64, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=32, max_seq_len=max_seq_len)
        return qwen2(intermediate_dim=64, **args) if family == "qwen2" else llama3(intermediate_dim=64, **args)

    short, long = build(16), build(64)
    bench.allow_length(short, 64)
    tokens = torch.randint(0, 64, (1, 40))
    torch.testing.assert_close(short(tokens), long(tokens))
