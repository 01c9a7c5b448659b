import pytest
import torch
from torchtune.models.qwen2._component_builders import lora_qwen2, qwen2

VOCAB = 97


def tiny_qwen2(tied: bool, lora: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    dims = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                intermediate_dim=64, max_seq_len=64, tie_word_embeddings=tied)
    if not lora:
        return qwen2(**dims)
    model = lora_qwen2(["q_proj", "v_proj"], apply_lora_to_mlp=False, apply_lora_to_output=not tied,
                       lora_rank=4, lora_alpha=8.0, **dims)
    with torch.no_grad():  # torchtune zero-inits lora_b; make the adapters matter
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.1)
    return model


@pytest.fixture
def make_model():
    return tiny_qwen2
