"""The tiny Qwen2.5 builders and the bundled HF checkpoint."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torchtune.modules import TiedLinear, TransformerDecoder
from torchtune.training import FullModelHFCheckpointer

from logitless.datasets import TINY_CHECKPOINT_DIR
from logitless.models import TINY_QWEN2_5_CONFIG, lora_qwen2_5_tiny, qwen2_5_tiny, qwen2_5_tiny_untied, tiny_hf_config


def test_builders():
    torch.manual_seed(0)
    m = qwen2_5_tiny()
    assert isinstance(m, TransformerDecoder) and isinstance(m.output, TiedLinear)
    assert m.output.tied_module is m.tok_embeddings
    assert m(torch.randint(0, 2048, (2, 7))).shape == (2, 7, 2048)
    u = qwen2_5_tiny_untied(num_layers=1)
    assert isinstance(u.output, nn.Linear) and len(u.layers) == 1
    lo = lora_qwen2_5_tiny(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    assert any("lora_a" in k for k in lo.state_dict())
    with pytest.raises(ValueError, match="divisible"):
        qwen2_5_tiny(embed_dim=130)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        lora_qwen2_5_tiny(["q_proj"], apply_lora_to_output=True)


def test_checkpoint_loads_through_torchtune(tmp_path):
    files = list(TINY_CHECKPOINT_DIR.iterdir())
    assert sum(f.stat().st_size for f in files) < 2 * 2**20
    cfg = json.loads((TINY_CHECKPOINT_DIR / "config.json").read_text())
    assert cfg == tiny_hf_config() and cfg["vocab_size"] == TINY_QWEN2_5_CONFIG["vocab_size"]
    ckpt = FullModelHFCheckpointer(checkpoint_dir=str(TINY_CHECKPOINT_DIR), checkpoint_files=["model.safetensors"],
                                   model_type="QWEN2", output_dir=str(tmp_path))
    sd = ckpt.load_checkpoint()["model"]
    model = qwen2_5_tiny()
    model.load_state_dict(sd, strict=True)
    raw = load_file(str(TINY_CHECKPOINT_DIR / "model.safetensors"))
    assert torch.equal(model.tok_embeddings.weight.data, raw["model.embed_tokens.weight"].float())
    assert torch.equal(model.layers[1].mlp.w2.weight.data, raw["model.layers.1.mlp.down_proj.weight"].float())
    # initial logits are O(1): a sane starting loss
    with torch.no_grad():
        logits = model(torch.randint(0, 2026, (1, 32)))
    assert 0.3 < logits.std() < 5
