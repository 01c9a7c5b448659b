"""enable_activation_offloading in full_sft_single_device on a GPU: the same losses as without it."""

import pathlib

import pytest
import torch
from omegaconf import OmegaConf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_offloading_trains_like_checkpointing_alone(tmp_path):
    from full_sft_single_device import SFTRecipe

    losses = {}
    for offload in (False, True):
        cfg = OmegaConf.load(REPO / "configs/tiny_full.yaml")
        cfg.output_dir = str(tmp_path / str(offload))
        cfg.device, cfg.enable_activation_checkpointing, cfg.enable_activation_offloading = "cuda", True, offload
        cfg.max_steps, cfg.save_every_n_steps, cfg.save_final_checkpoint = 4, None, False
        losses[offload] = SFTRecipe(cfg).run()
    assert len(losses[True]) == 4
    # the offloaded tensors come back as they were: the same arithmetic
    assert losses[True] == pytest.approx(losses[False], rel=1e-6, abs=1e-6)
