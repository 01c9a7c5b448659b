"""The one decoder trunk of the samplers: its last-position logits are the model's own forward's."""

import pytest
import torch

from logitless.models import qwen2_5_tiny, qwen2_5_tiny_untied
from logitless.generation.trunk import last_position_logits


@pytest.mark.parametrize("build", [qwen2_5_tiny, qwen2_5_tiny_untied], ids=["tied", "untied"])
def test_last_position_logits_equal_the_models_forward_at_the_last_position(build):
    torch.manual_seed(0)
    model = build(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32, intermediate_dim=64,
                  max_seq_len=64).double().eval()
    tokens = torch.randint(0, 64, (3, 9))
    pos = torch.arange(9).expand(3, 9)
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(3, 9, 9)
    with torch.no_grad():
        expected = model(tokens)[:, -1]  # the full [B, S, V] logits of torchtune's forward
        got = last_position_logits(model, tokens, input_pos=pos, mask=causal)
    assert got.dtype == torch.float32 and got.shape == (3, 64)
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-5)


def test_layers_compiled_for_training_run_uncompiled_when_sampling():
    """``compile: True`` compiles each layer for the update; the samplers' trunk calls them past it
    (same result), so sampling never traces prefill or per-token shapes into the update's graphs."""
    torch.manual_seed(0)
    model = qwen2_5_tiny(vocab_size=64, num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=32,
                         intermediate_dim=64, max_seq_len=64).double().eval()
    tokens = torch.randint(0, 64, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    causal = torch.ones(7, 7, dtype=torch.bool).tril().expand(2, 7, 7)
    with torch.no_grad():
        expected = last_position_logits(model, tokens, input_pos=pos, mask=causal)
    traced = []

    def counting_backend(gm, example_inputs):
        traced.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        for layer in model.layers:
            layer.compile(backend=counting_backend)
        with torch.no_grad():
            got = last_position_logits(model, tokens, input_pos=pos, mask=causal)
            assert not traced  # the trunk did not go through the compiled call
            model.layers[0](model.tok_embeddings(tokens), mask=causal, input_pos=pos)
        assert traced  # the compiled call is still what the training forward runs
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
