"""Every checkpoint records the size and sha256 of each local data file; a resume onto changed data is
refused unless resume_allow_changes names data_fingerprint (it used to be accepted without notice:
step-5 loss 5.65 instead of 4.65 after the data file changed between a kill and its resume)."""

import hashlib
import logging

import pytest
import torch
from omegaconf import OmegaConf

from logitless.training import CheckpointManager, ConfigError, config_summary
from logitless.training.distributed import Runtime
from logitless.training.nonfinite import NonFiniteGuard
from logitless.training.resume import start_run
from logitless.training.run_state import training_state
from logitless.training.sft_config import SFT_FIXED_ON_RESUME

RUNTIME = Runtime(torch.device("cpu"))


def _cfg(out, data, **over):
    cfg = OmegaConf.create({
        "output_dir": str(out), "resume_from_checkpoint": False, "resume_allow_changes": [], "seed": 0,
        "batch_size": 2, "max_steps": 4,
        "dataset": {"_component_": "logitless.datasets.alpaca_dataset", "source": "json", "data_files": str(data)},
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}})
    for k, v in over.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def _save(cfg):
    """A checkpoint whose recipe state is what the recipes save (training_state), model weights of a Linear."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = training_state(RUNTIME, model, optimizer, None, NonFiniteGuard(3), seed=0, cfg=cfg)
    CheckpointManager(None, cfg.output_dir).save(step=2, epoch=0, model_state=model.state_dict(),
                                                  recipe_state={"step": 2, **state})
    return state


def test_a_checkpoint_records_the_size_and_sha256_of_each_data_file(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"instruction": "a", "output": "b"}\n')
    state = _save(_cfg(tmp_path / "out", data))
    want = f"{data.stat().st_size} bytes, sha256 {hashlib.sha256(data.read_bytes()).hexdigest()}"
    assert state["config"]["data_fingerprint"] == {"dataset": {str(data): want}}


def test_a_resume_onto_changed_data_is_refused_unless_allowed(tmp_path, caplog):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    out = tmp_path / "out"
    _save(_cfg(out, data))
    before = f"{data.stat().st_size} bytes, sha256 {hashlib.sha256(data.read_bytes()).hexdigest()}"
    resume = dict(resume_from_checkpoint="auto")
    assert start_run(_cfg(out, data, **resume), fixed_keys=SFT_FIXED_ON_RESUME, runtime=RUNTIME).changes == {}
    data.write_text('{"instruction": "a", "output": "c"}\n')  # same size, other bytes
    after = f"{data.stat().st_size} bytes, sha256 {hashlib.sha256(data.read_bytes()).hexdigest()}"
    key = f"data_fingerprint.dataset.{data}"
    with pytest.raises(ConfigError, match=r"config keys changed since the checkpoint, which breaks exact resume: "
                                          rf"'{key}': '{before}' -> '{after}'.*"
                                          r"resume_allow_changes=\[data_fingerprint.dataset"):
        start_run(_cfg(out, data, **resume), fixed_keys=SFT_FIXED_ON_RESUME, runtime=RUNTIME)
    with caplog.at_level(logging.INFO):
        start = start_run(_cfg(out, data, **resume, resume_allow_changes=["data_fingerprint"]),
                          fixed_keys=SFT_FIXED_ON_RESUME, runtime=RUNTIME)
    assert start.changes == {key: (before, after)}
    assert f"{key}: {before!r} -> {after!r}  (allowed by resume_allow_changes)" in caplog.text


def test_a_checkpoint_without_fingerprints_resumes_as_before(tmp_path):
    # written before fingerprints were recorded: compared without them
    data = tmp_path / "rows.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    cfg = _cfg(tmp_path / "out", data)
    CheckpointManager(None, cfg.output_dir).save(step=2, epoch=0, model_state=torch.nn.Linear(2, 2).state_dict(),
                                                  recipe_state={"step": 2, "config": config_summary(cfg)})
    cfg.resume_from_checkpoint = "auto"
    assert start_run(cfg, fixed_keys=SFT_FIXED_ON_RESUME, runtime=RUNTIME).changes == {}


def test_a_changed_eval_file_is_reported_not_refused(tmp_path):
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("{}\n")
    evals.write_text("{}\n")
    out = tmp_path / "out"
    cfg = _cfg(out, train, eval_dataset={"_component_": "x", "source": "json", "data_files": [str(evals)]})
    _save(cfg)
    evals.write_text('{"a": 1}\n')
    cfg.resume_from_checkpoint = "auto"
    start = start_run(cfg, fixed_keys=SFT_FIXED_ON_RESUME, runtime=RUNTIME)
    assert list(start.changes) == [f"data_fingerprint.eval_dataset.{evals}"]


def test_files_folders_and_globs_a_data_component_reads(tmp_path):
    from logitless.training.data_fingerprint import data_files_of

    for name in ("a.jsonl", "b.jsonl", "c.csv", "sub/d.jsonl"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    node = OmegaConf.create({"_component_": "x", "source": "json",
                             "data_files": {"train": str(tmp_path / "*.jsonl"), "test": [str(tmp_path / "c.csv")]}})
    assert data_files_of(node) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), str(tmp_path / "c.csv")]
    assert data_files_of(OmegaConf.create({"_component_": "x", "source": str(tmp_path / "sub")})) == [
        str(tmp_path / "sub" / "d.jsonl")]
    # a hub id and the bundled data name no local file
    assert data_files_of(OmegaConf.create({"_component_": "x", "source": "openai/gsm8k"})) == []
    assert data_files_of(OmegaConf.create({"_component_": "logitless.datasets.tiny_alpaca_dataset"})) == []


def test_a_large_file_is_fingerprinted_by_its_size_and_both_ends(tmp_path, monkeypatch):
    from logitless.training import data_fingerprint as fp

    monkeypatch.setattr(fp, "FULL_HASH_MAX_BYTES", 64)
    monkeypatch.setattr(fp, "SAMPLE_BYTES", 16)
    fp._fingerprint.cache_clear()
    data = bytes(range(100))
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    want = hashlib.sha256(data[:16] + data[-16:]).hexdigest()
    assert fp.file_fingerprint(str(path)) == f"100 bytes, sha256 of the first and last 16 bytes {want}"
    path.write_bytes(data[:99] + b"\xff")  # the last byte changed: a new fingerprint
    assert fp.file_fingerprint(str(path)).endswith(hashlib.sha256(data[:16] + data[-16:-1] + b"\xff").hexdigest())
    fp._fingerprint.cache_clear()
