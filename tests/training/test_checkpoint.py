"""Atomic HF-format checkpoints through torchtune's checkpointer: checksummed markers, ownership by run id,
retention of the run's own checkpoints, final paths in the log; named mismatches."""

import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import logitless.training.checkpoint as ckpt_mod
from logitless.datasets import TINY_CHECKPOINT_DIR
from logitless.models import qwen2_5_tiny
from logitless.training import CheckpointManager, CheckpointMismatchError, complete_checkpoints, load_weights
from logitless.training.checkpoint import RUN_FILE, CheckpointSaveError, record_session, verify_checkpoint


def _cfg():
    return OmegaConf.create({
        "_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": str(TINY_CHECKPOINT_DIR),
        "checkpoint_files": ["model.safetensors"], "model_type": "QWEN2", "output_dir": "unused"})


def test_save_and_reload_round_trip(tmp_path):
    mgr = CheckpointManager(_cfg(), str(tmp_path))
    sd = mgr.load_model_state()
    model = qwen2_5_tiny()
    load_weights(model, sd)
    with torch.no_grad():
        model.norm.scale.add_(0.5)  # a change that must survive the round trip
    state = {k: v.clone() for k, v in model.state_dict().items()}
    path = mgr.save(step=3, epoch=0, recipe_state={"step": 3, "hello": "world"}, model_state=state)
    assert path == tmp_path / "step_000003" and complete_checkpoints(tmp_path) == [path]
    meta = json.loads((path / "logitless_checkpoint.json").read_text())
    assert meta["format"] == "hf" and meta["model_files"] == ["model-00001-of-00001.safetensors"]
    # HF names on disk, written by torchtune's checkpointer
    raw = load_file(str(path / "model-00001-of-00001.safetensors"))
    assert torch.equal(raw["model.norm.weight"], state["norm.scale"])
    assert (path / "config.json").is_file()
    again = CheckpointManager(_cfg(), str(tmp_path))
    sd2 = again.load_model_state(again.latest())
    for k, v in state.items():
        assert torch.equal(sd2[k], v), k
    assert CheckpointManager.load_recipe_state(path)["hello"] == "world"


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    mgr = CheckpointManager(_cfg(), str(tmp_path), keep_last_n=2)
    state = mgr.load_model_state()
    mgr.save(step=1, epoch=0, recipe_state={"step": 1}, model_state=state)

    def crash(*a, **k):
        raise KeyboardInterrupt("killed while writing recipe_state.pt")

    monkeypatch.setattr(ckpt_mod.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(step=2, epoch=0, recipe_state={"step": 2}, model_state=state)
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000001"]
    assert not (tmp_path / "step_000002").exists()
    assert any(p.name.startswith(".tmp-step_000002") for p in tmp_path.iterdir())  # the partial save
    mgr2 = CheckpointManager(_cfg(), str(tmp_path), keep_last_n=2, run_id=mgr.run_id)  # the run restarted cleans it up
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
    assert mgr2.latest().name == "step_000001"
    for s in (2, 3, 4):
        mgr2.save(step=s, epoch=0, recipe_state={"step": s}, model_state=state)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000003", "step_000004"]


def test_mismatching_checkpoint_names_the_tensor(tmp_path):
    sd = CheckpointManager(_cfg(), str(tmp_path)).load_model_state()
    with pytest.raises(CheckpointMismatchError, match=r"tensor 'tok_embeddings.weight' has shape \(2048, 128\), "
                                                      r"the model expects \(2048, 64\)"):
        load_weights(qwen2_5_tiny(embed_dim=64, num_heads=2, num_kv_heads=1), sd)
    with pytest.raises(CheckpointMismatchError, match=r"tensor 'layers.2.attn.q_proj.weight' is missing"):
        load_weights(qwen2_5_tiny(num_layers=3), sd)


def test_random_init_checkpoints_in_torchtune_format(tmp_path):
    mgr = CheckpointManager(None, str(tmp_path))
    model = qwen2_5_tiny(num_layers=1)
    path = mgr.save(step=1, epoch=0, recipe_state={}, model_state=model.state_dict())
    sd = mgr.load_model_state(path)
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v)


