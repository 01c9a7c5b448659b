"""The compiled sampler on a GPU at Qwen2.5-0.5B's shapes (CUDA graphs, compaction, attention windows,
in-graph draws) against the eager reference sampler (skipped without CUDA)."""

import pytest
import torch

from logitless.generation import CompiledSampler, prompt_generators
from logitless.generation.eager import generate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model():
    from torchtune.models.qwen2_5 import qwen2_5_0_5b

    torch.manual_seed(0)
    with torch.device("cuda"):
        m = qwen2_5_0_5b()  # fp32: the two samplers' kernels differ, their rounding barely
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(0.02)
    return m.eval().requires_grad_(False)


PROMPTS = [[(7 * i + 3 * p) % 5000 + 10 for i in range(200 + 50 * p)] for p in range(4)]


@pytest.mark.parametrize("fused", [False, "shared"])
def test_greedy_compiled_equals_eager_token_for_token(model, fused):
    # stop tokens that end rows at different steps, so compaction and several windows run
    free = generate(model, PROMPTS, max_new_tokens=48, stop_tokens=[-1], pad_id=0, num_generations=4,
                    temperature=0)
    stops = sorted({int(free.completion_tokens[4 * p, 8 + 10 * p]) for p in range(4)})
    kw = dict(max_new_tokens=48, stop_tokens=stops, pad_id=0, num_generations=4, temperature=0)
    ref = generate(model, PROMPTS, **kw)
    sampler = CompiledSampler(min_bucket=2, sync_every=4, attention_window=16, fused_projections=fused)
    out = sampler(model, PROMPTS, **kw)
    assert torch.equal(out.completion_mask, ref.completion_mask)
    assert torch.equal(out.completion_tokens, ref.completion_tokens)
    torch.testing.assert_close(out.sampler_log_probs, ref.sampler_log_probs, atol=2e-3, rtol=0)


def test_counter_draws_are_reproducible_and_per_prompt(two_layers):
    model = two_layers
    kw = dict(max_new_tokens=32, stop_tokens=list(range(100, 151936, 40)), pad_id=0, num_generations=4,
              temperature=1.0)
    sampler = CompiledSampler(min_bucket=2, sync_every=4, attention_window=16)
    a = sampler(model, PROMPTS, generator=prompt_generators(1, 2, range(4)), **kw)
    b = sampler(model, PROMPTS, generator=prompt_generators(1, 2, range(4)), **kw)
    assert torch.equal(a.completion_tokens, b.completion_tokens)
    assert a.completion_lengths.min() < a.completion_lengths.max()
    # the first token of every row depends on its prompt's stream only (no batch-size rounding yet)
    alone = CompiledSampler(compile=False)(model, PROMPTS[1:2], generator=prompt_generators(1, 2, [1]), **kw)
    assert torch.equal(alone.completion_tokens[:, 0], a.completion_tokens[4:8, 0])
