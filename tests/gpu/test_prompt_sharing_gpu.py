"""Prompt once per group on a GPU: the FlexAttention and cascade paths against the dense-mask path
(skipped without CUDA)."""

import pytest
import torch

from logitless.losses.grpo import GRPOLoss
from logitless.models import qwen2_5_tiny
from logitless.modules.cascade_attention import cascade_layout, enable_cascade_attention
from logitless.generation.eager import generate
from logitless.rl.shared_batch import FLEX_LENGTH_MULTIPLE, shared_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rollout(dtype, prompt_lengths=(37, 90)):
    torch.manual_seed(0)
    model = qwen2_5_tiny(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                         intermediate_dim=128, max_seq_len=4096).cuda().to(dtype)
    GRPOLoss().set_model_output(model)
    prompts = [[4 + (i * 7 + n) % 60 for i in range(n)] for n in prompt_lengths]
    with model.output_mode("logits"):
        rollout = generate(model, prompts, max_new_tokens=40, stop_tokens=[3], pad_id=0, num_generations=8,
                           temperature=1.0, generator=torch.Generator(device="cuda").manual_seed(1))
    return model, rollout


def _hidden_and_grads(model, rollout, attention):
    batch = shared_batch(rollout, attention=attention)
    model.zero_grad()
    head = batch.forward(model)
    (head.hidden.float().square().mean()).backward()
    return head.hidden.detach().float(), [p.grad.float() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("attention", ["flex", "cascade"])
def test_path_equals_dense_mask_path(attention):
    """Same hidden rows (and gradients) from the compiled flex path, padded to its length bucket, and
    from cascade attention (its masked path: prompts of two lengths) as from SDPA with the dense mask;
    fp32 so that only the attention kernels differ."""
    model, rollout = _rollout(torch.float32)
    assert shared_batch(rollout).packed_length() % FLEX_LENGTH_MULTIPLE  # the flex path pads this one
    got, want = _hidden_and_grads(model, rollout, attention), _hidden_and_grads(model, rollout, "sdpa")
    torch.testing.assert_close(got[0], want[0], rtol=2e-4, atol=2e-4)
    assert len(got[1]) == len(want[1]) > 0
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-5)


def test_compiled_bf16_cascade_equals_dense_mask_path():
    """Cascade attention's FlashAttention path (one prompt length: causal kernels, no mask) inside
    compiled bf16 layers, as the recipes run it, against the eager dense-mask path: the difference
    stays within bf16 rounding of the fp32 reference's."""
    model, rollout = _rollout(torch.bfloat16, prompt_lengths=(64,))
    batch = shared_batch(rollout)
    packed = batch.pack()
    enable_cascade_attention(model)
    x = model.tok_embeddings(packed.tokens)
    explained = torch._dynamo.explain(model.layers[0])(
        x, mask=cascade_layout([64], 8, batch.completions.shape[2], x.device), input_pos=packed.input_pos)
    assert explained.graph_break_count == 0, explained.break_reasons
    reference = _hidden_and_grads(model.float(), rollout, "sdpa")
    model.to(torch.bfloat16)
    dense = _hidden_and_grads(model, rollout, "sdpa")
    for layer in model.layers:
        layer.compile()
    cascade = _hidden_and_grads(model, rollout, "cascade")
    err = lambda a, b: float((a - b).abs().max())  # noqa: E731
    assert err(cascade[0], reference[0]) <= 2 * err(dense[0], reference[0]) + 1e-3
    # relative to the largest gradient: some are zero in exact arithmetic (the key bias: softmax does
    # not see a shift shared by all keys), leaving bf16 rounding noise on both paths
    scale = max(float(r.abs().max()) for r in reference[1])
    for c, d, r in zip(cascade[1], dense[1], reference[1]):
        assert err(c, r) <= 2 * err(d, r) + 1e-3 * scale
