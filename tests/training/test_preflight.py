"""Checks that used to fail late (after the model was built, or at some step) now fail at start,
naming the key, the value and the expectation; SFT rows are length-checked with counts."""

import pathlib

import pytest
import torch
from omegaconf import OmegaConf

from logitless.training import ConfigError
from logitless.training.cli import CONFIG_ERROR_EXIT_CODE, report_errors
from logitless.training.preflight import ModelLimits, RowSubset, check_optimizer, fit_sft_dataset, model_limits
from full_sft_single_device import SFTRecipe

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def cfg(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    c = OmegaConf.load("configs/tiny_full.yaml")
    c.output_dir = str(tmp_path / "out")
    return c


@pytest.fixture
def no_model_build(monkeypatch):
    import logitless.training.model as m

    def boom(*a, **k):
        raise AssertionError("a model was built before the config was validated")

    monkeypatch.setattr(m, "build_model", boom)


# ----------------------------------------------------------------------------- optimizer / device
@pytest.mark.parametrize("override, match", [
    ({"lr": -1e-3}, r"config key 'optimizer.lr': expected a finite number >= 0, got -0.001"),
    ({"lr": float("nan")}, r"config key 'optimizer.lr': expected a finite number >= 0, got nan"),
    ({"lr": "1e-3x"}, r"config key 'optimizer.lr': expected a finite number >= 0, got '1e-3x'"),
    ({"betas": [0.9, 1.0]}, r"config key 'optimizer.betas': expected two numbers, each in \[0, 1\), got \[0.9, 1.0\]"),
    ({"betas": [0.9]}, r"config key 'optimizer.betas': expected two numbers"),
    ({"eps": 0.0}, r"config key 'optimizer.eps': expected a finite number > 0, got 0.0"),
    ({"weight_decay": -0.1}, r"config key 'optimizer.weight_decay': expected a finite number >= 0, got -0.1"),
])
def test_bad_optimizer_values_fail_before_the_model(cfg, no_model_build, override, match):
    cfg.optimizer = OmegaConf.merge(cfg.optimizer, override)
    with pytest.raises(ConfigError, match=match):
        SFTRecipe(cfg)


def test_torch_itself_rejects_what_check_optimizer_rejects():
    # The rules match torch's: every value refused here is refused by torch.optim when built.
    params = [torch.nn.Parameter(torch.zeros(1))]
    for kw in ({"lr": -1e-3}, {"betas": (0.9, 1.0)}, {"eps": -1.0}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError):
            torch.optim.AdamW(params, **kw)
        with pytest.raises(ConfigError):
            check_optimizer(OmegaConf.create({"_component_": "torch.optim.AdamW", **kw}))
    with pytest.raises(ValueError):
        torch.optim.SGD(params, lr=0.1, momentum=-0.5)
    with pytest.raises(ConfigError, match=r"'optimizer.momentum'"):
        check_optimizer(OmegaConf.create({"_component_": "torch.optim.SGD", "lr": 0.1, "momentum": -0.5}))
    check_optimizer(OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 0.0, "betas": [0.0, 0.999],
                                      "eps": 1e-8, "weight_decay": 0.0}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda_names_the_key(cfg, no_model_build, device):
    cfg.device = device
    with pytest.raises(ConfigError, match=rf"config key 'device': '{device}', but CUDA is not available"):
        SFTRecipe(cfg)


def test_malformed_device_names_the_key(cfg, no_model_build):
    cfg.device = "cuda:first"
    with pytest.raises(ConfigError, match=r"config key 'device': expected 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        SFTRecipe(cfg)


# ----------------------------------------------------------------------------- model limits
def test_model_limits_come_from_a_meta_build():
    from logitless.models.qwen2_5_tiny import TINY_QWEN2_5_CONFIG

    limits = model_limits(OmegaConf.create({"_component_": "logitless.models.qwen2_5_tiny", "max_seq_len": 96}))
    assert limits == ModelLimits(max_seq_len=96, vocab_size=TINY_QWEN2_5_CONFIG["vocab_size"])
    # a builder without arguments: its own default
    limits = model_limits(OmegaConf.create({"_component_": "logitless.models.qwen2_5_tiny"}))
    assert limits.max_seq_len == TINY_QWEN2_5_CONFIG["max_seq_len"]
    assert model_limits(OmegaConf.create({"_component_": "torch.nn.Identity"})) == ModelLimits()


# ----------------------------------------------------------------------------- SFT row lengths
class _Tok:
    def __init__(self, max_seq_len):
        self.max_seq_len = max_seq_len


class _Rows:
    """Rows whose length honours the tokenizer's max_seq_len at read time, as torchtune's SFTDataset does."""

    def __init__(self, tok, lengths, prompt_lens):
        self.tok, self.lengths, self.prompt_lens = tok, lengths, prompt_lens

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n, p = self.lengths[i], self.prompt_lens[i]
        tokens = list(range(1, n + 1))
        labels = [-100] * p + tokens[p:]
        cut = self.tok.max_seq_len
        return {"tokens": tokens[:cut], "labels": labels[:cut]} if cut else {"tokens": tokens, "labels": labels}


LENGTHS = [5, 12, 8, 20, 9, 3]
PROMPTS = [1, 2, 7, 10, 2, 1]  # row 2: prompt of 7 leaves 1 trained label inside 8; row 3: none inside 8


def _expect(limit):
    too_long = [i for i, n in enumerate(LENGTHS) if n > limit]
    # a row trains something iff a label at positions 1..min(n, limit)-1 is not ignored
    trained = [i for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS)) if max(p, 1) < min(n, limit)]
    return too_long, trained