@pytest.mark.parametrize("hf", [True, False])
def test_weights_sharing_one_storage_save_and_reload(tmp_path, hf):
    # The compiled sampler's fused_projections="shared" leaves each layer's q/k/v (and gate/up)
    # parameters as disjoint row slices of one buffer: both checkpoint formats must write each slice.
    from logitless.generation.fused import FusedProjections

    mgr = CheckpointManager(_cfg() if hf else None, str(tmp_path))
    model = qwen2_5_tiny()
    if hf:
        load_weights(model, mgr.load_model_state())
    FusedProjections(list(model.layers), share=True)
    attn = model.layers[0].attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.add_(0.25)  # a change made through the shared storage must be saved
    path = mgr.save(step=1, epoch=0, recipe_state={}, model_state=model.state_dict())
    sd = CheckpointManager(_cfg() if hf else None, str(tmp_path)).load_model_state(path)
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k
    # saving leaves the sharing as it was
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_marker_records_size_and_sha256_of_every_file_and_extra_files(tmp_path):
    tok = tmp_path / "src_tokenizer.json"
    tok.write_text('{"vocab": {"a": 0}}')
    mgr = CheckpointManager(_cfg(), str(tmp_path / "out"))
    path = mgr.save(step=1, epoch=0, recipe_state={"step": 1}, model_state=mgr.load_model_state(),
                    extra_files={"tokenizer.json": tok})
    meta = json.loads((path / "logitless_checkpoint.json").read_text())
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"logitless_checkpoint.json"}
    assert set(meta["files"]) == on_disk and {"tokenizer.json", "recipe_state.pt", "config.json"} <= on_disk
    for name, rec in meta["files"].items():
        assert rec == {"size": (path / name).stat().st_size, "sha256": _sha256(path / name)}, name
    assert meta["run_id"] == mgr.run_id
    assert (path / "tokenizer.json").read_text() == tok.read_text()
    assert verify_checkpoint(path) == []


def test_retention_counts_and_deletes_only_this_runs_checkpoints(tmp_path):
    """The user's case: a first run left step 100 and 125; a second run with keep_last_n=2 must keep them."""
    sd = qwen2_5_tiny(num_layers=1).state_dict()
    first = CheckpointManager(None, str(tmp_path), keep_last_n=2)
    for s in (100, 125):
        first.save(step=s, epoch=0, recipe_state={}, model_state=sd)
    second = CheckpointManager(None, str(tmp_path), keep_last_n=2)
    for s in (50, 62, 75):
        second.save(step=s, epoch=0, recipe_state={}, model_state=sd)
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert names == ["step_000062", "step_000075", "step_000100", "step_000125"]
    assert second.run_id != first.run_id
    assert [p.name for p in second.own_checkpoints()] == ["step_000062", "step_000075"]


def test_save_never_replaces_a_folder_of_another_run(tmp_path):
    sd = qwen2_5_tiny(num_layers=1).state_dict()
    first = CheckpointManager(None, str(tmp_path))
    path = first.save(step=2, epoch=0, recipe_state={"who": "first"}, model_state=sd)
    before = {p.name: _sha256(p) for p in path.iterdir()}
    with pytest.raises(FileExistsError, match=rf"step_000002 was written by run {first.run_id}"):
        CheckpointManager(None, str(tmp_path)).save(step=2, epoch=0, recipe_state={"who": "second"}, model_state=sd)
    assert {p.name: _sha256(p) for p in path.iterdir()} == before
    # the same run may replace its own checkpoint (a resume redoing a step)
    CheckpointManager(None, str(tmp_path), run_id=first.run_id).save(step=2, epoch=0, recipe_state={"who": "again"},
                                                                     model_state=sd)
    assert CheckpointManager.load_recipe_state(path)["who"] == "again"


