"""Run start and resume decisions (logitless.training.resume): who owns output_dir, which checkpoint
verifies, which config changes a resume refuses, and optimizer settings applied after loading."""

import logging
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

from logitless.models import qwen2_5_tiny
from logitless.training import CheckpointManager, ConfigError, config_summary
from logitless.training.checkpoint import MARKER, read_run_file, record_session, step_folders, verify_checkpoint
from logitless.training.distributed import Runtime
from logitless.training.resume import apply_optimizer_changes, start_run, validate_resume_config

FIXED = ("batch_size", "seed", "dataset")
RUNTIME = Runtime(torch.device("cpu"))


def _cfg(out, **over):
    cfg = OmegaConf.create({"output_dir": str(out), "resume_from_checkpoint": False, "resume_allow_changes": [],
                            "seed": 0, "batch_size": 4, "max_steps": 10, "dataset": {"_component_": "d", "split": "train"},
                            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3, "weight_decay": 0.0}})
    for k, v in over.items():
        OmegaConf.update(cfg, k.replace("__", "."), v, merge=False)
    return cfg


def _run(out, steps, run_id=None, cfg=None):
    """Saves checkpoints of ``steps`` as a run would (random-init format, config in the recipe state)."""
    mgr = CheckpointManager(None, str(out), run_id=run_id)
    sd = qwen2_5_tiny(num_layers=1).state_dict()
    for s in steps:
        mgr.save(step=s, epoch=0, model_state=sd,
                 recipe_state={"step": s, "config": config_summary(cfg if cfg is not None else _cfg(out))})
    return mgr


def test_new_run_into_a_non_empty_output_dir_is_refused(tmp_path):
    first = _run(tmp_path, [2, 4])
    (tmp_path / "logs").mkdir()
    with pytest.raises(ConfigError) as e:
        start_run(_cfg(tmp_path, batch_size=2), fixed_keys=FIXED, runtime=RUNTIME)
    msg = str(e.value)
    for part in ("config key 'output_dir'", str(tmp_path), f"run {first.run_id}", "logs", "step_000002",
                 "step_000004", "resume_from_checkpoint=auto", "another output_dir"):
        assert part in msg, (part, msg)
    # an empty folder (or none) is a new run's
    (tmp_path / "new").mkdir()
    start = start_run(_cfg(tmp_path / "new"), fixed_keys=FIXED, runtime=RUNTIME)
    assert start.checkpoint is None and read_run_file(tmp_path / "new")["run_id"] == start.run_id


def test_auto_resume_continues_the_lineage(tmp_path):
    first = _run(tmp_path, [2, 4])
    start = start_run(_cfg(tmp_path, resume_from_checkpoint="auto"), fixed_keys=FIXED, runtime=RUNTIME)
    assert start.checkpoint == tmp_path / "step_000004" and start.run_id == first.run_id
    assert start.recipe_state["step"] == 4 and start.changes == {}
    run = read_run_file(tmp_path)
    assert run["run_id"] == first.run_id and run["sessions"][-1]["resumed_from"] == str(tmp_path / "step_000004")


@pytest.mark.parametrize("name", ["model.safetensors", "recipe_state.pt"])
def test_auto_falls_back_past_a_truncated_checkpoint_and_says_why(tmp_path, caplog, name):
    _run(tmp_path, [2, 4])
    bad = tmp_path / "step_000004" / name
    size = bad.stat().st_size
    with open(bad, "r+b") as f:
        f.truncate(size - 7)
    # an explicit path to it names the file and the problem
    with pytest.raises(ConfigError, match=rf"checkpoint '{tmp_path / 'step_000004'}' does not verify: {bad}: "
                                          rf"{size - 7} bytes, the marker records {size} \(truncated\?\)"):
        start_run(_cfg(tmp_path, resume_from_checkpoint=str(tmp_path / "step_000004")), fixed_keys=FIXED,
                  runtime=RUNTIME)
    with caplog.at_level(logging.INFO):
        start = start_run(_cfg(tmp_path, resume_from_checkpoint="auto"), fixed_keys=FIXED, runtime=RUNTIME)
    assert start.checkpoint == tmp_path / "step_000002" and start.recipe_state["step"] == 2
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"Skipping checkpoint {tmp_path / 'step_000004'}: {bad}: {size - 7} bytes, the marker records {size}" in text
    assert f"Resuming from {tmp_path / 'step_000002'}" in text and "(skipped newer, not verifying: step_000004)" in text
    # the run's own damaged checkpoint is moved aside, whole, so that step 4 can be written again
    (moved,) = (tmp_path / "damaged").iterdir()
    assert not (tmp_path / "step_000004").exists() and moved.name.startswith("step_000004-")
    assert (moved / name).stat().st_size == size - 7
    assert f"Moved {tmp_path / 'step_000004'} aside to {moved}: " in text