@pytest.mark.parametrize("tok_limit, model_limit", [(8, 1024), (None, 8), (16, 8)])
def test_truncate_counts_and_cuts(tok_limit, model_limit):
    tok = _Tok(tok_limit)
    ds = _Rows(tok, LENGTHS, PROMPTS)
    out, report = fit_sft_dataset(ds, tokenizer=tok, model_max_seq_len=model_limit, on_too_long="truncate")
    too_long, trained = _expect(8)
    assert (report.rows, report.too_long, report.kept) == (6, len(too_long), len(trained))
    assert report.truncated == len(set(too_long) & set(trained)) and report.untrained == 6 - len(trained)
    assert report.limit == 8 and tok.max_seq_len == tok_limit  # the tokenizer's own limit is restored
    assert [len(out[i]["tokens"]) for i in range(len(out))] == [min(LENGTHS[i], 8) for i in trained]
    assert f"{len(trained)} of 6 rows kept" in report.message()


def test_drop_keeps_only_rows_that_fit():
    tok = _Tok(8)
    out, report = fit_sft_dataset(_Rows(tok, LENGTHS, PROMPTS), tokenizer=tok, model_max_seq_len=None,
                                  on_too_long="drop")
    keep = [i for i, (n, p) in enumerate(zip(LENGTHS, PROMPTS)) if n <= 8 and p < n]
    assert isinstance(out, RowSubset) and out.indices == keep and report.truncated == 0


def test_error_names_the_row_its_length_and_the_limit():
    tok = _Tok(8)
    n_long = sum(n > 8 for n in LENGTHS)
    with pytest.raises(ConfigError, match=rf"config key 'on_too_long': 'error', and dataset row 1 has 12 tokens, "
                                          rf"more than 8 \(tokenizer.max_seq_len\); {n_long} of 6 rows are too long"):
        fit_sft_dataset(_Rows(tok, LENGTHS, PROMPTS), tokenizer=tok, model_max_seq_len=64, on_too_long="error")