def test_save_logs_the_final_folder_never_the_temporary_one(tmp_path, caplog):
    mgr = CheckpointManager(_cfg(), str(tmp_path))
    sd = mgr.load_model_state()
    with caplog.at_level(logging.DEBUG):
        path = mgr.save(step=3, epoch=0, recipe_state={}, model_state=sd)
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert ".tmp" not in text and "epoch_0" not in text, text
        final = mgr.log_final(3)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"Saved checkpoint of step 3 to {path}" in text
    assert final == path and text.count("Final model") == 1 and f"Final model (step 3): {path}" in text


@pytest.mark.parametrize("name", ["model-00001-of-00001.safetensors", "recipe_state.pt"])
def test_verify_names_a_truncated_file(tmp_path, name):
    mgr = CheckpointManager(_cfg(), str(tmp_path))
    path = mgr.save(step=1, epoch=0, recipe_state={"x": torch.zeros(1000)}, model_state=mgr.load_model_state())
    full = (path / name).stat().st_size
    with open(path / name, "r+b") as f:
        f.truncate(full // 2)
    assert verify_checkpoint(path) == [f"{path / name}: {full // 2} bytes, the marker records {full} (truncated?)"]
    # the size restored, the second half zeros: the checksum catches it
    with open(path / name, "r+b") as f:
        f.truncate(full)
    assert verify_checkpoint(path) == [f"{path / name}: sha256 differs from the one the marker records "
                                       f"(the file was modified or damaged)"]


def _partial_write_then(error):
    """A stand-in for torch.save that writes part of the file, then fails as the real one does."""
    def save(obj, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise error
    return save


@pytest.mark.parametrize("error, cause", [
    # torch.save on a full disk: its writer's message, no errno
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1065344 vs 1065232"),
     "no space left on device"),
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "no space left on device"),
    (OSError(errno.EIO, os.strerror(errno.EIO)), f"{os.strerror(errno.EIO)} (errno {errno.EIO}, EIO)"),
])
def test_a_save_that_fails_for_space_names_it_and_leaves_nothing_partial(tmp_path, monkeypatch, error, cause):
    sd = qwen2_5_tiny(num_layers=1).state_dict()
    mgr = CheckpointManager(None, str(tmp_path))
    first = mgr.save(step=1, epoch=0, recipe_state={"step": 1}, model_state=sd)
    before = {p.name: _sha256(p) for p in first.iterdir()}
    needed = sum(v.numel() * v.element_size() for v in sd.values()) + 4 * 1000
    free = 3 << 19  # 1.5 MiB, less than the checkpoint needs
    monkeypatch.setattr(ckpt_mod.torch, "save", _partial_write_then(error))
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 * needed, 9 * needed, free))
    with pytest.raises(CheckpointSaveError) as e:
        mgr.save(step=2, epoch=0, recipe_state={"step": 2, "moments": torch.zeros(1000)}, model_state=sd)
    msg = str(e.value)
    assert msg.startswith(f"could not write checkpoint step_000002 to {tmp_path}: {cause} ({type(error).__name__}: "), msg
    assert f"It needs about {needed / 2**20:.1f} MiB; 1.5 MiB was free on that file system" in msg
    assert f"the earlier checkpoints are kept (newest: {first})" in msg
    # no staging folder, no temporary file; the previous checkpoint untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
    assert {p.name: _sha256(p) for p in first.iterdir()} == before and verify_checkpoint(first) == []


def test_a_failure_that_is_not_a_write_error_keeps_its_exception(tmp_path, monkeypatch):
    mgr = CheckpointManager(None, str(tmp_path))
    monkeypatch.setattr(ckpt_mod.torch, "save", _partial_write_then(TypeError("cannot pickle 'generator' object")))
    with pytest.raises(TypeError, match="cannot pickle"):
        mgr.save(step=1, epoch=0, recipe_state={}, model_state=qwen2_5_tiny(num_layers=1).state_dict())
    assert list(tmp_path.iterdir()) == []  # its partial save removed all the same


