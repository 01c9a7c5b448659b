"""GRPO settings and prompt lengths are checked at start, naming the key, the value and the expectation."""

import json
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


MATH = "logitless.rl.rewards.math_correctness"


@pytest.mark.parametrize("override, match", [
    # the loss is built before the model: its own checks name the argument
    ({"loss": {"loss_type": "foo"}},
     r"config key 'loss.loss_type' \(logitless.losses.GRPOLoss\): loss_type must be one of \('grpo', 'bnpo', "
     r"'dr_grpo', 'dapo', 'cispo', 'sapo'\), got 'foo'$"),
    ({"loss": {"epsilon": -1}}, r"config key 'loss.epsilon' \(logitless.losses.GRPOLoss\): epsilon must be a number "
                                r">= 0, got -1$"),
    ({"loss": {"beta": "abc"}}, r"config key 'loss.beta': logitless.losses.grpo.GRPOLoss expects a number, "
                                r"got 'abc' \(str\)$"),
    ({"loss": {"impl": "bogus"}}, r"config key 'loss.impl' \(logitless.losses.GRPOLoss\): impl must be one of"),
    ({"loss": {"temperature": True}}, r"config key 'loss.temperature': .*GRPOLoss expects a number, got True"),
    # reward entries: known keys, numeric weights, importable callables
    ({"rewards": [{"function": MATH, "wieght": 2.0}]},
     r"config key 'rewards\[0\].wieght': unknown; a reward entry takes \['function', 'weight', 'name'\] "
     r"\(did you mean 'weight'\?\)$"),
    ({"rewards": [{"function": MATH, "weight": "abc"}]},
     r"config key 'rewards\[0\].weight': expected a finite number, got 'abc' \(str\)$"),
    ({"rewards": [{"function": MATH, "weight": True}]},
     r"config key 'rewards\[0\].weight': expected a finite number, got True \(bool\)$"),
    ({"rewards": [{"function": MATH, "weight": float("inf")}]}, r"config key 'rewards\[0\].weight': .*got inf"),
    ({"rewards": [{"function": MATH}, {"function": "nope.nothing"}]},
     r"config key 'rewards\[1\].function': 'nope.nothing' cannot be imported"),
    ({"rewards": [{"function": "logitless.rl.rewards.MAX_ABS_REWARD"}]},
     r"config key 'rewards\[0\].function': expected a callable, got float"),
    ({"rewards": [{"function": "math.sqrt"}]}, r"config key 'rewards\[0\].function': 'sqrt' cannot take "
                                               r"\(prompts, completions, \*\*columns\)"),
])
def test_grpo_config_mistakes_fail_in_the_constructor(cfg, override, match):
    # they used to pass validation and fail after the policy was built (or never: a misspelt weight was 1.0)
    with pytest.raises(ConfigError, match=match):
        GRPORecipe(OmegaConf.merge(cfg, override))


def test_an_sft_loss_is_not_a_grpo_loss(cfg):
    cfg.loss = {"_component_": "logitless.losses.CEWithChunkedOutputLoss"}
    with pytest.raises(ConfigError, match=r"config key 'loss._component_': logitless.losses.CEWithChunkedOutputLoss "
                                          r"builds a CEWithChunkedOutputLoss, not a logitless.losses.grpo.GRPOLoss"):
        GRPORecipe(cfg)


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


# ----------------------------------------------------------------------------- the columns the rewards read
def _chat_rows(tmp_path, edit):
    """The tiny chat prompts as a JSON-lines file, each row passed through ``edit`` (None drops the row)."""
    from logitless.rl.prompts import TINY_CHAT_FILES

    rows = [json.loads(line) for line in open(TINY_CHAT_FILES["train"])]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (edit(i, dict(r)) for i, r in enumerate(rows))))
    return str(path), len(rows)


def _without_answer(i, row):
    row.pop("answer")
    return row


def _some_answers_missing(i, row):
    if i in (2, 5):
        row["answer"] = "  " if i == 2 else None
    if i == 7:
        row.pop("answer")
    return row


def _specs(*functions):
    from logitless.rl.rewards import build_reward_specs

    return build_reward_specs([{"function": f} for f in functions])


def test_a_reward_column_the_dataset_lacks_fails_before_the_policy_is_built(cfg, tmp_path, monkeypatch):
    # It used to fail at step 1, after the model build and the first generation (math_correctness
    # needs `answer`, a TypeError inside the reward call).
    import logitless.training.model as m

    monkeypatch.setattr(m, "build_model", lambda *a, **k: pytest.fail("the policy was built"))
    path, _ = _chat_rows(tmp_path, _without_answer)
    cfg = OmegaConf.merge(OmegaConf.load("configs/tiny_grpo_chat.yaml"), {
        "output_dir": str(tmp_path / "out"), "dataset": {"data_files": path}, "eval_every_n_steps": None})
    with pytest.raises(ConfigError, match=rf"config key 'rewards\[0\].function': 'math_correctness' reads the column "
                                          rf"'answer', which dataset \({path}\) does not have; its columns are "
                                          rf"\['a', 'b'\]"):
        GRPORecipe(cfg).run()
    assert not (tmp_path / "out").exists()  # the folder is not claimed: the corrected run may use it