def test_true_without_a_verifying_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="true, but .* holds no complete checkpoint"):
        start_run(_cfg(tmp_path, resume_from_checkpoint=True), fixed_keys=FIXED, runtime=RUNTIME)
    _run(tmp_path, [2])
    (tmp_path / "step_000002" / "recipe_state.pt").unlink()
    for r in (True, "auto"):
        with pytest.raises(ConfigError, match=r"no checkpoint in .* verifies: step_000002: .*recipe_state.pt: missing"):
            start_run(_cfg(tmp_path, resume_from_checkpoint=r), fixed_keys=FIXED, runtime=RUNTIME)


def test_explicit_checkpoint_into_a_new_folder_and_not_into_another_runs(tmp_path):
    first = _run(tmp_path / "a", [2, 4])
    start = start_run(_cfg(tmp_path / "b", resume_from_checkpoint=str(tmp_path / "a" / "step_000002")),
                      fixed_keys=FIXED, runtime=RUNTIME)
    assert start.checkpoint == tmp_path / "a" / "step_000002" and start.run_id == first.run_id
    _run(tmp_path / "c", [6])
    with pytest.raises(ConfigError, match="config key 'output_dir'.* is not empty"):
        start_run(_cfg(tmp_path / "c", resume_from_checkpoint=str(tmp_path / "a" / "step_000002")), fixed_keys=FIXED,
                  runtime=RUNTIME)
    with pytest.raises(ConfigError, match=r"holds checkpoints past step_000002 \(step_000004\)"):
        start_run(_cfg(tmp_path / "a", resume_from_checkpoint=str(tmp_path / "a" / "step_000002")), fixed_keys=FIXED,
                  runtime=RUNTIME)


def test_changed_keys_are_reported_refused_or_allowed(tmp_path, caplog):
    _run(tmp_path, [2])
    changed = dict(resume_from_checkpoint="auto", batch_size=8, seed=3, dataset__split="test", max_steps=20,
                   optimizer__lr=5e-4)
    with pytest.raises(ConfigError) as e:
        start_run(_cfg(tmp_path, **changed), fixed_keys=FIXED, runtime=RUNTIME)
    msg = str(e.value)
    for part in ("'batch_size': 4 -> 8", "'seed': 0 -> 3", "'dataset.split': 'train' -> 'test'",
                 "resume_allow_changes=[batch_size, dataset.split, seed]"):
        assert part in msg, (part, msg)
    assert "max_steps" not in msg and "optimizer.lr" not in msg
    with caplog.at_level(logging.INFO):
        start = start_run(_cfg(tmp_path, resume_allow_changes=["batch_size", "seed", "dataset"], **changed),
                          fixed_keys=FIXED, runtime=RUNTIME)
    assert start.changes == {"batch_size": (4, 8), "seed": (0, 3), "dataset.split": ("train", "test"),
                             "max_steps": (10, 20), "optimizer.lr": (1e-3, 5e-4)}
    blocks = [r.getMessage() for r in caplog.records if "Config changed" in r.getMessage()]
    assert len(blocks) == 1 and all(k in blocks[0] for k in start.changes), blocks


