"""torchtune's activation offloading in the SFT recipes: the config key and its checks, and the
context entered around the model's forward only (the loss's own saved tensors stay where they are),
as torchtune's full_finetune_single_device enters it."""

import pathlib

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.data import padded_collate_sft

from logitless.datasets import tiny_alpaca_dataset, tiny_qwen2_5_tokenizer
from logitless.losses import LinearCrossEntropyLoss
from logitless.models import qwen2_5_tiny
from logitless.training import ConfigError, SFTObjective
from logitless.training.sft_config import validate_sft_config

REPO = pathlib.Path(__file__).resolve().parents[2]


def tiny_full(**overrides):
    cfg = OmegaConf.load(REPO / "configs/tiny_full.yaml")
    for k, v in overrides.items():
        cfg[k] = v
    return cfg


def test_offloading_needs_checkpointing_and_cuda():
    with pytest.raises(ConfigError, match="'enable_activation_offloading': True needs enable_activation_checkpointing"):
        validate_sft_config(tiny_full(enable_activation_offloading=True, device="cuda"))
    with pytest.raises(ConfigError, match="'enable_activation_offloading': True needs a CUDA device, got device 'cpu'"):
        validate_sft_config(tiny_full(enable_activation_offloading=True, enable_activation_checkpointing=True))
    validate_sft_config(tiny_full(enable_activation_offloading=True, enable_activation_checkpointing=True,
                                  device="cuda"))  # accepted (the device itself is checked by the recipe)
    assert validate_sft_config(tiny_full()).enable_activation_offloading is False


class CountSaved(torch.autograd.graph.saved_tensors_hooks):
    """Counts the tensors autograd saves while entered (the hook offloading uses)."""

    def __init__(self):
        self.count = 0
        super().__init__(self.pack, lambda t: t)

    def pack(self, t):
        self.count += 1
        return t


def test_the_context_covers_the_model_forward_and_not_the_loss():
    torch.manual_seed(0)
    batch = padded_collate_sft([tiny_alpaca_dataset(tiny_qwen2_5_tokenizer())[i] for i in range(2)])
    model = qwen2_5_tiny()
    inside = CountSaved()
    objective = SFTObjective(model, LinearCrossEntropyLoss(impl="chunked"), activations=inside)
    outside = CountSaved()  # sees what is saved while the objective's own context is not entered
    with outside:
        objective(batch, objective.units(batch)).loss.backward()
    alone = CountSaved()  # the wrapped model's forward by itself
    with alone:
        model(batch["tokens"])
    assert inside.count == alone.count > 0
    assert outside.count > 0  # the loss saved tensors of its own, outside the context
