"""The one decoder trunk of the samplers: its last-position logits are the model's own forward's."""

import pytest
import torch

from logitless.models import qwen2_5_tiny, qwen2_5_tiny_untied
from logitless.rl.rollout.trunk import last_position_logits


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