def test_missing_and_empty_answers_are_counted_and_dropped_or_refused(tmp_path):
    from logitless.rl.preflight import check_reward_columns
    from logitless.rl.prompts import prompt_dataset

    path, n = _chat_rows(tmp_path, _some_answers_missing)
    ds = prompt_dataset(tiny_qwen2_5_tokenizer(), data_files=path)
    specs = _specs("logitless.rl.rewards.math_correctness", "logitless.rl.rewards.gsm8k_format")
    kept, report = check_reward_columns(ds, specs, on_missing_answer="drop")
    assert [kept[i]["prompt"] for i in range(len(kept))] == [ds[i]["prompt"] for i in range(n) if i not in (2, 5, 7)]
    assert (report.rows, report.kept, report.missing, report.columns) == (n, n - 3, 3, ("answer",))
    assert report.message() == (f"dataset: 3 of {n} prompts have no value for a column a reward needs (first: row 2, "
                                f"'answer' = '  '); 3 dropped (on_missing_answer='drop')")
    with pytest.raises(ConfigError, match=rf"config key 'on_missing_answer': 'error', and dataset \({path}\) row 2 "
                                          rf"has 'answer' = '  '; 3 of {n} prompts have no value for \['answer'\]"):
        check_reward_columns(ds, specs, on_missing_answer="error")
    # a reward that reads no column needs none
    assert check_reward_columns(ds, _specs("logitless.rl.rewards.gsm8k_format"), on_missing_answer="error")[0] is ds


def test_every_prompt_without_an_answer_is_an_error_whatever_the_setting(tmp_path):
    from logitless.rl.preflight import check_reward_columns

    ds = PromptDataset(["p0", "p1"], [[1], [2]], {"answer": ["", None]})
    with pytest.raises(ConfigError, match=r"config key 'dataset': no prompt left to sample: dataset: 2 of 2 prompts "
                                          r"have no value"):
        check_reward_columns(ds, _specs("logitless.rl.rewards.math_correctness"), on_missing_answer="drop")


def _answer_only(prompts, completions, answer):
    return [0.0] * len(completions)


def test_a_reward_without_kwargs_must_take_every_column():
    from logitless.rl.preflight import check_reward_columns

    ds = PromptDataset(["p0"], [[1]], {"answer": ["1"], "a": [1]})
    with pytest.raises(ConfigError, match=r"'_answer_only' is given every column of dataset and 'completion_ids' as "
                                          r"keyword arguments, but takes none named 'a'; expected a signature ending "
                                          r"in \*\*kwargs"):
        check_reward_columns(ds, _specs(_answer_only), on_missing_answer="drop")


def _counts_tokens(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def test_completion_ids_is_given_by_the_recipe_not_read_from_the_dataset():
    from logitless.rl.preflight import check_reward_columns

    ds = PromptDataset(["p0"], [[1]], {"answer": [None]})
    kept, report = check_reward_columns(ds, _specs(_counts_tokens), on_missing_answer="error")
    assert kept is ds and report.columns == ()


def _reads_the_conversation(prompts, completions, conversation, environment_info, **kwargs):
    return [float(len(c)) for c in conversation]


def test_a_reward_may_read_the_columns_a_tool_rollout_adds():
    """``conversation`` and ``environment_info`` come from the sampler when it runs tool turns
    (``PolicySampler.reward_columns``), never from the dataset; without tool turns they are missing."""
    from logitless.generation.policy_sampler import TRAJECTORY_COLUMNS
    from logitless.rl.preflight import check_reward_columns

    ds = PromptDataset(["p0"], [[1]], {"answer": ["1"]})
    kept, report = check_reward_columns(ds, _specs(_reads_the_conversation), on_missing_answer="error",
                                        rollout_columns=("completion_ids", *TRAJECTORY_COLUMNS))
    assert kept is ds and report.columns == ()
    with pytest.raises(ConfigError, match=r"'_reads_the_conversation' reads the column 'conversation', which dataset "
                                          r"\(dataset\) does not have; its columns are \['answer'\]"):
        check_reward_columns(ds, _specs(_reads_the_conversation), on_missing_answer="error")


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop


def test_on_missing_answer_in_a_run(cfg, tmp_path, caplog, monkeypatch):
    # the count is in the log before step 1, and the run samples only prompts with an answer
    import grpo_single_device

    path, n = _chat_rows(tmp_path, _some_answers_missing)
    cfg = OmegaConf.merge(OmegaConf.load("configs/tiny_grpo_chat.yaml"), {
        "output_dir": str(tmp_path / "out"), "dataset": {"data_files": path}, "eval_every_n_steps": None})
    recipe = GRPORecipe(cfg)
    with monkeypatch.context() as patch, caplog.at_level(logging.INFO), pytest.raises(_Stop):
        patch.setattr(grpo_single_device, "start_run", _stop)
        recipe.run()  # up to where it would claim output_dir
    assert len(recipe.dataset) == n - 3 and all(recipe.dataset[i]["answer"].strip() for i in range(n - 3))
    assert f"dataset: 3 of {n} prompts have no value for a column a reward needs (first: row 2" in caplog.text
    cfg.on_missing_answer = "error"
    with pytest.raises(ConfigError, match=r"config key 'on_missing_answer': 'error', and dataset .* row 2"):
        GRPORecipe(cfg).run()

