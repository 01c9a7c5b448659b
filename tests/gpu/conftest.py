"""Fixtures shared by the GPU tests (they skip without CUDA)."""

import pytest
import torch


def _two_layers(tie_word_embeddings):
    from torchtune.models.qwen2._component_builders import qwen2

    torch.manual_seed(1)
    with torch.device("cuda"):
        m = qwen2(vocab_size=151936, num_layers=2, num_heads=14, num_kv_heads=2, embed_dim=896,
                  intermediate_dim=4864, max_seq_len=2048, norm_eps=1e-6, rope_base=1e6,
                  tie_word_embeddings=tie_word_embeddings)
    if tie_word_embeddings:
        with torch.no_grad():
            m.tok_embeddings.weight.mul_(0.02)
    return m.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def two_layers():
    """Qwen2.5-0.5B's layer and vocabulary shapes, two layers, fp32: a short compilation."""
    return _two_layers(tie_word_embeddings=True)


@pytest.fixture(scope="module")
def two_layers_varied():
    """As ``two_layers`` with an untied random output projection: its greedy completions change token
    at every step (the tied model repeats one token per row), so stop tokens end rows at many lengths."""
    return _two_layers(tie_word_embeddings=False)
