"""Prompt once per group on a GPU: the FlexAttention path against the dense-mask path (skipped
without CUDA)."""

import pytest
import torch

from logitless.losses.grpo import GRPOLoss
from logitless.models import qwen2_5_tiny
from logitless.rl.rollout.eager import generate
from logitless.rl.shared_batch import FLEX_LENGTH_MULTIPLE, shared_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_flex_path_equals_dense_mask_path():
    """Same hidden rows (and gradients) from the compiled flex path, padded to its length bucket,
    as from SDPA with the dense mask; fp32 so that only the attention kernels differ."""
    torch.manual_seed(0)
    model = qwen2_5_tiny(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                         intermediate_dim=128, max_seq_len=4096).cuda()
    GRPOLoss().set_model_output(model)
    prompts = [[4 + (i * 7 + n) % 60 for i in range(n)] for n in (37, 90)]
    with model.output_mode("logits"):
        rollout = generate(model, prompts, max_new_tokens=40, stop_tokens=[3], pad_id=0, num_generations=8,
                           temperature=1.0, generator=torch.Generator(device="cuda").manual_seed(1))
    out = {}
    for attention in ("sdpa", "flex"):
        batch = shared_batch(rollout, attention=attention)
        assert batch.packed_length() % FLEX_LENGTH_MULTIPLE  # the flex path pads this one
        model.zero_grad()
        head = batch.forward(model)
        (head.hidden.float().square().mean()).backward()
        out[attention] = (head.hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(out["flex"][0], out["sdpa"][0], rtol=2e-4, atol=2e-4)
    assert len(out["flex"][1]) == len(out["sdpa"][1]) > 0
    for got, want in zip(out["flex"][1], out["sdpa"][1]):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-5)
