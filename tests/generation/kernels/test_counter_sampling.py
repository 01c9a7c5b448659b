"""The compiled sampler's Triton draw (``logitless.generation.kernels.counter_sampling``) against the PyTorch
reference :func:`sample_counter`, in the interpreter at small odd shapes (CUDA on a GPU)."""

import math

import pytest
import torch
import triton
import triton.language as tl

from logitless.generation.kernels.counter_sampling import BLOCK_V, _gumbel2, counter_draw, counter_draw_splits
from logitless.generation import CompiledSampler, decode_step, prompt_generators
from logitless.generation.sampling import sample_counter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


#: The unit roundoff of fp32, the kernels' arithmetic.
U = 2.0 ** -24


def logp_error_bound(logits, temperature, splits=None):
    """The largest ``|logp - exact|`` (nats, per row) that the kernels' fp32 arithmetic allows, so a
    test holds on any machine (the bound, not one machine's rounding, sets the tolerance).

    With ``u = 2**-24``, ``S`` the row's largest ``|logit| / T`` over its finite logits (nats), ``n``
    its finite columns, the kernels compute ``logp = (s_tok - m - log2(acc)) ln 2`` from
    ``s = logits * fp32(log2(e) / T)``, ``m`` the row's max ``s`` and ``acc = sum 2**(s - m)``:

    - every ``s`` carries three roundings (the constant, its product): ``3u|s|``, at the token and in
      every term of ``acc``: ``2 x 3uS`` nats;
    - each term ``2**(s - m)``: the subtraction's rounding, ``u|s - m| <= 2uS`` nats, and ``exp2``
      within 4 ulp (the GPU's ``ex2.approx``; the interpreter's is within 1);
    - ``acc``, a sum of positive terms: relative ``u`` per level of the sum within a block
      (``log2(BLOCK_V)``), per block of a span and per span folded, ``d`` levels in all;
    - ``log2(acc)`` within 2 ulp of ``|log2 acc| <= log2(n)`` bits: ``2u ln(n)`` nats;
    - the last subtraction and the product by fp32 ``ln 2``: ``u|s_tok - m| <= 2uS`` and ``3u|logp|``.

    In all, ``|logp - exact| <= u (10 S + d + 4 + 2 ln(n) + 3 |logp|)``.

    Args:
        logits (torch.Tensor): ``(B, V)``, as drawn from.
        temperature (float): 0 reads as 1 (greedy returns the log-prob at T = 1).
        splits (Optional[int]): spans per row (default: the kernels' own choice).

    Returns:
        torch.Tensor: ``(B,)`` float64 bounds, and the exact log-softmax ``(B, V)`` in float64.
    """
    t = temperature or 1.0
    scaled = logits.double() / t
    finite = torch.isfinite(scaled)
    exact = torch.log_softmax(scaled, dim=-1)
    vocab = logits.shape[1]
    splits = splits or counter_draw_splits(*logits.shape)
    span = -(-(-(-vocab // splits)) // BLOCK_V) * BLOCK_V
    depth = math.log2(BLOCK_V) + -(-span // BLOCK_V) + -(-vocab // span)
    big = torch.where(finite, scaled.abs(), 0.0).amax(dim=-1)
    n = finite.sum(dim=-1).double()
    return U * (10 * big + depth + 4 + 2 * n.log()), exact


def assert_logp_within_bound(tokens, logp, logits, temperature, splits=None):
    """``logp`` of the drawn ``tokens`` against float64, within :func:`logp_error_bound` (plus the
    ``3u|logp|`` of the last product)."""
    bound, exact = logp_error_bound(logits, temperature, splits)
    want = exact.gather(1, tokens[:, None]).squeeze(1)
    bound = bound + 3 * U * want.abs()
    err = (logp.double() - want).abs()
    assert bool((err <= bound).all()), f"|logp - float64| = {err.tolist()} over the bound {bound.tolist()}"


def _problem(rows, vocab, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(dtype)
    keys = torch.randint(0, 2**62, (rows,), generator=g)
    return logits.to(DEVICE), keys.to(DEVICE), torch.tensor([11], device=DEVICE)


@pytest.mark.parametrize("rows,vocab", [(3, 5000), (5, 37), (1, 2049), (2, 9001)])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["T1", "T0.7", "greedy"])
def test_counter_draw_equals_sample_counter(rows, vocab, temperature):
    logits, keys, step = _problem(rows, vocab)
    tokens, logp = counter_draw(logits, keys, step, temperature=temperature)
    ref_tokens, _ = sample_counter(logits, keys, step, temperature=temperature)
    assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
    assert torch.equal(tokens, ref_tokens)
    assert_logp_within_bound(tokens, logp, logits, temperature)


def test_several_spans_per_row_are_folded_in_order():
    # 9001 columns: 3 spans of 4096 columns; a tie across spans goes to the first
    assert counter_draw_splits(2, 9001) == 3
    logits = torch.zeros(2, 9001, device=DEVICE)
    logits[0, [100, 4500, 9000]] = 5.0   # three spans hold the max: the first column wins, as argmax picks
    logits[1, [8000, 2100]] = 5.0
    tokens, logp = counter_draw(logits, torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                torch.zeros(1, dtype=torch.int64, device=DEVICE), temperature=0.0)
    assert tokens.tolist() == [100, 2100] == logits.argmax(dim=1).tolist()
    # against float64, within the kernels' bound: fp32 torch.log_softmax is itself off by 1.6e-5 here
    # on an AVX2 CPU, so comparing with it measured the CPU, not the kernels
    assert_logp_within_bound(tokens, logp, logits, 0.0)


def test_a_span_of_several_blocks_keeps_the_first_column_and_the_reference_draw(monkeypatch):
    # one span per row: each program walks 3 blocks of 4096 columns, several columns per lane per block
    from logitless.generation.kernels import counter_sampling

    monkeypatch.setattr(counter_sampling, "counter_draw_splits", lambda rows, vocab, num_sms=132: 1)
    logits = torch.zeros(3, 9001, device=DEVICE)
    logits[0, [4101, 4, 7000]] = 5.0  # offset 5 of block 1, offset 4 of block 0: column 4
    logits[1, [5, 4101]] = 5.0  # one offset, blocks 0 and 1: column 5
    logits[2, [8195, 4103]] = 5.0  # offset 3 of block 2, offset 7 of block 1: column 4103
    zeros = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    tokens, logp = counter_draw(logits, zeros, zeros[:1], temperature=0.0)
    assert tokens.tolist() == [4, 5, 4103] == logits.argmax(dim=1).tolist()
    assert_logp_within_bound(tokens, logp, logits, 0.0, splits=1)
    for temperature in (1.0, 0.7):
        logits, keys, step = _problem(4, 9001, seed=5)
        tokens, logp = counter_draw(logits, keys, step, temperature=temperature)
        ref_tokens, _ = sample_counter(logits, keys, step, temperature=temperature)
        assert torch.equal(tokens, ref_tokens)
        assert_logp_within_bound(tokens, logp, logits, temperature, splits=1)


def test_a_token_whose_hash_is_the_largest_is_drawn_only_by_its_probability():
    # the (key, step, token) of tests/generation/test_compaction.py whose 24-bit uniform was exactly 1
    logits = torch.zeros(2, 1000, device=DEVICE)
    logits[:, 389] = -40.0
    keys = torch.tensor([1657, 1657], device=DEVICE)
    for temperature in (1.0, 0.7):
        tokens, logp = counter_draw(logits, keys, torch.tensor([0], device=DEVICE), temperature=temperature)
        ref_tokens, _ = sample_counter(logits, keys, torch.tensor([0], device=DEVICE), temperature=temperature)
        assert 389 not in tokens.tolist() and torch.equal(tokens, ref_tokens)


@pytest.mark.skipif(DEVICE != "cuda", reason="a full vocabulary for many steps: GPU only")
def test_a_near_certain_token_is_always_drawn_at_a_full_vocabulary():
    # every other token has probability ~1e-13: in 64 x 300 draws the expected count of others is
    # 3e-4, while a uniform of exactly 1 (one hash value in 2**24) drew one in 0.9% of them
    vocab = 151936
    logits = torch.full((64, vocab), -30.0, device=DEVICE)
    logits[:, 7] = 0.0
    keys = torch.randint(0, 2**62, (64,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    kernel, reference = [], []
    for t in range(300):
        step = torch.tensor([t], device=DEVICE)
        kernel.append(counter_draw(logits, keys, step, temperature=1.0)[0])
        if t < 30:
            reference.append(sample_counter(logits, keys, step, temperature=1.0)[0])
    assert int((torch.stack(kernel) != 7).sum()) == 0
    assert int((torch.stack(reference) != 7).sum()) == 0


@triton.jit
def _gumbel_of_cells_kernel(cells_ptr, out_ptr, n, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.load(cells_ptr + i, mask=i < n, other=0)
    u = (j.to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # uniform_from_bits of cell j
    tl.store(out_ptr + i, _gumbel2(u, FAST_LOG), mask=i < n)


def test_the_kernels_gumbel_is_finite_monotone_and_within_3_ulp_of_float64():
    # every one of the 2**23 uniforms on a GPU (with lg2.approx); the interpreter takes both ends,
    # where the logs are hardest, and a stride through the rest
    if DEVICE == "cuda":
        cells = torch.arange(1 << 23, device=DEVICE)
    else:
        cells = torch.cat([torch.arange(4096), torch.arange(4096, (1 << 23) - 4096, 997), torch.arange((1 << 23) - 4096, 1 << 23)])
    g = torch.empty(len(cells), device=DEVICE)
    _gumbel_of_cells_kernel[(triton.cdiv(len(cells), 1024),)](cells, g, len(cells), FAST_LOG=DEVICE == "cuda", BLOCK=1024)
    exact = torch.log2(-torch.log2((cells.double() + 0.5) / 2**23))
    assert bool(torch.isfinite(g).all()) and bool((g[1:] <= g[:-1]).all())
    ulps = (g.double() - exact).abs() / (exact.abs().clamp_min(1.0) * 2**-23)
    assert float(ulps.max()) <= 3.0


def test_masked_tokens_are_never_drawn_and_bf16_logits_are_read_as_fp32():
    logits, keys, _ = _problem(4, 3000, dtype=torch.bfloat16)
    logits[:, 7:] = float("-inf")  # only tokens 0..6 are possible
    for t in range(20):
        step = torch.tensor([t], device=DEVICE)
        tokens, logp = counter_draw(logits, keys, step, temperature=1.0)
        ref_tokens, _ = sample_counter(logits, keys, step, temperature=1.0)
        assert bool((tokens < 7).all()) and torch.equal(tokens, ref_tokens)
        assert_logp_within_bound(tokens, logp, logits, 1.0)


def test_a_rows_draw_does_not_depend_on_the_batch():
    logits, keys, step = _problem(6, 4099)
    tokens, logp = counter_draw(logits, keys, step, temperature=1.0)
    order = torch.tensor([4, 0, 5], device=DEVICE)
    part, part_logp = counter_draw(logits[order], keys[order], step, temperature=1.0)
    assert torch.equal(part, tokens[order])
    assert torch.equal(part_logp, logp[order])


def test_one_step_per_row_draws_each_row_at_its_own_step():
    """A ``(B,)`` step (the rows of a multi-turn rollout at different positions): row ``r`` draws what
    it draws alone with step ``step[r]``, and what the reference draws with the same per-row steps."""
    logits, keys, _ = _problem(5, 3001)
    steps = torch.tensor([0, 7, 3, 3, 11], device=DEVICE)
    tokens, logp = counter_draw(logits, keys, steps, temperature=0.8)
    ref_tokens, _ = sample_counter(logits, keys, steps, temperature=0.8)
    assert torch.equal(tokens, ref_tokens)
    for r in range(5):
        alone, alone_logp = counter_draw(logits[r:r + 1], keys[r:r + 1], steps[r:r + 1], temperature=0.8)
        assert int(alone) == int(tokens[r]) and float(alone_logp) == float(logp[r])
    assert_logp_within_bound(tokens, logp, logits, 0.8)


@pytest.mark.parametrize("bad,match", [
    (dict(logits=torch.zeros(2, 3, 4)), "logits"),
    (dict(logits=torch.zeros(5, 2).t()), "logits"),
    (dict(logits=torch.zeros(2, 5, dtype=torch.int64)), "logits"),
    (dict(keys=torch.zeros(3, dtype=torch.int64)), "keys"),
    (dict(keys=torch.zeros(2, dtype=torch.int32)), "keys"),
    (dict(step=torch.zeros(3, dtype=torch.int64)), "step"),  # neither one step nor one per row
    (dict(step=torch.zeros(2, dtype=torch.int32)), "step"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(logits=torch.zeros(2, 5), keys=torch.zeros(2, dtype=torch.int64), step=torch.zeros(1, dtype=torch.int64),
                temperature=1.0)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        counter_draw(args["logits"].to(DEVICE), args["keys"].to(DEVICE), args["step"].to(DEVICE),
                     temperature=args["temperature"])


def test_the_sampler_draws_the_same_tokens_through_the_kernel(monkeypatch):
    from torchtune.models.qwen2._component_builders import qwen2

    torch.manual_seed(0)
    model = qwen2(vocab_size=301, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                  max_seq_len=128, tie_word_embeddings=True).eval().to(DEVICE)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]

    def sample():
        sampler = CompiledSampler(compile=False, compaction=True, min_bucket=2, sync_every=1)
        return sampler(model, prompts, pad_id=0, num_generations=4, max_new_tokens=12, stop_tokens=list(range(1, 301, 9)),
                       temperature=1.0, generator=prompt_generators(0, 3, range(len(prompts))))

    reference = sample()
    calls = []
    real = decode_step.kernel_draw

    def forced(logits, top_k, top_p):
        calls.append(1)
        return top_k is None and top_p is None  # the kernel on the CPU too (interpreter)

    monkeypatch.setattr(decode_step, "kernel_draw", forced if DEVICE == "cpu" else real)
    kernel = sample()
    assert DEVICE == "cuda" or calls
    assert torch.equal(kernel.completion_tokens, reference.completion_tokens)
    assert torch.equal(kernel.completion_mask, reference.completion_mask)
    torch.testing.assert_close(kernel.sampler_log_probs, reference.sampler_log_probs, rtol=0, atol=1e-5)
