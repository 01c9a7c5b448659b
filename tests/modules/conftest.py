import pytest
import torch
from torchtune.models.qwen2._component_builders import lora_qwen2, qwen2

VOCAB = 97


def tiny_qwen2(tied: bool, lora: bool = False, seed: int = 0, family: str = "qwen2"):
    """A tiny decoder of ``family``: torchtune's Qwen2, logitless's Qwen3 (q/k norms before RoPE, a head
    width other than embed_dim / heads) or Llama 3.x (``rope_scaling: llama3``), LoRA on q/v (and the
    head when untied) with ``lora``."""
    from logitless.models import llama3_decoder, lora_llama3_decoder, lora_qwen3, qwen3

    torch.manual_seed(seed)
    dims = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                intermediate_dim=64, max_seq_len=64, tie_word_embeddings=tied)
    if family == "qwen3":
        dims["head_dim"] = 16
    elif family == "llama":
        dims["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    plain, adapted = {"qwen2": (qwen2, lora_qwen2), "qwen3": (qwen3, lora_qwen3),
                      "llama": (llama3_decoder, lora_llama3_decoder)}[family]
    if not lora:
        return plain(**dims)
    model = adapted(["q_proj", "v_proj"], apply_lora_to_mlp=False, apply_lora_to_output=not tied,
                    lora_rank=4, lora_alpha=8.0, **dims)
    with torch.no_grad():  # torchtune zero-inits lora_b; make the adapters matter
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.1)
    return model


@pytest.fixture
def make_model():
    return tiny_qwen2
