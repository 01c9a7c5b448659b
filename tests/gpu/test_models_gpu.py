"""The compiled sampler on a GPU with Qwen3 (q/k norms before RoPE inside the captured decode step) and
Llama 3.2 (scaled RoPE pairs in the rotary kernel) at their real shapes, random fp32 weights, against
the eager reference sampler (skipped without CUDA)."""

import pytest
import torch

from logitless.generation import CompiledSampler
from logitless.generation.eager import generate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[(7 * i + 3 * p) % 5000 + 10 for i in range(200 + 50 * p)] for p in range(4)]


def _model(name):
    from logitless.models import build_named

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_named(name)  # fp32: the two samplers' kernels differ, their rounding barely
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.02)
        for layer in model.layers:  # trained-like q/k norm scales: their place relative to RoPE matters
            for norm in (layer.attn.q_norm, layer.attn.k_norm):
                if norm is not None:
                    norm.scale.normal_(1.0, 0.3)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("name", ["qwen3_0_6b", "llama3_2_1b"])
def test_greedy_compiled_equals_eager_token_for_token(name):
    from logitless.generation import decode_step

    model = _model(name)
    free = generate(model, PROMPTS, max_new_tokens=48, stop_tokens=[-1], pad_id=0, num_generations=4, temperature=0)
    stops = sorted({int(free.completion_tokens[4 * p, 8 + 10 * p]) for p in range(4)})
    kw = dict(max_new_tokens=48, stop_tokens=stops, pad_id=0, num_generations=4, temperature=0)
    ref = generate(model, PROMPTS, **kw)
    assert all(decode_step.groupable(layer) for layer in model.layers)  # the grouped (captured) step runs
    out = CompiledSampler(min_bucket=2, sync_every=4, fused_projections="shared")(model, PROMPTS, **kw)
    assert torch.equal(out.completion_mask, ref.completion_mask)
    assert torch.equal(out.completion_tokens, ref.completion_tokens)
    torch.testing.assert_close(out.sampler_log_probs, ref.sampler_log_probs, atol=2e-3, rtol=0)