def test_resume_keys_are_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"'resume_allow_changes': 'lr' is not a key that a resume refuses; "
                                          r"expected entries among \['batch_size', 'seed', 'dataset'\]"):
        validate_resume_config(_cfg(tmp_path, resume_allow_changes=["lr"]), FIXED)
    with pytest.raises(ConfigError, match=r"'resume_from_checkpoint': '/no/such/step_000002' is not a folder"):
        validate_resume_config(_cfg(tmp_path, resume_from_checkpoint="/no/such/step_000002"), FIXED)
    validate_resume_config(_cfg(tmp_path, resume_allow_changes=["dataset.split"], resume_from_checkpoint="auto"), FIXED)


def _optim(lr, steps):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=10)
    for _ in range(steps):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    return opt, sched


def test_changed_optimizer_settings_are_applied_to_the_loaded_state(caplog):
    saved_opt, saved_sched = _optim(3e-3, steps=4)
    opt, sched = _optim(1e-3, steps=0)  # a resumed run with a new lr: the saved state restores the old one
    opt.load_state_dict(saved_opt.state_dict())
    sched.load_state_dict(saved_sched.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(saved_opt.param_groups[0]["lr"])
    with caplog.at_level(logging.INFO):
        lines = apply_optimizer_changes(opt, sched, {"optimizer.lr": (3e-3, 1e-3), "optimizer.weight_decay": (0.0, 0.1),
                                                     "max_steps": (10, 20)})
    assert lines == ["optimizer.lr: 0.003 -> 0.001 applied (param groups and LR scheduler base_lrs)",
                     "optimizer.weight_decay: 0.0 -> 0.1 applied (param groups)"]
    assert any("0.003 -> 0.001 applied" in r.getMessage() for r in caplog.records)
    # the schedule continues from step 4 as if it had always had lr 1e-3
    ref_opt, ref_sched = _optim(1e-3, steps=4)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12)
    assert opt.param_groups[0]["weight_decay"] == 0.1 and sched.base_lrs == [1e-3]
    for _ in range(3):
        sched.step()
        ref_sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12)
    with pytest.raises(ConfigError, match=r"'optimizer.momentum': changed since the checkpoint \(0.9 -> 0.5\) but "
                                          r"it is not a setting of AdamW's param groups"):
        apply_optimizer_changes(opt, sched, {"optimizer.momentum": (0.9, 0.5)})


def test_a_run_that_saved_nothing_is_restarted_by_auto_or_replaced_by_a_new_run(tmp_path, caplog):
    first = start_run(_cfg(tmp_path), fixed_keys=FIXED, runtime=RUNTIME)  # claims the folder, saves nothing
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "log_1.txt").write_text("Step 1 | loss:1.0\n")
    again = start_run(_cfg(tmp_path, resume_from_checkpoint="auto"), fixed_keys=FIXED, runtime=RUNTIME)
    assert again.run_id == first.run_id and again.checkpoint is None
    assert len(read_run_file(tmp_path)["sessions"]) == 2
    # a new run takes the folder over, saying what it replaces; the logs stay
    with caplog.at_level(logging.INFO):
        new = start_run(_cfg(tmp_path), fixed_keys=FIXED, runtime=RUNTIME)
    assert new.run_id != first.run_id and new.checkpoint is None
    run = read_run_file(tmp_path)
    assert run["run_id"] == new.run_id and len(run["sessions"]) == 1
    assert (tmp_path / "logs" / "log_1.txt").read_text() == "Step 1 | loss:1.0\n"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert (f"{tmp_path} holds run {first.run_id}, which saved no checkpoint (logitless_run.json, logs): starting a "
            f"new run in its place. Its logitless_run.json is replaced; its logs are kept.") in text
    # anything else in the folder still refuses a new run
    (tmp_path / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match=rf"is not empty: it holds files of run {new.run_id} \(logitless_run.json, "
                                          rf"logs, notes.txt\)"):
        start_run(_cfg(tmp_path), fixed_keys=FIXED, runtime=RUNTIME)
    # two new runs that both saw the folder empty: the second claim fails
    with pytest.raises(FileExistsError):
        record_session(tmp_path, "another-run", new_run=True)
    assert read_run_file(tmp_path)["run_id"] == new.run_id


