"""Chunked prompt prefill: the same logits and KV cache as one forward (float64), the same greedy
rollouts in both samplers, the group's prompt prefilled once, a per-forward memory bound, checked options."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torchtune.models.qwen2._component_builders import qwen2
from torchtune.modules.common_utils import local_kv_cache

from logitless.generation import CompiledSampler, SamplerConfig, build_sampler
from logitless.generation.eager import generate as eager_generate
from logitless.generation.prefill import causal_key_mask, prefill, prefill_chunk_columns
from logitless.generation.result import left_pad
from logitless.generation.trunk import last_position_logits

VOCAB = 97
NEVER = [-1]  # a stop id no sampler can produce
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [3, 4], [20, 21, 22, 23, 24, 25]]  # width 11, padding 0/9/5


def tiny(tied=True, kv_heads=2, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = qwen2(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=kv_heads, embed_dim=32,
                  intermediate_dim=64, max_seq_len=4096, tie_word_embeddings=tied)
    with torch.no_grad():  # spread-out distributions (nn.Embedding's N(0, 1) makes a tied head repeat)
        model.tok_embeddings.weight.mul_(0.1)
    return model.to(dtype).eval()


def run_prefill(model, prompts, chunk_tokens, extra_columns=0):
    """Prefill through torchtune's own caches (length = width + ``extra_columns``, as the eager
    sampler's); returns the logits, each layer's (k, v) cache copy and its write position.
    ``chunk_tokens="torchtune"``: one forward writing through torchtune's ``KVCache.update`` and
    attending over the whole cache, as the samplers prefilled before chunking (the reference)."""
    tokens, prompt_mask = left_pad(prompts, 0)
    rows, width = tokens.shape
    positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad(), local_kv_cache(model, batch_size=rows, device=torch.device("cpu"),
                                         dtype=next(model.parameters()).dtype,
                                         decoder_max_seq_len=width + extra_columns):
        if chunk_tokens == "torchtune":
            key_valid = torch.cat([prompt_mask, torch.ones(rows, extra_columns, dtype=torch.bool)], 1)
            logits = last_position_logits(model, tokens, input_pos=positions,
                                          mask=causal_key_mask(key_valid, 0, width))
        else:
            logits = prefill(model, tokens, input_pos=positions, prompt_mask=prompt_mask, chunk_tokens=chunk_tokens)
        caches = [(layer.attn.kv_cache.k_cache.clone(), layer.attn.kv_cache.v_cache.clone(),
                   int(layer.attn.kv_cache.cache_pos[0])) for layer in model.layers]
    return logits, caches


@pytest.mark.parametrize("tied,kv_heads", [(True, 1), (False, 2), (True, 4)])  # 4, 2, 1 query heads per K/V head
@pytest.mark.parametrize("extra_columns", [0, 3])  # cache as long as the prompt (compiled), or longer (eager)
def test_chunked_prefill_equals_one_forward_in_float64(tied, kv_heads, extra_columns):
    model = tiny(tied=tied, kv_heads=kv_heads)
    rows, width = len(PROMPTS), max(map(len, PROMPTS))
    one_logits, one_caches = run_prefill(model, PROMPTS, "torchtune", extra_columns)
    # the independent oracle: torchtune's own forward of each unpadded prompt, no cache
    with torch.no_grad():
        expected = torch.stack([model(torch.tensor([p]))[0, -1] for p in PROMPTS]).float()
    torch.testing.assert_close(one_logits, expected, rtol=1e-6, atol=1e-6)
    # columns per forward: 1, 3, 4 (does not divide 11), 11 and more (one chunk); fewer tokens than rows: 1
    for chunk_tokens, columns in [(rows, 1), (3 * rows, 3), (4 * rows, 4), (width * rows, width),
                                  (10 * width * rows, width), (1, 1), (None, width)]:
        assert prefill_chunk_columns(rows, width, chunk_tokens) == columns
        logits, caches = run_prefill(model, PROMPTS, chunk_tokens, extra_columns)
        torch.testing.assert_close(logits, one_logits, rtol=1e-12, atol=1e-12)
        for (k, v, pos), (k1, v1, pos1) in zip(caches, one_caches):
            assert pos == pos1 == width  # consecutive chunks advanced torchtune's write position to the width
            torch.testing.assert_close(k[:, :, :width], k1[:, :, :width], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(v[:, :, :width], v1[:, :, :width], rtol=1e-12, atol=1e-12)
            assert not k[:, :, width:].any() and not v[:, :, width:].any()  # nothing written past the prompt


def test_causal_key_mask_hides_padding_and_later_columns():
    key_valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, False]])
    got = causal_key_mask(key_valid, 1, 4)
    for b in range(2):
        for i, q in enumerate(range(1, 4)):
            want = [(j <= q and bool(key_valid[b, j])) or j == q for j in range(5)]
            assert got[b, i].tolist() == want


def shapes_through_embedding(model):
    """Records the (rows, columns) of every forward (prefill chunks and decode steps)."""
    seen = []
    model.tok_embeddings.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    return seen


def completions(rollout):
    return [t[m].tolist() for t, m in zip(rollout.completion_tokens, rollout.completion_mask)]


def test_greedy_rollouts_unchanged_by_chunking_and_group_prefilled_once():
    model = tiny(dtype=torch.float32)
    kw = dict(max_new_tokens=6, stop_tokens=NEVER, pad_id=0, num_generations=4, temperature=0)
    seen = shapes_through_embedding(model)  # an embedding hook leaves the layers on the grouped path
    whole = CompiledSampler(compile=False, prefill_chunk_tokens=None)(model, PROMPTS, **kw)
    assert seen[0] == (3, 11) and seen[1:] == [(12, 1)] * 5  # one prefill forward of the 3 prompts, not 12 rows
    seen.clear()
    chunked = CompiledSampler(compile=False, prefill_chunk_tokens=12)(model, PROMPTS, **kw)
    # 12 tokens over 3 distinct prompts: 4 columns per forward (11 = 4 + 4 + 3), then decode over 12 rows
    assert seen == [(3, 4), (3, 4), (3, 3)] + [(12, 1)] * 5
    assert torch.equal(chunked.completion_tokens, whole.completion_tokens)
    torch.testing.assert_close(chunked.sampler_log_probs, whole.sampler_log_probs, atol=1e-5, rtol=0)

    seen.clear()
    eager_whole = eager_generate(model, PROMPTS, prefill_chunk_tokens=None, **kw)
    assert seen[0] == (12, 11)
    seen.clear()
    eager_chunked = eager_generate(model, PROMPTS, prefill_chunk_tokens=30, **kw)
    assert seen == [(12, 2)] * 5 + [(12, 1)] + [(12, 1)] * 5  # 30 tokens over 12 rows: 2+2+2+2+2+1 columns
    assert torch.equal(eager_chunked.completion_tokens, eager_whole.completion_tokens)
    assert torch.equal(eager_chunked.completion_tokens, whole.completion_tokens)
    torch.testing.assert_close(eager_chunked.sampler_log_probs, whole.sampler_log_probs, atol=1e-5, rtol=0)
    # and against the plain forward of each unpadded sequence, recomputed at every token
    for prompt, got in zip([p for p in PROMPTS for _ in range(4)], completions(chunked)):
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert got == seq[len(prompt):]


class NewStorageBytes(TorchDispatchMode):
    """Records the bytes of every storage an op allocates (views and in-place writes allocate none)."""

    def __init__(self):
        super().__init__()
        self.sizes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes[t.untyped_storage().nbytes()] += 1
        return out

    @property
    def largest(self):
        return max(self.sizes)


def largest_prefill_allocation(model, rows, width, extra_columns, chunk_tokens):
    tokens = torch.randint(1, VOCAB, (rows, width))
    prompt_mask = torch.ones(rows, width, dtype=torch.bool)
    prompt_mask[1, :7] = False
    positions = (prompt_mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad(), local_kv_cache(model, batch_size=rows, device=torch.device("cpu"), dtype=torch.float64,
                                         decoder_max_seq_len=width + extra_columns):
        recorder = NewStorageBytes()
        with recorder:  # the caches exist before: only what the prefill itself allocates is recorded
            prefill(model, tokens, input_pos=positions, prompt_mask=prompt_mask, chunk_tokens=chunk_tokens)
    return recorder.largest


def test_chunked_prefill_memory_is_bounded_per_forward_while_one_forward_grows_with_width_squared():
    model = tiny(kv_heads=2)
    rows, extra, chunk_tokens, elem = 2, 5, 64, 8  # float64; the cache has 5 columns more than the prompt
    heads, kv_heads, head_dim, hidden, inter = 4, 2, 8, 32, 64
    ratios = {}
    for width in (256, 1024):
        prompt_cache = rows * kv_heads * width * head_dim * elem  # the prompt's K (or V) in one layer's cache
        columns = chunk_tokens // rows
        # what one chunked forward may hold (prefill's docstring), over the filled columns (at most the
        # width): SDPA's additive mask, torchtune's K/V copied per query head, the MLP intermediate, the
        # hidden states, fp32 logits of the last position
        bound = max(rows * columns * width * elem, rows * heads * width * head_dim * elem,
                    rows * columns * inter * elem, rows * columns * hidden * elem, rows * VOCAB * 4)
        chunked = largest_prefill_allocation(model, rows, width, extra, chunk_tokens)
        whole = largest_prefill_allocation(model, rows, width, extra, None)
        assert chunked <= bound
        assert whole >= rows * width * width  # one forward builds at least a (rows, width, width) bool mask
        assert whole > 4 * bound
        ratios[width] = chunked / prompt_cache, whole / prompt_cache
    # against the cache: chunked stays a fixed multiple of it, one forward grows with the width
    assert ratios[1024][0] <= ratios[256][0]
    assert ratios[1024][1] >= 3.9 * ratios[256][1]


@pytest.mark.parametrize("value", [0, -3, 1.5, True, "8192"])
def test_bad_prefill_chunk_tokens_name_the_argument_and_the_yaml_key(value):
    with pytest.raises(ValueError, match=rf"prefill_chunk_tokens must be an int >= 1 .*got {value!r}"):
        CompiledSampler(prefill_chunk_tokens=value)
    with pytest.raises(ValueError, match=rf"prefill_chunk_tokens must be an int >= 1 .*got {value!r}"):
        eager_generate(tiny(), PROMPTS, max_new_tokens=2, stop_tokens=[0], pad_id=0, prefill_chunk_tokens=value)
    for backend in ("eager", "compiled"):
        with pytest.raises(ValueError, match=rf"generation\.prefill_chunk_tokens must be .*got {value!r}"):
            build_sampler(SamplerConfig.from_config({"max_new_tokens": 2, "backend": backend,
                                                     "prefill_chunk_tokens": value}), torch.device("cpu"))


@pytest.mark.parametrize("value", [None, 24])
def test_prefill_chunk_tokens_passes_through_from_yaml_to_both_samplers(value):
    train, evaluation = build_sampler(SamplerConfig.from_config({"max_new_tokens": 2, "backend": "compiled",
                                                                 "compile": False, "prefill_chunk_tokens": value}),
                                      torch.device("cpu"))
    assert train.prefill_chunk_tokens == evaluation.prefill_chunk_tokens == value
    eager, _ = build_sampler(SamplerConfig.from_config({"max_new_tokens": 2, "backend": "eager",
                                                        "prefill_chunk_tokens": value}), torch.device("cpu"))
    model = tiny(dtype=torch.float32)
    seen = shapes_through_embedding(model)
    eager(model, PROMPTS, max_new_tokens=1, stop_tokens=NEVER, pad_id=0, num_generations=2, temperature=0)
    assert seen == ([(6, 11)] if value is None else [(6, 4), (6, 4), (6, 3)])
