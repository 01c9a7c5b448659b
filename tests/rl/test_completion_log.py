"""The completion table: its rows, the JSONL file and what each torchtune metric logger receives."""

import json

import pytest
import torch
from torchtune.training.metric_logging import DiskLogger, StdoutLogger

from logitless.rl.advantages import group_advantages
from logitless.rl.completion_log import CompletionLogger, completion_rows, read_completions
from logitless.training.metric_logging import read_disk_log

PROMPTS = ["1+1=", "1+1=", "2+2=", "2+2="]
COMPLETIONS = ["2", "3 | x\nmore", "4", "4"]


def _rewards():
    correct = torch.tensor([1.0, 0.0, 1.0, 1.0])
    length = torch.tensor([0.1, 0.8, 0.1, 0.1])
    return {"math_correctness": correct, "length": length, "total": correct + 0.5 * length}


def test_rows_hold_each_reward_the_total_and_the_advantage():
    rewards = _rewards()
    adv = group_advantages(rewards["total"], 2)
    rows = completion_rows(7, PROMPTS, COMPLETIONS, rewards, adv)
    assert [r["completion"] for r in rows] == COMPLETIONS and {r["step"] for r in rows} == {7}
    for i, r in enumerate(rows):
        assert list(r) == ["step", "prompt", "completion", "math_correctness", "length", "reward", "advantage"]
        assert r["reward"] == pytest.approx(r["math_correctness"] + 0.5 * r["length"])
    # group 1: rewards 1.05 and 0.4 -> +-(0.65 / 2) / (std + 1e-4); group 2: equal rewards -> 0
    std = (2 * 0.325 ** 2) ** 0.5
    assert [r["advantage"] for r in rows] == pytest.approx([0.325 / (std + 1e-4), -0.325 / (std + 1e-4), 0, 0],
                                                           abs=1e-5)
    assert len(completion_rows(7, PROMPTS, COMPLETIONS, rewards, adv, num_rows=3)) == 3
    with pytest.raises(ValueError, match="3 prompts, 4 completions"):
        completion_rows(7, PROMPTS[:3], COMPLETIONS, rewards, adv)


def test_disk_logger_gets_the_table_and_its_scalars_still_parse(tmp_path):
    logger = DiskLogger(log_dir=str(tmp_path / "logs"))
    log = CompletionLogger(str(tmp_path), logger, every_n_steps=2, num_rows=3)
    assert [s for s in range(1, 7) if log.due(s)] == [2, 4, 6]
    rewards = _rewards()
    logger.log_dict({"reward/mean": 0.5}, step=2)
    rows = log.log(2, PROMPTS, COMPLETIONS, rewards, group_advantages(rewards["total"], 2))
    logger.log_dict({"reward/mean": 0.75}, step=3)
    logger.close()
    jsonl = tmp_path / "logs" / "completions.jsonl"
    assert [json.loads(line) for line in jsonl.read_text().splitlines()] == rows and len(rows) == 3
    (disk_file,) = [str(p) for p in (tmp_path / "logs").glob("log_*.txt")]
    assert read_completions(disk_file) == rows  # "|" and newlines inside a completion survive
    assert read_disk_log(disk_file) == {"reward/mean": {2: 0.5, 3: 0.75}}
    assert not CompletionLogger(str(tmp_path), logger, every_n_steps=None).due(2)
    assert not CompletionLogger(str(tmp_path), logger, every_n_steps=1, enabled=False).due(1)


def test_stdout_logger_prints_the_table(tmp_path, capsys):
    rewards = _rewards()
    CompletionLogger(str(tmp_path), StdoutLogger(), every_n_steps=1).log(
        1, PROMPTS, COMPLETIONS, rewards, group_advantages(rewards["total"], 2))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all(line.startswith("Completions step 1 | {") for line in out)
    assert json.loads(out[1].partition("|")[2])["completion"] == COMPLETIONS[1]


def test_tensorboard_logger_gets_a_text_table(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torchtune.training.metric_logging import TensorBoardLogger

    logger = TensorBoardLogger(log_dir=str(tmp_path / "tb"))
    rewards = _rewards()
    CompletionLogger(str(tmp_path), logger, every_n_steps=1).log(
        3, PROMPTS, COMPLETIONS, rewards, group_advantages(rewards["total"], 2))
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0}).Reload()
    (event,) = acc.Tensors("completions/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "| step | prompt | completion |" in text and "3 \\| x\\nmore" in text
