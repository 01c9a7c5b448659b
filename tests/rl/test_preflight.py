"""GRPO settings and prompt lengths are checked at start, naming the key, the value and the expectation."""

import logging
import pathlib

import pytest
import torch
from omegaconf import OmegaConf

from logitless.datasets import tiny_qwen2_5_tokenizer
from logitless.rl.prompts import PromptDataset, arithmetic_dataset
from logitless.rl.preflight import PromptSubset, fit_prompt_dataset
from grpo_single_device import GRPORecipe
from logitless.rl.config import validate_grpo_config
from logitless.training import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def cfg(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    c = OmegaConf.load("configs/tiny_grpo.yaml")
    c.output_dir = str(tmp_path / "out")
    return c


@pytest.mark.parametrize("override, match", [
    ({"generation": {"temperature": 0.0}}, r"config key 'generation.temperature': expected a finite number in "
                                           r"\[0.0001, 10000.0\], got 0.0 \(0 = greedy"),
    ({"generation": {"temperature": float("inf")}}, r"config key 'generation.temperature': .*got inf"),
    ({"generation": {"temperature": 1e-30}}, r"config key 'generation.temperature': .*got 1e-30"),
    ({"generation": {"max_new_tokens": 0}}, r"config key 'generation.max_new_tokens': expected an int >= 1, got 0"),
    ({"generation": {"top_k": 0}}, r"config key 'generation.top_k': expected null or an int >= 1, got 0"),
    ({"generation": {"top_p": 0.0}}, r"config key 'generation.top_p': expected null or a number in \(0, 1\], got 0.0"),
    ({"generation": {"top_p": 1.5}}, r"config key 'generation.top_p': .*got 1.5"),
    ({"generation": {"stop_tokens": []}}, r"config key 'generation.stop_tokens': expected a non-empty list"),
    ({"generation": {"prefill_chunk_tokens": 0}}, r"generation\.prefill_chunk_tokens must be an int >= 1 .*got 0"),
    ({"optimizer": {"lr": -1e-3}}, r"config key 'optimizer.lr': expected a finite number >= 0, got -0.001"),
    ({"on_too_long": "cut"}, r"config key 'on_too_long': expected one of \['truncate', 'drop', 'error'\]"),
])
def test_bad_settings_name_the_key(cfg, override, match):
    with pytest.raises(ConfigError, match=match):
        validate_grpo_config(OmegaConf.merge(cfg, override))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda(cfg):
    cfg.device = "cuda"
    validate_grpo_config(cfg.copy())  # the spelling is fine: a GPU config validates on a CPU machine
    with pytest.raises(ConfigError, match=r"config key 'device': 'cuda', but CUDA is not available"):
        GRPORecipe(cfg)


def _prompts(lengths, **kw):
    return PromptDataset([f"p{i}" for i in range(len(lengths))], [list(range(1, n + 1)) for n in lengths],
                         {"answer": ["#### 0"] * len(lengths)}, **kw)


LENGTHS = [3, 7, 5, 9, 4]


def test_drop_truncate_error():
    limit, new = 10, 4  # prompts of at most 6 tokens fit
    fits = [i for i, n in enumerate(LENGTHS) if n + new <= limit]
    ds, report = fit_prompt_dataset(_prompts(LENGTHS), max_seq_len=limit, max_new_tokens=new, on_too_long="drop")
    assert isinstance(ds, PromptSubset) and ds.indices == fits
    assert (report.rows, report.kept, report.too_long) == (5, len(fits), 5 - len(fits))
    ds, report = fit_prompt_dataset(_prompts(LENGTHS), max_seq_len=limit, max_new_tokens=new,
                                    on_too_long="truncate")
    assert [ds[i]["prompt_tokens"] for i in range(len(ds))] == [list(range(1, n + 1))[-(limit - new):]
                                                                for n in LENGTHS]
    assert report.truncated == 5 - len(fits)
    with pytest.raises(ConfigError, match=r"config key 'on_too_long': 'error', and dataset prompt 1 has 7 tokens: "
                                          r"with generation.max_new_tokens=4 that is 11 > the model's max_seq_len=10"):
        fit_prompt_dataset(_prompts(LENGTHS), max_seq_len=limit, max_new_tokens=new, on_too_long="error")
    with pytest.raises(ConfigError, match=r"config key 'dataset': no prompt left to sample"):
        fit_prompt_dataset(_prompts(LENGTHS), max_seq_len=5, max_new_tokens=3, on_too_long="drop")
    with pytest.raises(ConfigError, match=r"config key 'generation.max_new_tokens': 10 leaves no room"):
        fit_prompt_dataset(_prompts(LENGTHS), max_seq_len=10, max_new_tokens=10, on_too_long="drop")


def test_prompts_the_dataset_dropped_are_reported():
    # max_prompt_tokens with overflow=skip used to drop prompts without a word
    ds = _prompts(LENGTHS, max_prompt_tokens=6, overflow="skip")
    _, report = fit_prompt_dataset(ds, max_seq_len=1024, max_new_tokens=4, on_too_long="drop")
    assert report.dataset_skipped == sum(n > 6 for n in LENGTHS) == 2
    assert "the dataset itself dropped 2" in report.message()


def test_too_long_prompts_are_handled_before_step_one(cfg, caplog):
    # Prompts "a+b=" with a + b <= 15 are 4 or 5 tokens; with 4 new tokens a 5-token prompt does not fit
    # max_seq_len=8. It used to fail with a ValueError at the first step that drew one.
    tok = tiny_qwen2_5_tokenizer()
    lengths = [len(r["prompt_tokens"]) for r in arithmetic_dataset(tok, split="train", max_sum=15)]
    fit = sum(n + 4 <= 8 for n in lengths)
    assert 0 < fit < len(lengths)
    cfg = OmegaConf.merge(cfg, {"dataset": {"max_sum": 15}, "model": {"max_seq_len": 8}, "max_steps": 3,
                                "prompts_per_step": 4, "num_generations": 2, "micro_batch_size": 8,
                                "eval_every_n_steps": None, "save_every_n_steps": None,
                                "save_final_checkpoint": False, "metric_logger": None})
    recipe = GRPORecipe(cfg)
    with caplog.at_level(logging.INFO):
        history = recipe.run()
    assert len(history) == 3 and len(recipe.dataset) == fit
    assert f"dataset: {fit} of {len(lengths)} prompts kept; {len(lengths) - fit} longer than 4 tokens" in caplog.text
