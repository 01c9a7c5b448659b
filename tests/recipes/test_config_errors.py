"""End to end: a bad config or bad data ends a `tune run` with one message, no traceback, exit status 2,
before any step."""

import pathlib


def test_bad_optimizer_value_is_one_message(tune_cli, tmp_path):
    p = tune_cli(["run", "full_sft_single_device", "--config", "configs/tiny_full.yaml", "optimizer.lr=-1e-3"],
                 tmp_path / "out", env={"LOGITLESS_DEBUG": ""})
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 2, out
    assert "ConfigError: config key 'optimizer.lr': expected a finite number >= 0, got -0.001" in out
    assert "Traceback" not in out


def test_grpo_too_long_prompt_fails_before_step_one(tune_cli, tmp_path):
    # "a+b=" prompts with a + b <= 15 have 4 or 5 tokens; 5 + 4 new tokens exceed max_seq_len=8.
    p = tune_cli(["run", "grpo_single_device", "--config", "configs/tiny_grpo.yaml", "dataset.max_sum=15",
                  "model.max_seq_len=8", "on_too_long=error", "max_steps=2", "save_every_n_steps=null"],
                 tmp_path / "out", env={"LOGITLESS_DEBUG": ""})
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 2, out
    assert "ConfigError: config key 'on_too_long': 'error', and dataset prompt" in out
    assert "that is 9 > the model's max_seq_len=8" in out and "Traceback" not in out
    assert not list(pathlib.Path(tmp_path / "out").rglob("*.txt"))  # no step was logged