def test_auto_names_every_skipped_folder_and_moves_the_runs_own_damage_aside(tmp_path, caplog):
    """The user's case: step_000008 deleted and the marker of step_000006 gone. `auto` resumed from step 4
    without a word about step 6, and the run died at step 6 ("written by another run") on every resume."""
    first = start_run(_cfg(tmp_path), fixed_keys=FIXED, runtime=RUNTIME)
    _run(tmp_path, [2, 4, 6, 8], run_id=first.run_id)
    shutil.rmtree(tmp_path / "step_000008")
    (tmp_path / "step_000006" / MARKER).unlink()
    (tmp_path / "step_000002" / MARKER).unlink()  # an older one, never completed
    with caplog.at_level(logging.INFO):
        start = start_run(_cfg(tmp_path, resume_from_checkpoint="auto"), fixed_keys=FIXED, runtime=RUNTIME)
    assert start.checkpoint == tmp_path / "step_000004" and start.run_id == first.run_id
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert (f"Skipping checkpoint {tmp_path / 'step_000006'}: {tmp_path / 'step_000006' / MARKER}: missing (the "
            f"checkpoint was not completely written)") in text
    assert "(skipped newer, not verifying: step_000006)" in text
    moved = {p.name.split("-")[0]: p for p in (tmp_path / "damaged").iterdir()}
    assert sorted(moved) == ["step_000002", "step_000006"]
    assert [p.name for p in step_folders(tmp_path)] == ["step_000004"]
    assert f"Moved {tmp_path / 'step_000006'} aside to {moved['step_000006']}: " in text
    assert "the run writes step 6 again when it gets there" in text
    assert "it is older than the step the run starts from" in text
    # the run writes step 6 again, under its own id
    CheckpointManager(None, str(tmp_path), run_id=start.run_id).save(
        step=6, epoch=0, model_state=qwen2_5_tiny(num_layers=1).state_dict(), recipe_state={"step": 6})
    assert verify_checkpoint(tmp_path / "step_000006") == []


def test_damage_of_another_run_is_left_where_it_is(tmp_path, caplog):
    _run(tmp_path, [2])
    other = _run(tmp_path, [4])
    (tmp_path / "step_000004" / "recipe_state.pt").unlink()
    with caplog.at_level(logging.INFO):
        start = start_run(_cfg(tmp_path, resume_from_checkpoint="auto"), fixed_keys=FIXED, runtime=RUNTIME)
    assert start.checkpoint == tmp_path / "step_000002" and (tmp_path / "step_000004").is_dir()
    assert not (tmp_path / "damaged").exists()
    assert (f"Leaving {tmp_path / 'step_000004'} in place: it does not verify ({tmp_path / 'step_000004'}/"
            f"recipe_state.pt: missing) but it is not this run's ({start.run_id})") in caplog.text
    assert other.run_id != start.run_id


def test_a_run_whose_only_step_folders_never_completed_restarts_with_auto(tmp_path, caplog):
    first = start_run(_cfg(tmp_path), fixed_keys=FIXED, runtime=RUNTIME)
    _run(tmp_path, [3], run_id=first.run_id)
    (tmp_path / "step_000003" / MARKER).unlink()
    with pytest.raises(ConfigError, match=r"true, but .* holds no complete checkpoint \(step_000003 never completed\)"):
        start_run(_cfg(tmp_path, resume_from_checkpoint=True), fixed_keys=FIXED, runtime=RUNTIME)
    assert (tmp_path / "step_000003").is_dir()  # a refused start moves nothing
    with caplog.at_level(logging.INFO):
        start = start_run(_cfg(tmp_path, resume_from_checkpoint="auto"), fixed_keys=FIXED, runtime=RUNTIME)
    assert start.checkpoint is None and start.run_id == first.run_id
    assert step_folders(tmp_path) == [] and len(list((tmp_path / "damaged").iterdir())) == 1
    assert f"Skipping checkpoint {tmp_path / 'step_000003'}: " in caplog.text
    assert "saved no checkpoint yet: starting it again from step 0" in caplog.text
