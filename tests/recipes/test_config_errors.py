"""End to end: a bad config or bad data ends a `tune run` with one message, no traceback, exit status 2,
before any step."""

import pathlib

from logitless.training import read_disk_log


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


def _one_error_line(log):
    """The run's only line that reports an error (the last line of its output)."""
    errors = [line for line in log.splitlines() if "Error" in line or "Traceback" in line]
    assert len(errors) == 1 and log.rstrip().endswith(errors[0]), log
    return errors[0]


def test_a_loss_mistake_fails_before_the_model_and_a_corrected_rerun_uses_the_folder(tune_cli, tmp_path):
    # The loss used to be built after the model, with a 40-line traceback naming no key; the folder,
    # claimed by then, refused the corrected rerun ("output_dir is not empty: it holds files of run ...").
    out = tmp_path / "out"
    args = ["run", "full_sft_single_device", "--config", "configs/tiny_full.yaml", "max_steps=1",
            "save_final_checkpoint=False"]
    p = tune_cli([*args, "loss.num_output_chunks=abc"], out, env={"LOGITLESS_DEBUG": ""})
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 2, log
    assert _one_error_line(log) == ("ConfigError: config key 'loss.num_output_chunks': "
                                    "logitless.losses.ce.CEWithChunkedOutputLoss expects an int, got 'abc' (str)")
    assert not out.exists()  # nothing claimed, nothing written
    p = tune_cli(args, out, env={"LOGITLESS_DEBUG": ""})
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log
    assert list(read_disk_log(next((out / "logs").glob("log_*.txt")))["loss"]) == [1]


def test_a_misspelt_reward_key_fails_before_the_policy_is_built(tune_cli, tmp_path):
    # `wieght: 2.0` was ignored: the weight stayed 1.0 and the run went on
    p = tune_cli(["run", "grpo_single_device", "--config", "configs/tiny_grpo.yaml", "max_steps=1",
                  "rewards=[{function: logitless.rl.rewards.math_correctness, wieght: 2.0}]"],
                 tmp_path / "out", env={"LOGITLESS_DEBUG": ""})
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 2, log
    assert _one_error_line(log) == ("ConfigError: config key 'rewards[0].wieght': unknown; a reward entry takes "
                                    "['function', 'weight', 'name'] (did you mean 'weight'?)")
    assert not (tmp_path / "out").exists()
