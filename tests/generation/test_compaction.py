"""Finished rows cost nothing: compaction into smaller batch buckets leaves every row's tokens as an
uncompacted run draws them; the counter-based draws are reproducible and independent of the batch."""

import pytest
import torch
from torch.nn import functional as F

from logitless.generation import CompiledSampler, prompt_generators
from logitless.generation.eager import generate as eager_generate
from logitless.generation.sampling import counter_uniform, row_keys, sample_counter, uniform_from_bits

VOCAB = 61
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20, 21, 22, 23]]


def tiny(seed=0):
    from torchtune.models.qwen2._component_builders import qwen2

    torch.manual_seed(seed)
    model = qwen2(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                  max_seq_len=128, tie_word_embeddings=True)
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(0.1)  # spread-out distributions
    return model.double().eval()  # fp64: another batch size cannot flip a draw by rounding


def run(model, compaction, spy=None, **kw):
    sampler = CompiledSampler(compile=False, compaction=compaction, min_bucket=2, sync_every=1)
    if spy is not None:
        original = sampler._compact

        def compact(state, bucket, size, pad_id):
            spy.append((int((~bucket["done"]).sum()), bucket["done"].shape[0], size))
            return original(state, bucket, size, pad_id)

        sampler._compact = compact
    return sampler(model, PROMPTS, pad_id=0, num_generations=4,
                   generator=prompt_generators(0, 5, range(len(PROMPTS))), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_compaction_keeps_every_rows_tokens(temperature):
    model = tiny()
    if temperature == 0.0:  # greedy: stop at tokens the free run emits at different steps
        free = run(model, False, max_new_tokens=24, stop_tokens=[VOCAB], temperature=0.0).completion_tokens
        stops = sorted({int(free[4 * i, 3 + 5 * i]) for i in range(len(PROMPTS))})
    else:  # a fifth of the vocabulary stops a row: lengths spread between 1 and 24
        stops = list(range(1, VOCAB, 5))
    kw = dict(max_new_tokens=24, stop_tokens=stops, temperature=temperature)
    moves = []
    compacted = run(model, True, spy=moves, **kw)
    plain = run(model, False, **kw)
    assert moves and all(live <= size < rows for live, rows, size in moves)  # 16 rows -> 8 -> 4 -> 2
    assert len(moves) >= (1 if temperature == 0.0 else 2)  # greedy groups finish together
    assert torch.equal(compacted.completion_tokens, plain.completion_tokens)
    assert torch.equal(compacted.completion_mask, plain.completion_mask)
    assert torch.equal(compacted.truncated, plain.truncated)
    torch.testing.assert_close(compacted.sampler_log_probs, plain.sampler_log_probs, rtol=0, atol=1e-12)
    lengths = plain.completion_lengths
    assert lengths.min() < lengths.max()  # rows really stopped at different steps
    if temperature == 0.0:  # greedy: the eager reference sampler, token for token
        ref = eager_generate(model, PROMPTS, pad_id=0, num_generations=4, **kw)
        assert torch.equal(compacted.completion_tokens, ref.completion_tokens)
        assert torch.equal(compacted.completion_mask, ref.completion_mask)


def test_counter_draws_are_reproducible_and_independent_of_the_batch():
    model = tiny(1)
    kw = dict(max_new_tokens=10, stop_tokens=[3], pad_id=0, num_generations=4, temperature=1.0)
    sampler = CompiledSampler(compile=False, min_bucket=2, sync_every=2)
    full = sampler(model, PROMPTS, generator=prompt_generators(7, 2, [0, 1, 2, 3]), **kw)
    again = sampler(model, PROMPTS, generator=prompt_generators(7, 2, [0, 1, 2, 3]), **kw)
    assert torch.equal(full.completion_tokens, again.completion_tokens)
    # prompt 2 alone (as a rank sampling its share would): its group's completions are unchanged
    alone = sampler(model, PROMPTS[2:3], generator=prompt_generators(7, 2, [2]), **kw)
    n = alone.completion_tokens.shape[1]
    assert torch.equal(alone.completion_tokens, full.completion_tokens[8:12, :n])
    assert not full.completion_tokens[8:12, n:].any()
    # another step draws other tokens
    other = sampler(model, PROMPTS, generator=prompt_generators(7, 3, [0, 1, 2, 3]), **kw)
    assert not torch.equal(other.completion_tokens, full.completion_tokens)


def test_row_keys_depend_on_the_prompts_stream_and_the_generation_only():
    a = row_keys(prompt_generators(0, 1, [0, 1, 2]), 3, 4)
    b = row_keys(prompt_generators(0, 1, [1]), 1, 4)
    assert torch.equal(a[4:8], b) and len(set(a.tolist())) == 12
    one = row_keys(torch.Generator().manual_seed(0), 3, 4)
    assert len(set(one.tolist())) == 12
    with pytest.raises(ValueError, match="one torch.Generator per prompt"):
        row_keys(prompt_generators(0, 1, [0, 1]), 3, 4)


def test_counter_uniforms_are_uniform_and_decorrelated():
    keys = torch.arange(64, dtype=torch.int64) * 1_000_003
    u = counter_uniform(keys, torch.tensor([0]), 4096).double()
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert float(u.mean()) == pytest.approx(0.5, abs=0.003)
    assert float(u.var()) == pytest.approx(1 / 12, abs=0.002)
    # neighbouring rows, steps and tokens are uncorrelated
    nxt = counter_uniform(keys, torch.tensor([1]), 4096).double()
    for x, y in [(u[:-1], u[1:]), (u, nxt), (u[:, :-1], u[:, 1:])]:
        assert abs(float(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1])) < 0.01


