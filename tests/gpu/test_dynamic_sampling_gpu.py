"""Dynamic sampling with the compiled sampler on a GPU (CUDA graphs, compaction): refill rounds of
other sizes than the first sample the rows the update trains on (skipped without CUDA)."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]


def test_refill_rounds_of_the_compiled_sampler_are_the_rows_the_update_trains_on(tmp_path, monkeypatch):
    import grpo_single_device as recipe_module
    from logitless.rl.update import batch_log_probs

    seen = {}
    train_batch, update = recipe_module.training_batch, recipe_module.grpo_update

    def keep_rollout(rollout, **kw):
        seen["rollout"] = rollout
        return train_batch(rollout, **kw)

    def check_then_update(model, loss_fn, optimizer, batch, advantages, **kw):
        # before the update the policy is the sampler's: its log-probs of the rows it trains on are the
        # sampler's log-probs of those tokens (rows joined from several rounds, padded and trimmed)
        loss_fn.set_model_output(model)
        logp = batch_log_probs(model, loss_fn, batch, kw["micro_batch_size"])
        rollout = seen["rollout"]
        mask = rollout.completion_mask
        diff = (logp[:, :mask.shape[1]] - rollout.sampler_log_probs)[mask].abs().max()
        seen.setdefault("diffs", []).append(float(diff))
        return update(model, loss_fn, optimizer, batch, advantages, **kw)

    monkeypatch.setattr(recipe_module, "training_batch", keep_rollout)
    monkeypatch.setattr(recipe_module, "grpo_update", check_then_update)
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "configs/tiny_grpo.yaml"), OmegaConf.from_dotlist([
        f"output_dir={tmp_path}", "device=cuda", "dtype=fp32", "generation.backend=compiled", "max_steps=4",
        "dynamic_sampling=true", "eval_every_n_steps=null", "save_final_checkpoint=False",
        "log_completions_every_n_steps=null"]))
    cfg.checkpointer.checkpoint_dir = str(ROOT / cfg.checkpointer.checkpoint_dir)
    hist = recipe_module.GRPORecipe(cfg).run()
    assert max(h["dynamic_sampling/rounds"] for h in hist) > 1  # refills ran, with rounds of other sizes
    assert {h["dynamic_sampling/sampled_groups"] for h in hist} - {44.0}
    assert len(seen["diffs"]) == 4 and max(seen["diffs"]) < 1e-3, seen["diffs"]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
