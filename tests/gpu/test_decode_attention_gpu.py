"""The split-K decode attention kernel on a GPU at Qwen2.5 attention shapes, against float64 relative
to SDPA, and the compiled sampler with it against SDPA token for token (skipped without CUDA)."""

import math

import pytest
import torch
from torch.nn import functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (query heads, K/V heads, head_dim): Qwen2.5-0.5B, 1.5B, 7B
SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128)}
CACHE_ROWS, LENGTH = 64, 3584


def _problem(hq, hkv, dim, rows, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(rows, hq, dim, generator=g, device="cuda", dtype=torch.float64)
    k = torch.randn(CACHE_ROWS, hkv, LENGTH, dim, generator=g, device="cuda", dtype=torch.float64)
    v = torch.randn(CACHE_ROWS, hkv, LENGTH, dim, generator=g, device="cuda", dtype=torch.float64)
    pads = torch.randint(0, 300, (CACHE_ROWS,), generator=g, device="cuda")
    valid = torch.arange(LENGTH, device="cuda")[None] >= pads[:, None]  # left padding per row
    return q.to(dtype), k.to(dtype)[:rows], v.to(dtype)[:rows], valid[:rows]


def _exact(q, k, v, valid, n):
    b, hq, d = q.shape
    hkv = k.shape[1]
    ok = valid & (torch.arange(k.shape[2], device="cuda") < n)
    s = torch.einsum("bhgd,bhld->bhgl", q.double().view(b, hkv, hq // hkv, d), k.double()) / math.sqrt(d)
    p = torch.softmax(s.masked_fill(~ok[:, None, None], float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("bhgl,bhld->bhgd", p, v.double()).reshape(b, hq, d)


def _sdpa(q, k, v, valid, n):
    b, hq, d = q.shape
    hkv = k.shape[1]
    ok = valid & (torch.arange(k.shape[2], device="cuda") < n)
    return F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), k, v, attn_mask=ok[:, None, None]).reshape(
        b, hq, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("rows", [8, 64])
def test_kernel_matches_float64_as_well_as_sdpa_at_qwen_shapes(model, rows, dtype):
    from logitless.generation.kernels.decode_attention import decode_attention

    hq, hkv, dim = SHAPES[model]
    for n in (1, 257, 1100, LENGTH):
        q, k, v, valid = _problem(hq, hkv, dim, rows, dtype, seed=n)
        nf = torch.tensor([n], device="cuda")
        exact = _exact(q, k, v, valid, n)
        ours = decode_attention(q, k, v, valid, nf)
        sdpa = _sdpa(q, k, v, valid, n)
        err = lambda a: ((a.double() - exact).norm() / exact.norm().clamp(min=1e-30)).item()  # noqa: E731
        assert torch.isfinite(ours).all()
        assert err(ours) <= 1.5 * err(sdpa) + (1e-6 if dtype == torch.float32 else 0.0), (n, err(ours), err(sdpa))
        for split_len in (64, 512):  # a short and the longest automatic split give the same attention
            other = decode_attention(q, k, v, valid, nf, split_len=split_len)
            assert err(other) <= 1.5 * err(sdpa) + (1e-6 if dtype == torch.float32 else 0.0)


@pytest.mark.parametrize("model", list(SHAPES))
def test_shared_prefix_matches_float64_as_well_as_sdpa_at_qwen_shapes(model):
    # 64 rows = 4 prompts x 16 completions, 1024 prompt columns; rows past the first of a group hold
    # NaN there (never read); the last 4 rows are compaction's fillers, outside every segment
    from logitless.generation.kernels.decode_attention import SharedPrefix, decode_attention, group_segments, prefix_rows

    hq, hkv, dim = SHAPES[model]
    rows, group, width, covered = 64, 16, 1024, 60
    per = prefix_rows(hq // hkv, group)
    start, seg_rows = group_segments(torch.arange(covered, device="cuda"), group, per, rows // group)
    prefix = SharedPrefix(torch.tensor([width], device="cuda"), start, seg_rows, torch.tensor([covered], device="cuda"),
                          per)
    leader = torch.arange(rows, device="cuda") // group * group
    for dtype in (torch.bfloat16, torch.float32):
        for n in (width, 1100, 1536, LENGTH):
            q, k, v, valid = _problem(hq, hkv, dim, rows, dtype, seed=n)
            seen = [t.clone() for t in (k, v)] + [valid.clone()]
            seen[0][:, :, :width] = k[leader, :, :width]
            seen[1][:, :, :width] = v[leader, :, :width]
            seen[2][:, :width] = valid[leader, :width]
            seen[2][covered:, :width] = False
            others = leader != torch.arange(rows, device="cuda")
            for t in (k, v):
                t[others, :, :width] = float("nan")
            nf = torch.tensor([n], device="cuda")
            exact = _exact(q, *seen, n)
            err = lambda a: ((a.double() - exact).norm() / exact.norm()).item()  # noqa: E731
            sdpa = err(_sdpa(q, *seen, n))
            for split in (None, 256):
                ours = decode_attention(q, k, v, valid, nf, shared_prefix=prefix, prefix_split_len=split)
                assert torch.isfinite(ours).all()
                assert err(ours) <= 1.5 * sdpa + (1e-6 if dtype == torch.float32 else 0.0), (dtype, n, split)


@pytest.mark.parametrize("shared", [False, True], ids=["per_row", "shared_prefix"])
@pytest.mark.parametrize("model", list(SHAPES))
def test_programmatic_launch_gives_the_same_bits_in_and_out_of_a_cuda_graph(model, shared):
    # programmatic dependent launches let a kernel start while the one before finishes: the output
    # must not change, also when a graph chains many calls that each read the previous one's output.
    # With a shared prefix the row kernel starts while the prefix kernel streams 1024 columns and
    # its rows only 76: a merge that did not wait for the prefix partials would read them unwritten
    from logitless.generation.kernels.decode_attention import decode_attention
    from logitless.generation.kernels.decode_attention import (SharedPrefix, group_segments, prefix_rows,
                                                       supports_programmatic_launch)

    if not supports_programmatic_launch(torch.device("cuda")):
        pytest.skip("needs a GPU of compute capability 9.0 or later")
    hq, hkv, dim = SHAPES[model]
    q, k, v, valid = _problem(hq, hkv, dim, 64, torch.bfloat16, seed=7)
    nf = torch.tensor([1100], device="cuda")
    prefix = None
    if shared:
        per = prefix_rows(hq // hkv, 16)
        start, seg_rows = group_segments(torch.arange(64, device="cuda"), 16, per, 4)
        prefix = SharedPrefix(torch.tensor([1024], device="cuda"), start, seg_rows, torch.tensor([64], device="cuda"),
                              per)

    def chain(programmatic):
        x = q
        for _ in range(8):  # each call's query is the last one's output
            x = decode_attention(x, k, v, valid, nf, programmatic_launch=programmatic, shared_prefix=prefix)
        return x

    plain = chain(False)
    assert torch.equal(chain(True), plain)
    x_in = q.clone()
    graph = torch.cuda.CUDAGraph()
    chain(True)  # compile outside the capture
    with torch.cuda.graph(graph):
        x = x_in
        for _ in range(8):
            x = decode_attention(x, k, v, valid, nf, programmatic_launch=True, shared_prefix=prefix)
    for _ in range(3):
        graph.replay()
        assert torch.equal(x, plain)


PROMPTS = [[(7 * i + 3 * p) % 5000 + 10 for i in range(200 + 50 * p)] for p in range(4)]


def test_greedy_compiled_split_k_equals_sdpa_token_for_token_in_one_graph(two_layers_varied, monkeypatch):
    import importlib

    from torch._dynamo.utils import counters

    from logitless.generation import CompiledSampler
    from logitless.generation.eager import generate

    # no counters reserved by an earlier test: the sampler reserves its own, outside the CUDA graphs'
    # memory pool (allocated in the warm-up, they failed the graph's pool check)
    monkeypatch.setattr(importlib.import_module("logitless.generation.kernels.decode_attention.op"), "_ARRIVALS", {})

    model = two_layers_varied
    free = generate(model, PROMPTS, max_new_tokens=48, stop_tokens=[-1], pad_id=0, num_generations=4, temperature=0)
    stops = sorted({int(free.completion_tokens[4 * p, 8 + 10 * p]) for p in range(4)})
    kw = dict(max_new_tokens=48, stop_tokens=stops, pad_id=0, num_generations=4, temperature=0)
    sdpa = CompiledSampler(min_bucket=2, sync_every=4, attention_window=16)(model, PROMPTS, **kw)
    torch._dynamo.reset()
    counters.clear()
    split_k = CompiledSampler(min_bucket=2, sync_every=4, decode_attention="split_k")(model, PROMPTS, **kw)
    assert counters["stats"]["unique_graphs"] == 1  # every bucket and filled length: one compilation
    assert len(set(sdpa.completion_lengths.tolist())) >= 3  # rows ended at several lengths: compaction ran
    assert torch.equal(split_k.completion_mask, sdpa.completion_mask)
    assert torch.equal(split_k.completion_tokens, sdpa.completion_tokens)
    torch.testing.assert_close(split_k.sampler_log_probs, sdpa.sampler_log_probs, atol=2e-3, rtol=0)


def test_greedy_shared_prompt_decode_equals_per_row_split_k_token_for_token(two_layers_varied):
    from logitless.generation import CompiledSampler
    from logitless.generation.eager import generate

    model = two_layers_varied
    free = generate(model, PROMPTS, max_new_tokens=48, stop_tokens=[-1], pad_id=0, num_generations=4, temperature=0)
    stops = sorted({int(free.completion_tokens[4 * p, 8 + 10 * p]) for p in range(4)})
    kw = dict(max_new_tokens=48, stop_tokens=stops, pad_id=0, num_generations=4, temperature=0)
    runs = {}
    for share in (False, True):
        sampler = CompiledSampler(min_bucket=2, sync_every=4, decode_attention="split_k", shared_prompt_decode=share)
        runs[share] = sampler(model, PROMPTS, **kw)
        assert (sampler._state.segments is not None) == share
    assert len(set(runs[True].completion_lengths.tolist())) >= 3  # compaction ran
    assert torch.equal(runs[True].completion_mask, runs[False].completion_mask)
    assert torch.equal(runs[True].completion_tokens, runs[False].completion_tokens)
    torch.testing.assert_close(runs[True].sampler_log_probs, runs[False].sampler_log_probs, atol=2e-3, rtol=0)


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_new_token_in_a_cuda_graph_matches_rotating_and_writing_first(model):
    """A NewToken at Qwen2.5 shapes, 64 rows, bf16, launched as the compiled step launches it (a
    programmatic launch in a CUDA graph): the caches hold the key and value the separate rotary
    kernel writes, and the output matches float64 as well as the plain kernel on its rotated query."""
    import importlib

    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings

    dr = importlib.import_module("logitless.generation.kernels.decode_rotary")
    da = importlib.import_module("logitless.generation.kernels.decode_attention")
    hq, hkv, dim = SHAPES[model]
    rows, n = 64, 3001
    _, k, v, valid = _problem(hq, hkv, dim, rows, torch.bfloat16, seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    qkv = torch.randn(rows, (hq + 2 * hkv) * dim, generator=g, device="cuda").to(torch.bfloat16)
    q, k_new, v_new = (t.view(rows, -1, dim) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    spec = dr.rotary_table(Qwen2RotaryPositionalEmbeddings(dim, max_seq_len=4096).cuda(), dim)
    positions = torch.randint(2900, 3000, (rows,), generator=g, device="cuda")
    nf = torch.tensor([n], device="cuda")
    k_want, v_want = k.clone(), v.clone()
    q_rot = dr.decode_rotary_cache(q, k_new, v_new, positions, spec, nf - 1, k_want, v_want)
    plain = da.decode_attention(q_rot, k_want, v_want, valid, nf)
    token = da.NewToken(k_new, v_new, *dr.rotation_coefficients(spec, positions, dim, torch.bfloat16), False)
    da.decode_attention(q, k.clone(), v.clone(), valid, nf, new_token=token)  # compile and reserve outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = da.decode_attention(q, k, v, valid, nf, new_token=token)
    graph.replay()
    torch.cuda.synchronize()
    # the same fp32 rotation rounded once: equal up to the order of a product's terms (one ulp)
    torch.testing.assert_close(k, k_want, rtol=8e-3, atol=1e-5)
    assert torch.equal(v, v_want)
    exact = _exact(q_rot, k_want, v_want, valid, n)
    err = lambda x: ((x.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(out) <= 1.1 * err(plain) + 1e-4, (err(out), err(plain))