#: A (key, step, token) whose hash has its top 24 bits all set: ``(2**24 - 1) + 0.5`` rounds to
#: ``2**24`` in fp32, so a 24-bit uniform was exactly 1 there and the token's Gumbel noise +inf.
ONE_KEY, ONE_STEP, ONE_TOKEN = 1657, 0, 389


def test_every_hash_value_gives_a_uniform_strictly_inside_0_1():
    # every value the top bits of a hash can take, with the low bits set (the largest hashes)
    tops = torch.arange(1 << 24, dtype=torch.int64)
    u = uniform_from_bits((tops << 8) | 0xFF).double()
    assert 0 < float(u.min()) and float(u.max()) < 1
    # exact midpoints of equal cells: the set is symmetric about 1/2
    values = torch.unique(u)
    assert torch.equal(values + values.flip(0), torch.ones_like(values))
    assert int((torch.bincount(torch.bucketize(u, values)) != (1 << 24) // len(values)).sum()) == 0
    # the key, step and token whose hash reaches the top value
    keys = torch.tensor([ONE_KEY], dtype=torch.int64)
    assert float(counter_uniform(keys, torch.tensor([ONE_STEP]), 1000)[0, ONE_TOKEN]) == float(values.max())


def test_a_token_whose_hash_is_the_largest_is_drawn_only_by_its_probability():
    logits = torch.zeros(4, 1000)
    logits[:, ONE_TOKEN] = -40.0  # probability about 4e-21
    keys = torch.tensor([ONE_KEY] * 4, dtype=torch.int64)
    for temperature in (1.0, 0.7):
        tok, lp = sample_counter(logits, keys, torch.tensor([ONE_STEP]), temperature=temperature)
        assert ONE_TOKEN not in tok.tolist()
        assert bool(torch.isfinite(lp).all())


def test_sample_counter_draws_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    keys = torch.arange(4000, dtype=torch.int64)
    step = torch.tensor([0])
    tok, lp = sample_counter(logits, keys, step, temperature=1.0, top_k=2)
    assert set(tok.tolist()) == {0, 1}
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.5, 0.3]))[tok])  # untruncated log-probs
    tok, _ = sample_counter(logits, keys, step, temperature=1.0, top_p=0.6)
    assert set(tok.tolist()) == {0, 1}
    tok, _ = sample_counter(logits, keys, step, temperature=1.0, top_p=0.5)
    assert set(tok.tolist()) == {0}
    tok, lp = sample_counter(logits[:1], keys[:1], step, temperature=2.0)
    torch.testing.assert_close(lp, F.log_softmax(logits[:1] / 2.0, -1)[0, tok])
    tok, _ = sample_counter(logits, keys, step, temperature=1.0)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    tok, lp = sample_counter(logits[:3], keys[:3], step, temperature=0)  # greedy: argmax, log-prob at T = 1
    assert tok.tolist() == [0, 0, 0]
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.5, 0.5, 0.5])))


def test_sampling_after_the_step_draws_what_sampling_inside_it_draws():
    model = tiny(2)
    kw = dict(max_new_tokens=12, stop_tokens=list(range(1, VOCAB, 6)), pad_id=0, num_generations=4, temperature=0.8,
              top_k=20, generator=prompt_generators(3, 1, range(len(PROMPTS))))
    inside = CompiledSampler(compile=False, min_bucket=2, sync_every=1)(model, PROMPTS, **kw)
    kw["generator"] = prompt_generators(3, 1, range(len(PROMPTS)))
    after = CompiledSampler(compile=False, min_bucket=2, sync_every=1, graph_sampling=False)(model, PROMPTS, **kw)
    assert torch.equal(inside.completion_tokens, after.completion_tokens)
    assert torch.equal(inside.completion_mask, after.completion_mask)