def test_a_dataset_that_trains_nothing_is_an_error():
    # Every prompt fills max_seq_len: torchtune's truncation leaves no trained label, and the run
    # used to train on nothing and exit 0.
    tok = _Tok(8)
    ds = _Rows(tok, [20, 30], [10, 12])
    with pytest.raises(ConfigError, match=r"config key 'dataset': no row left to train on: dataset: 0 of 2 rows "
                                          r"kept; 2 longer than 8 tokens"):
        fit_sft_dataset(ds, tokenizer=tok, model_max_seq_len=None, on_too_long="truncate")


@pytest.mark.parametrize("limit", [-3, 0])
def test_a_limit_below_one_is_an_error_not_a_run_that_trains_nothing(limit):
    # tokenizer.max_seq_len=-3 cut every row from its end: the scan said "6 of 6 rows kept" and every
    # step trained 0 tokens, exit 0
    tok = _Tok(limit)
    with pytest.raises(ConfigError, match=rf"config key 'tokenizer.max_seq_len': {limit} leaves no token to train on; "
                                          r"expected null or an int >= 1"):
        fit_sft_dataset(_Rows(tok, LENGTHS, PROMPTS), tokenizer=tok, model_max_seq_len=1024, on_too_long="truncate")


def test_an_empty_dataset_is_an_error():
    # every row filtered out by the builder (a filter_fn, a split with no rows)
    tok = _Tok(None)
    with pytest.raises(ConfigError, match=r"config key 'dataset': no row left to train on: dataset: 0 of 0 rows kept"):
        fit_sft_dataset(_Rows(tok, [], []), tokenizer=tok, model_max_seq_len=1024, on_too_long="truncate")


def test_tiny_alpaca_counts_match_an_independent_tokenisation():
    from logitless.datasets import tiny_alpaca_dataset, tiny_qwen2_5_tokenizer

    full = tiny_alpaca_dataset(tiny_qwen2_5_tokenizer(), split="eval")  # no cut: the true lengths
    lengths = [len(full[i]["tokens"]) for i in range(len(full))]
    limit = sorted(lengths)[len(lengths) // 2]
    tok = tiny_qwen2_5_tokenizer(max_seq_len=limit)
    ds = tiny_alpaca_dataset(tok, split="eval")
    _, report = fit_sft_dataset(ds, tokenizer=tok, model_max_seq_len=1024, on_too_long="truncate")
    assert report.too_long == sum(n > limit for n in lengths) > 0
    assert report.rows == len(lengths) and report.limit == limit


def test_sft_recipe_with_all_rows_too_long_fails_before_the_model(cfg, monkeypatch):
    import logitless.training.model as m

    def boom(*a, **k):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(m, "build_model", boom)
    cfg.tokenizer.max_seq_len = 8  # every tiny_alpaca prompt is longer: nothing would be trained
    with pytest.raises(ConfigError, match=r"config key 'dataset': no row left to train on"):
        SFTRecipe(cfg).run()


def test_alpaca_row_errors_name_the_file_and_row(cfg, tmp_path, no_model_build):
    import json

    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"instruction": "say hi", "input": "", "output": "hi"},
                                {"instruction": "", "input": "", "output": "x"}]))
    cfg.dataset = {"_component_": "logitless.datasets.alpaca_dataset", "source": "json", "data_files": str(path)}
    with pytest.raises(ConfigError, match=rf"config key 'dataset' \(logitless.datasets.alpaca_dataset\): alpaca dataset "
                                          rf"'{path}': row 1 has field 'instruction' = ''"):
        SFTRecipe(cfg).run()


# ----------------------------------------------------------------------------- one message
def test_report_errors_prints_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("LOGITLESS_DEBUG", raising=False)

    @report_errors
    def main():
        raise ConfigError("config key 'x': expected 1, got 2")

    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == CONFIG_ERROR_EXIT_CODE == 2
    assert capsys.readouterr().err == "ConfigError: config key 'x': expected 1, got 2\n"
    monkeypatch.setenv("LOGITLESS_DEBUG", "1")
    with pytest.raises(ConfigError):
        main()


def test_report_errors_leaves_other_exceptions_alone():
    @report_errors
    def main():
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        main()