def test_the_run_file_write_failing_leaves_no_temporary_file(tmp_path, monkeypatch):
    real = pathlib.Path.write_text

    def write_text(self, text, *a, **k):
        real(self, text[:10])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    with pytest.raises(CheckpointSaveError, match=rf"could not write the run file {tmp_path / RUN_FILE} to {tmp_path}: "
                                                  rf"no space left on device"):
        record_session(tmp_path, "run-1")
    assert list(tmp_path.iterdir()) == []


def test_on_save_error_stop_raises_continue_logs_and_a_failed_last_save_ends_the_run_with_it(tmp_path, caplog):
    error = CheckpointSaveError("could not write checkpoint step_000002 to out: no space left on device (...).")
    with pytest.raises(CheckpointSaveError, match=r"no space left on device \(...\). The run stops here "
                                                  r"\(on_save_error=stop\)"):
        CheckpointManager(None, str(tmp_path)).record_save_outcome(error)
    mgr = CheckpointManager(None, str(tmp_path), on_save_error="continue")
    with caplog.at_level(logging.WARNING):
        mgr.record_save_outcome(error)
    assert "Training goes on (on_save_error=continue): the next save tries again." in caplog.text
    mgr.record_save_outcome(None)  # the next save worked
    assert mgr.log_final(3) is None
    mgr.record_save_outcome(error)
    with pytest.raises(CheckpointSaveError, match=r"The run ended at step 4, but its last save failed, so the steps "
                                                  r"since its newest checkpoint \(none\) are not saved: could not"):
        mgr.log_final(4)
    with pytest.raises(ValueError, match=r"on_save_error must be one of \['stop', 'continue'\], got 'retry'"):
        CheckpointManager(None, str(tmp_path), on_save_error="retry")


def test_a_kill_during_retention_leaves_no_step_folder_without_its_marker(tmp_path, monkeypatch):
    """rmtree removes files in directory order: a kill in the middle left a step_* folder without a
    marker (but with 9 MB of files) that nothing cleaned."""
    sd = qwen2_5_tiny(num_layers=1).state_dict()
    mgr = CheckpointManager(None, str(tmp_path), keep_last_n=1)
    mgr.save(step=1, epoch=0, recipe_state={}, model_state=sd)
    real_rmtree = shutil.rmtree

    def killed_midway(path, *a, **k):
        marker = pathlib.Path(path) / "logitless_checkpoint.json"
        if not marker.exists():  # a staging folder: not what this test kills
            return real_rmtree(path, *a, **k)
        marker.unlink()
        raise KeyboardInterrupt("killed during retention")

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(step=2, epoch=0, recipe_state={}, model_state=sd)
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", real_rmtree)
    steps = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert steps == ["step_000002"] and verify_checkpoint(tmp_path / "step_000002") == []
    CheckpointManager(None, str(tmp_path), keep_last_n=1, run_id=mgr.run_id)  # the run restarted: removes the rest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]


def test_a_save_moves_an_incomplete_folder_of_its_own_run_aside(tmp_path, caplog):
    sd = qwen2_5_tiny(num_layers=1).state_dict()
    mgr = CheckpointManager(None, str(tmp_path))
    record_session(tmp_path, mgr.run_id, new_run=True)
    path = mgr.save(step=2, epoch=0, recipe_state={"who": "first"}, model_state=sd)
    (path / "logitless_checkpoint.json").unlink()
    with caplog.at_level(logging.INFO):
        mgr.save(step=2, epoch=0, recipe_state={"who": "again"}, model_state=sd)
    assert verify_checkpoint(path) == [] and CheckpointManager.load_recipe_state(path)["who"] == "again"
    (moved,) = (tmp_path / "damaged").iterdir()
    assert CheckpointManager.load_recipe_state(moved)["who"] == "first"
    assert f"Moved {path} aside to {moved}: {path / 'logitless_checkpoint.json'} is missing or unreadable" in caplog.text
    # in a folder of another run (its run file), an incomplete folder is not this run's: left alone
    other = CheckpointManager(None, str(tmp_path))
    (path / "logitless_checkpoint.json").unlink()
    with pytest.raises(FileExistsError, match=r"step_000002 was written by another run \(it has no completion marker\)"):
        other.save(step=2, epoch=0, recipe_state={}, model_state=sd)
