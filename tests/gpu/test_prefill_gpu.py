"""Chunked prefill on a GPU at Qwen2.5-0.5B's layer shapes: the same logits and greedy tokens as one
forward, and a smaller peak (skipped without CUDA)."""

import pytest
import torch

from logitless.generation import CompiledSampler
from logitless.generation.prefill import prefill
from logitless.generation.result import left_pad

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HEADS, KV_HEADS, HIDDEN, INTER = 14, 2, 896, 4864
WIDTH = 8192
PROMPTS = [[(7 * i + 3 * p) % 5000 + 10 for i in range(WIDTH - 1500 * p)] for p in range(2)]  # padding 0 / 1500


@pytest.fixture(scope="module")
def model():
    from torchtune.models.qwen2._component_builders import qwen2

    torch.manual_seed(0)
    with torch.device("cuda"):  # fp32: the chunked and one-forward kernels differ, their rounding barely
        m = qwen2(vocab_size=151936, num_layers=2, num_heads=HEADS, num_kv_heads=KV_HEADS, embed_dim=HIDDEN,
                  intermediate_dim=INTER, max_seq_len=WIDTH + 64, norm_eps=1e-6, rope_base=1e6,
                  tie_word_embeddings=True)
    with torch.no_grad():
        m.tok_embeddings.weight.mul_(0.02)
    return m.eval().requires_grad_(False)


def prefill_with_peak(model, chunk_tokens):
    """Last-position logits and the peak bytes allocated above the weights and the prompt cache."""
    from torchtune.modules.common_utils import local_kv_cache

    tokens, prompt_mask = left_pad(PROMPTS, 0, torch.device("cuda"))
    positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad(), local_kv_cache(model, batch_size=len(PROMPTS), device=torch.device("cuda"),
                                         dtype=torch.float32, decoder_max_seq_len=WIDTH):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logits = prefill(model, tokens, input_pos=positions, prompt_mask=prompt_mask, chunk_tokens=chunk_tokens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    return logits, peak


def test_chunked_prefill_same_logits_smaller_peak(model):
    rows, chunk_tokens, head_dim = len(PROMPTS), 1024, HIDDEN // HEADS
    whole, whole_peak = prefill_with_peak(model, None)
    chunked, chunked_peak = prefill_with_peak(model, chunk_tokens)
    torch.testing.assert_close(chunked, whole, atol=2e-3, rtol=0)
    columns = chunk_tokens // rows
    # what one chunked forward may hold at once (fp32): the mask and an additive copy of it over the
    # cache, torchtune's K and V copied per query head, the MLP's three intermediates, a few hidden
    # states, the head's fp32 logits of the last position
    bound = (rows * columns * WIDTH * (1 + 4) + 2 * rows * HEADS * WIDTH * head_dim * 4
             + 3 * rows * columns * INTER * 4 + 4 * rows * columns * HIDDEN * 4 + rows * 151936 * 4)
    assert chunked_peak <= bound
    assert whole_peak >= rows * WIDTH * WIDTH  # one forward holds at least its (rows, W, W) bool mask
    # torchtune's per-query-head K/V copy (117 MiB here) is the same in both: the rest shrinks
    assert chunked_peak * 2 < whole_peak


def test_greedy_tokens_equal_with_and_without_chunking(model):
    kw = dict(max_new_tokens=8, stop_tokens=[-1], pad_id=0, num_generations=4, temperature=0)
    whole = CompiledSampler(prefill_chunk_tokens=None, keep_cache=False)(model, PROMPTS, **kw)
    chunked = CompiledSampler(prefill_chunk_tokens=2048, keep_cache=False)(model, PROMPTS, **kw)
    assert torch.equal(chunked.completion_tokens, whole.completion_tokens)
    torch.testing.assert_close(chunked.sampler_log_probs, whole.sampler_log_probs, atol=2e-3, rtol=0)
