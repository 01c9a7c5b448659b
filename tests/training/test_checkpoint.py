"""Atomic HF-format checkpoints through torchtune's checkpointer; named mismatches."""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

import logitless.training.checkpoint as ckpt_mod
from logitless.data import TINY_CHECKPOINT_DIR
from logitless.models import qwen2_5_tiny
from logitless.training import CheckpointManager, CheckpointMismatchError, complete_checkpoints, load_weights


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
