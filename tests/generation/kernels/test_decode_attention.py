"""The split-K decode attention kernel against float64, relative to SDPA in the same dtype.

On a machine without CUDA the kernels run in Triton's CPU interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``); shapes are small and odd: B=3 rows of a 5-row cache (a bucket view),
1 or 2 K/V heads, 1, 3 or 7 query heads per K/V head, head_dim 16 or 64, 37 or 70 columns.
"""

import itertools
import math

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")
from logitless.generation.kernels.decode_attention import (NewToken, SharedPrefix, decode_attention,  # noqa: E402
                                                            decode_attention_reference)
from logitless.generation.kernels.decode_attention import op as da_op, plan as da_plan  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, CACHE_ROWS = 3, 5


def _problem(hkv, group, dim, length, dtype, seed):
    """q as a strided view, k/v as the first rows of a bigger cache, left padding per row (row 0:
    none, row 2: no valid key among the first 9 columns, the others random)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(ROWS, dim, hkv * group, generator=g, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(CACHE_ROWS, hkv, length, dim, generator=g, dtype=torch.float64)
    v = torch.randn(CACHE_ROWS, hkv, length, dim, generator=g, dtype=torch.float64)
    valid = torch.ones(CACHE_ROWS, length, dtype=torch.bool)
    pads = torch.randint(1, 12, (CACHE_ROWS,), generator=g)
    pads[0], pads[2] = 0, 9
    for row, pad in enumerate(pads.tolist()):
        valid[row, :pad] = False
    valid[1, 20:23] = False  # a hole inside the row as well
    cast = lambda t: t.to(dtype).to(DEV)  # noqa: E731
    return cast(q), cast(k)[:ROWS], cast(v)[:ROWS], valid.to(DEV)[:ROWS]


def _float64(q, k, v, valid, n):
    """The exact attention: softmax over the valid filled columns, 0 for a row without any."""
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    ok = valid.cpu() & (torch.arange(length) < n)
    s = torch.einsum("bhgd,bhld->bhgl", q.view(b, hkv, hq // hkv, d), k) / math.sqrt(d)
    s = s.masked_fill(~ok[:, None, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhgl,bhld->bhgd", p, v).reshape(b, hq, d)


def _sdpa(q, k, v, valid, n):
    """Plain PyTorch in the inputs' dtype: SDPA with a boolean mask over the whole cache."""
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    ok = valid & (torch.arange(length, device=valid.device) < n)
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), k, v, attn_mask=ok[:, None, None])
    return out.reshape(b, hq, d)


def _err(a, ref):
    return ((a.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype,hkv,group,dim,length", [
    (dtype, *shape) for dtype in (torch.float32, torch.bfloat16)
    for shape in ((1, 1, 16, 37), (2, 3, 64, 70), (1, 7, 16, 70), (2, 7, 64, 37))] + [(torch.float16, 2, 7, 16, 70)])
def test_matches_float64_at_least_as_well_as_sdpa(hkv, group, dim, length, dtype):
    pooled = {"ours": 0.0, "sdpa": 0.0, "norm": 0.0}
    for n in (1, length // 2 + 1, length):  # one column, a split boundary crossed, the whole cache
        q, k, v, valid = _problem(hkv, group, dim, length, dtype, seed=n)
        nf = torch.tensor([n], device=DEV)
        out = decode_attention(q, k, v, valid, nf, split_len=32, block_n=16)  # 2 blocks a split, 2-3 splits
        exact = _float64(q, k, v, valid, n)
        assert out.shape == q.shape and out.dtype == dtype
        assert torch.isfinite(out).all()
        if n <= 9:  # row 2 has no valid key yet: 0, as SDPA gives
            assert (out[2] == 0).all()
        for name, got in (("ours", out), ("sdpa", _sdpa(q, k, v, valid, n))):
            pooled[name] += (got.double().cpu() - exact).norm().item() ** 2
        pooled["norm"] += exact.norm().item() ** 2
    ours, sdpa = (math.sqrt(pooled[k] / pooled["norm"]) for k in ("ours", "sdpa"))
    # bf16: both round the output (and P) to bf16; fp32: both are a few ulps off
    assert ours <= 1.5 * sdpa + (1e-6 if dtype == torch.float32 else 0.0), (ours, sdpa)
    assert ours < (1e-6 if dtype == torch.float32 else 1e-2)  # and small in absolute terms


def test_default_split_lengths_and_many_splits_give_the_same_attention():
    q, k, v, valid = _problem(2, 3, 16, 70, torch.float32, seed=5)
    nf = torch.tensor([61], device=DEV)
    exact = _float64(q, k, v, valid, 61)
    for split_len, block_n in ((None, 64), (64, 32), (32, 16), (16, 16)):
        out = decode_attention(q, k, v, valid, nf, split_len=split_len, block_n=block_n)
        assert _err(out, exact) < 1e-6, (split_len, block_n)


def test_reads_nothing_at_or_after_n_filled_nor_at_masked_columns(monkeypatch):
    q, k, v, valid = _problem(2, 3, 16, 70, torch.bfloat16, seed=7)
    n = 41
    nf = torch.tensor([n], device=DEV)
    clean = decode_attention(q, k, v, valid, nf, split_len=32, block_n=16)
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # workspaces and output: NaN wherever nothing writes
        return empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    unread = ~valid.clone()
    unread[:, n:] = True
    for t in (poisoned_k, poisoned_v):
        t.masked_fill_(unread[:, None, :, None], float("nan"))
    out = decode_attention(q, poisoned_k, poisoned_v, valid, nf, split_len=32, block_n=16)
    assert torch.isfinite(out).all()
    assert torch.equal(out, clean)
    monkeypatch.undo()
    ref = decode_attention_reference(q, poisoned_k, poisoned_v, valid, nf, 1 / math.sqrt(16))  # the CPU fallback too
    assert torch.isfinite(ref).all() and _err(ref, _float64(q, k, v, valid, n)) < 1e-2


def test_the_fallback_off_cuda_without_the_interpreter_is_the_reference(monkeypatch):
    q, k, v, valid = _problem(2, 7, 16, 37, torch.float32, seed=3)
    q, k, v, valid = q.cpu(), k.cpu(), v.cpu(), valid.cpu()
    nf = torch.tensor([30])
    monkeypatch.setattr(da_op, "triton_interpreting", lambda: False)
    monkeypatch.setattr(da_op, "_launch", lambda *a: pytest.fail("the kernel ran without CUDA or the interpreter"))
    out = decode_attention(q, k, v, valid, nf)
    assert _err(out, _float64(q, k, v, valid, 30)) < 1e-6
    assert torch.isfinite(out).all()


def test_one_graph_under_torch_compile():
    from torch._dynamo.utils import counters

    q, k, v, valid = _problem(1, 3, 16, 37, torch.float32, seed=1)
    nf = torch.tensor([20], device=DEV)

    def step(q, k, v, valid, nf):
        return decode_attention(q * 2, k, v, valid, nf + 1, split_len=16, block_n=16) + 1

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, valid, nf)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out, step(q, k, v, valid, nf), rtol=0, atol=0)


def _shared_problem(hkv, group, dim, dtype, seed, width=37, length=70):
    """A bucket of 7 rows (of a 9-row cache) in three segments and a filler: rows 0-2 share their
    first ``width`` columns with row 0, rows 3-4 with row 3, row 5 alone; row 6 is outside every
    segment (``covered`` = 6); one empty segment in between. Every row that is not the first of its
    segment holds NaN keys and values and a random validity in its shared columns (never read); the
    segments' first rows are left-padded differently."""
    from logitless.generation.kernels.decode_attention import SharedPrefix

    g = torch.Generator().manual_seed(seed)
    rows, cache_rows = 7, 9
    q = torch.randn(rows, dim, hkv * group, generator=g, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(cache_rows, hkv, length, dim, generator=g, dtype=torch.float64)
    v = torch.randn(cache_rows, hkv, length, dim, generator=g, dtype=torch.float64)
    valid = torch.ones(cache_rows, length, dtype=torch.bool)
    valid[0, :4] = False
    valid[3, :11] = False
    valid[5, 30:33] = False
    valid[:, width + 3] = False  # a hole after the prefix too
    starts, counts = [0, 3, 3, 5], [3, 0, 2, 1]
    leader = torch.tensor([0, 0, 0, 3, 3, 5, 6])
    seen_k, seen_v, seen_valid = k.clone(), v.clone(), valid.clone()
    for row in (1, 2, 4):
        seen_k[row, :, :width] = k[0 if row < 3 else 3, :, :width]
        seen_v[row, :, :width] = v[0 if row < 3 else 3, :, :width]
        seen_valid[row, :width] = valid[0 if row < 3 else 3, :width]
        k[row, :, :width] = float("nan")
        v[row, :, :width] = float("nan")
        valid[row, :width] = torch.rand(width, generator=g) < 0.5
    seen_valid[6, :width] = False  # the filler attends to its own columns only
    cast = lambda t: t.to(dtype).to(DEV)  # noqa: E731
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    prefix = SharedPrefix(torch.tensor([width], device=DEV), i32(starts), i32(counts),
                          torch.tensor([6], device=DEV), max_rows=3)
    assert torch.equal(leader[:6], torch.tensor([0, 0, 0, 3, 3, 5]))
    return (cast(q), cast(k)[:rows], cast(v)[:rows], valid.to(DEV)[:rows], prefix,
            (cast(q), cast(seen_k)[:rows], cast(seen_v)[:rows], seen_valid.to(DEV)[:rows]))


@pytest.mark.parametrize("dtype,hkv,group,dim", [
    (torch.float32, 1, 1, 16), (torch.float32, 2, 3, 16), (torch.bfloat16, 2, 7, 16), (torch.float32, 1, 7, 64)])
def test_shared_prefix_reads_each_segments_first_row_once_and_matches_float64(dtype, hkv, group, dim):
    q, k, v, valid, prefix, seen = _shared_problem(hkv, group, dim, dtype, seed=group)
    for n in (37, 41, 70):  # the prefix alone, a few own columns, the whole cache
        nf = torch.tensor([n], device=DEV)
        exact = _float64(*seen, n)  # every row on the cache it is meant to see
        sdpa = _err(_sdpa(*seen, n), exact)
        for prefix_split, split in ((16, 16), (None, None)):  # 3 prefix splits and 3 own ones; the defaults
            out = decode_attention(q, k, v, valid, nf, shared_prefix=prefix, prefix_split_len=prefix_split,
                                   split_len=split, block_n=16 if split else None)
            assert torch.isfinite(out).all()
            assert _err(out, exact) <= 1.5 * sdpa + (1e-6 if dtype == torch.float32 else 0.0), (n, prefix_split)
        ref = decode_attention_reference(q, k, v, valid, nf, 1 / math.sqrt(dim), shared_prefix=prefix)
        assert _err(ref, exact) <= 1.5 * sdpa + 1e-6


def test_shared_prefix_equals_the_plain_kernel_on_a_replicated_cache():
    from logitless.generation.kernels.decode_attention import shared_prefix_segments

    q, k, v, valid, prefix, (_, seen_k, seen_v, seen_valid) = _shared_problem(2, 3, 16, torch.float32, seed=4)
    nf = torch.tensor([58], device=DEV)
    full = prefix._replace(covered=torch.tensor([7], device=DEV))  # the filler as a segment of its own
    full = full._replace(**dict(zip(("seg_start", "seg_rows"),
                                    shared_prefix_segments(torch.tensor([0, 0, 0, 2, 2, 3, 4], device=DEV), 5))))
    assert full.seg_start.tolist() == [0, 3, 3, 5, 6] and full.seg_rows.tolist() == [3, 0, 2, 1, 1]
    seen_valid = seen_valid.clone()
    seen_valid[6] = valid[6]
    shared = decode_attention(q, k, v, valid, nf, shared_prefix=full, prefix_split_len=16, split_len=32, block_n=16)
    plain = decode_attention(q, seen_k, seen_v, seen_valid, nf, split_len=32, block_n=16)
    torch.testing.assert_close(shared, plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("shared", [False, True], ids=["per_row", "shared_prefix"])
def test_the_last_partial_program_merges_as_the_merge_kernel_does(monkeypatch, shared):
    """The merge inside the partial kernel (the default) writes the merge kernel's output bit for bit,
    over many launches of different split counts and fills, and leaves its counters at zero."""
    if shared:
        q, k, v, valid, prefix, _ = _shared_problem(2, 3, 16, torch.float32, seed=5)
    else:
        q, k, v, valid = _problem(2, 3, 16, 70, torch.float32, seed=5)
        prefix = None
    calls = []
    for n, split in ((70, 16), (41, 16), (38, 32), (70, None), (3, 16)):
        kw = dict(shared_prefix=prefix, prefix_split_len=16 if shared else None, split_len=split,
                  block_n=16 if split else None)
        nf = torch.tensor([n], device=DEV)
        monkeypatch.setattr(da_op, "MERGE_IN_PARTIAL", True)
        merged = decode_attention(q, k, v, valid, nf, **kw)
        monkeypatch.setattr(da_op, "MERGE_IN_PARTIAL", False)
        separate = decode_attention(q, k, v, valid, nf, **kw)
        assert torch.equal(merged, separate), (n, split)
        calls.append(n)
    counters = da_op._ARRIVALS[q.device]
    assert int(counters.abs().sum()) == 0  # every launch set its counts back to zero
    assert da_op._arrivals(q.device, da_op.ARRIVAL_SLOTS + 1) is None  # too many (row, head) pairs: the merge kernel
    assert len(calls) == 5


def test_counters_are_reserved_by_eager_callers_only(monkeypatch):
    """The op never allocates its counters (it may run inside a CUDA graph's memory pool, where a
    buffer that outlives the graph must not live): the eager wrapper and the compiled sampler reserve
    them before the first launch; without them the merge kernel runs, with the same bits."""
    from torchtune.models.qwen2._component_builders import qwen2

    from logitless.generation import CompiledSampler

    monkeypatch.setattr(da_op, "_ARRIVALS", {})
    q, k, v, valid = _problem(2, 3, 16, 70, torch.float32, seed=6)
    nf = torch.tensor([53], device=DEV)
    raw = torch.ops.logitless.decode_attention(q, k, v, valid, nf, 0.25, 16, 16, 0, 0, False)
    assert da_op._ARRIVALS == {}
    eager = decode_attention(q, k, v, valid, nf, scale=0.25, split_len=16, block_n=16)
    assert set(da_op._ARRIVALS) == {q.device}
    assert torch.equal(raw, eager)
    monkeypatch.setattr(da_op, "_ARRIVALS", {})
    torch.manual_seed(0)
    model = qwen2(vocab_size=97, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                  max_seq_len=64, tie_word_embeddings=True).eval().to(DEV)
    sampler = CompiledSampler(compile=False, decode_attention="split_k")
    sampler(model, [[5, 6, 7]], max_new_tokens=3, stop_tokens=[1], pad_id=0, num_generations=2, temperature=0)
    assert set(da_op._ARRIVALS) == {q.device}


def _new_token_problem(kind, hkv, group, dim, length, dtype, seed):
    """An unrotated query and new key and value (views of one projection output, as the q/k/v GEMM
    leaves them), torchtune's rotary module ``kind`` and random positions, over ``_problem``'s caches."""
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import RotaryPositionalEmbeddings

    from logitless.generation.kernels.decode_rotary import rotary_table, rotation_coefficients

    _, k, v, valid = _problem(hkv, group, dim, length, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    hq = hkv * group
    qkv = torch.randn(ROWS, (hq + 2 * hkv) * dim, generator=g).to(dtype).to(DEV)
    q, k_new, v_new = (t.view(ROWS, -1, dim) for t in qkv.split([hq * dim, hkv * dim, hkv * dim], dim=-1))
    module = (RotaryPositionalEmbeddings if kind == "llama" else Qwen2RotaryPositionalEmbeddings)(dim, max_seq_len=96)
    spec = rotary_table(module.to(DEV), dim)
    positions = torch.randint(0, 96, (ROWS,), generator=g).to(DEV)
    token = NewToken(k_new, v_new, *rotation_coefficients(spec, positions, dim, dtype), spec.interleaved)
    return q, k, v, valid, token, spec, positions


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_new_token_is_rotated_written_and_attended_as_the_module_then_the_kernel(kind, dtype):
    """With a NewToken the kernel writes the module's rotated key and the value at column n - 1 (no
    other column), and attends as the plain kernel does to the query the module rotates."""
    from logitless.generation.kernels.decode_rotary import decode_rotary_cache_reference

    for n in (1, 23, 37):  # the only column, inside a split after a full one, the last column
        q, k, v, valid, token, spec, positions = _new_token_problem(kind, 2, 3, 16, 37, dtype, seed=n)
        k_want, v_want = k.clone(), v.clone()
        nf = torch.tensor([n], device=DEV)
        q_rot = decode_rotary_cache_reference(q, token.k, token.v, positions, spec, nf - 1, k_want, v_want)

        out = decode_attention(q, k, v, valid, nf, split_len=16, block_n=16, new_token=token)

        # the same fp32 products, rounded once (the interpreter rounds to nearest even, tests/conftest.py);
        # a GPU may contract the rotation's product and sum into one FMA: fp32 keys then differ in the last bits
        assert torch.equal(v, v_want)
        if DEV == "cpu" or dtype != torch.float32:
            assert torch.equal(k, k_want)
        else:
            torch.testing.assert_close(k, k_want, rtol=4 * torch.finfo(dtype).eps, atol=4 * torch.finfo(dtype).eps)
        exact = _float64(q_rot, k_want, v_want, valid, n)
        plain = decode_attention(q_rot, k_want, v_want, valid, nf, split_len=16, block_n=16)
        # the new column is folded in after the loop, not inside its last block: a rounding apart
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        ours, theirs = _err(out, exact), _err(plain, exact)
        assert ours <= 1.5 * theirs + tolerance * 1e-2, (n, ours, theirs)
        assert _err(out, exact) < tolerance


def test_new_token_arguments_are_named_before_any_compute():
    q, k, v, valid, token, _, _ = _new_token_problem("qwen2", 2, 3, 16, 37, torch.float32, seed=2)
    nf = torch.tensor([5], device=DEV)
    one_segment = (torch.zeros(1, dtype=torch.int32, device=DEV), torch.full((1,), ROWS, dtype=torch.int32, device=DEV))
    prefix = SharedPrefix(nf, *one_segment, torch.tensor([ROWS], device=DEV), ROWS)
    with pytest.raises(ValueError, match="new_token with shared_prefix is not supported"):
        decode_attention(q, k, v, valid, nf, new_token=token, shared_prefix=prefix)
    with pytest.raises(ValueError, match=r"new_token.cos must be contiguous float32 \(3, 16\)"):
        decode_attention(q, k, v, valid, nf, new_token=token._replace(cos=token.cos.double()))
    with pytest.raises(ValueError, match=r"new_token.v must be \(3, 2, 16\)"):
        decode_attention(q, k, v, valid, nf, new_token=token._replace(v=token.v[:, :1]))
    with pytest.raises(ValueError, match="q with a contiguous last dimension"):
        decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, valid, nf, new_token=token)


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(3, 6)), "expected q \\(B, Hq, D\\)"),
    (dict(q=torch.zeros(3, 5, 16)), "Hq a multiple of Hkv"),
    (dict(key_valid=torch.ones(3, 37, dtype=torch.uint8)), "key_valid must be bool"),
    (dict(n_filled=torch.tensor(5)), "n_filled must be an int64 tensor of shape \\(1,\\)"),
    (dict(n_filled=torch.tensor([5], dtype=torch.int32)), "n_filled must be an int64"),
    (dict(q=torch.zeros(3, 6, 16, dtype=torch.float64)), "share one of"),
    (dict(split_len=48), "split_len must be None or a power of two >= 16, got 48"),
    (dict(block_n=8), "block_n must be None or a power of two >= 16, got 8"),
    (dict(split_len=16, block_n=32), "split_len=16 must be a multiple of block_n=32"),
    (dict(num_warps=3), "num_warps must be None or one of"),
    (dict(num_stages=0), "num_stages must be None or an int in \\[1, 8\\], got 0"),
])
def test_bad_arguments_are_named_before_any_compute(change, match):
    args = dict(q=torch.zeros(3, 6, 16), k=torch.zeros(3, 2, 37, 16), v=torch.zeros(3, 2, 37, 16),
                key_valid=torch.ones(3, 37, dtype=torch.bool), n_filled=torch.tensor([5]))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        decode_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("key_valid"), args.pop("n_filled"),
                         **args)


def test_default_split_length_grows_with_rows_from_its_floor():
    for length in (1024, 1536, 3584, 32768):
        splits = [da_plan.default_split_len(rows, 2, length) for rows in (8, 16, 64, 256)]
        assert splits == sorted(splits)  # more rows: longer (or as long) splits, fewer partials to merge
        assert all(da_plan.MIN_SPLIT <= s <= da_plan.MAX_SPLIT and s & (s - 1) == 0 for s in splits)
        # few rows over a cache as long as those measured stop at the floor (a shorter split costs
        # more in the merge than it spreads)
        assert splits[0] == da_plan.MIN_SPLIT or length > 4096
        # many rows aim at PROGRAMS_PER_SM programs per SM of an H200, within a factor of two
        programs = 256 * 2 * -(-length // splits[-1])
        assert splits[-1] == da_plan.MAX_SPLIT or programs <= 2 * da_plan.PROGRAMS_PER_SM * 132 * 2


def test_a_shared_prompt_splits_the_rows_own_columns_finer():
    """After a shared prompt the rows' splits cover only the completions' columns, so the default
    aims at SHARED_PROGRAMS_PER_SM programs per SM over the cache: never a longer split than without
    a prompt, and at the operating points measured on an H200 (64 rows, 1536 columns) 256 columns
    at two K/V heads (Qwen2.5-0.5B/1.5B) and 512 at four (7B)."""
    cpu = torch.device("cpu")
    for rows, hkv, length in itertools.product((16, 32, 64, 128), (2, 4), (640, 1536, 4096)):
        launch = da_plan.resolve_launch(rows, hkv, length, cpu, shared_prompt=True)
        shared = launch.split_len
        assert launch.max_split_len == shared  # a fixed split, not chosen from the fill
        assert shared <= da_plan.launch_split_len(rows, hkv, length, da_plan.BLOCK_N, cpu)  # the rule at one program per SM
        programs = rows * hkv * -(-length // shared)
        assert shared in (da_plan.MIN_SPLIT, da_plan.MAX_SPLIT) or programs <= 2 * da_plan.SHARED_PROGRAMS_PER_SM * 132
    assert da_plan.resolve_launch(64, 2, 1536, cpu, shared_prompt=True)[0] == 256
    assert da_plan.resolve_launch(64, 4, 1536, cpu, shared_prompt=True)[0] == 512


def test_the_split_chosen_from_the_fill_is_the_shortest_within_both_bounds():
    """fill_split_len against its definition, by enumeration: the shortest power of two from the floor
    whose non-empty splits fit FILL_PROGRAMS_PER_SM per SM over the pairs and FILL_MAX_ROW_SPLITS per
    pair, else the longest; it never shortens as the fill or the pairs grow."""
    sms = 132
    budget = da_plan.FILL_PROGRAMS_PER_SM * sms
    for pairs, columns in itertools.product((2, 16, 32, 64, 128, 256, 512), range(1, 8193, 37)):
        got = da_plan.fill_split_len(columns, pairs, sms)
        fits = [s for s in (128, 256, 512)
                if pairs * -(-columns // s) <= budget and -(-columns // s) <= da_plan.FILL_MAX_ROW_SPLITS]
        assert got == (fits[0] if fits else 512), (pairs, columns, got)
        assert got <= da_plan.fill_split_len(columns + 37, pairs, sms) and got <= da_plan.fill_split_len(columns, 2 * pairs, sms)
    # the H200 operating points of FILL_MIN_SPLIT's comment: the best fixed split measured at each
    assert [da_plan.fill_split_len(n, 64 * 2) for n in (192, 384)] == [128, 128]
    assert [da_plan.fill_split_len(n, 64 * 4) for n in (192, 384, 640)] == [256, 512, 512]
    assert [da_plan.fill_split_len(n, 16 * 2) for n in (1024, 3584)] == [128, 512]
    assert [da_plan.fill_split_len(n, 16 * 4) for n in (1024, 3584)] == [256, 512]
    assert [da_plan.fill_split_len(n, 8 * 2) for n in (1024, 2048, 3584)] == [128, 256, 256]
    assert [da_plan.fill_split_len(n, 8 * 4) for n in (1024, 2048, 3584)] == [128, 256, 512]
    launch = da_plan.resolve_launch(64, 2, 640, torch.device("cpu"))
    assert (launch.split_len, launch.max_split_len, launch.fill_steps) == (128, 512, 2)


@pytest.mark.parametrize("merge", [True, False], ids=["merge_in_partial", "merge_kernel"])
def test_the_split_chosen_on_the_device_gives_the_fixed_splits_bits(monkeypatch, merge):
    """Without a given split the kernels choose it from n_filled: one launch configuration (one CUDA
    graph) then runs 16- to 128-column splits as the fill grows, each bit for bit as a launch
    fixed at the split fill_split_len gives, with and without a new token to write, and with the
    per-row bound binding instead of the programs' budget."""
    monkeypatch.setattr(da_op, "MERGE_IN_PARTIAL", merge)
    monkeypatch.setattr(da_plan, "FILL_MIN_SPLIT", 16)
    monkeypatch.setattr(da_plan, "sm_count", lambda device: 1)
    q, k, v, valid = _problem(2, 3, 16, 130, torch.float32, seed=8)
    pairs = ROWS * 2
    chosen = []
    for programs, row_splits in ((3 * pairs, 8), (10_000, 2)):  # the budget binds, then the per-row bound
        monkeypatch.setattr(da_plan, "FILL_PROGRAMS_PER_SM", programs)
        monkeypatch.setattr(da_plan, "FILL_MAX_ROW_SPLITS", row_splits)
        for n in (5, 48, 49, 96, 97, 130):
            nf = torch.tensor([n], device=DEV)
            split = da_plan.fill_split_len(n, pairs, 1, 16, da_plan.MAX_SPLIT)
            chosen.append(split)
            out = decode_attention(q, k, v, valid, nf, block_n=16)
            fixed = decode_attention(q, k, v, valid, nf, split_len=split, block_n=16)
            assert torch.equal(out, fixed), (n, split)
            assert _err(out, _float64(q, k, v, valid, n)) < 1e-6
    assert set(chosen) == {16, 32, 64, 128}
    # the new token: rotated, written and attended in the program holding its column, whichever split that is
    for n in (17, 37, 70):
        qn, kn, vn, valid_n, token, _, _ = _new_token_problem("qwen2", 2, 3, 16, 70, torch.float32, seed=n)
        k_fixed, v_fixed = kn.clone(), vn.clone()
        nf = torch.tensor([n], device=DEV)
        split = da_plan.fill_split_len(n, pairs, 1, 16, da_plan.MAX_SPLIT)
        out = decode_attention(qn, kn, vn, valid_n, nf, block_n=16, new_token=token)
        fixed = decode_attention(qn, k_fixed, v_fixed, valid_n, nf, split_len=split, block_n=16, new_token=token)
        assert torch.equal(out, fixed) and torch.equal(kn, k_fixed) and torch.equal(vn, v_fixed), (n, split)


_COMPILE_FOR_H200 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from logitless.generation.kernels.decode_attention import kernels as da_kernels, plan as da_plan
# the programmatic-launch build (gdc_wait, launch_pdl) is what an H200 runs; the plain one other GPUs
for dtype, dim, group, pdl in (("bf16", 128, 7, True), ("bf16", 64, 7, True), ("fp16", 128, 6, False),
                               ("fp32", 64, 3, False)):
    pointers = {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "out_ptr": dtype, "k_new_ptr": dtype,
                "v_new_ptr": dtype, "valid_ptr": "i1", "n_ptr": "i64",
                "col0_ptr": "i64", "width_ptr": "i64", "covered_ptr": "i64", "seg_start_ptr": "i32",
                "seg_rows_ptr": "i32", "arrivals_ptr": "i32"}
    wide = dtype == "fp32"
    for prefix in (False, True):
        shapes = dict(G=group, G_PAD=16, D=dim, D_PAD=dim, NUM_SLOTS=6 + 4 * prefix, SLOT0=4 * prefix,
                      SPLIT_LEN=256, PREFIX_SPLIT_LEN=128, HAS_PREFIX=prefix, PDL=pdl)
        # the partial kernel with the merge of the row's last program inside (the default launch),
        # without a shared prefix also with a new token to rotate and write (both pairings)
        # without a prefix the split is chosen from the fill (the default launch)
        fill = dict(FILL_STEPS=0 if prefix else 2, MAX_ROW_SPLITS=da_plan.FILL_MAX_ROW_SPLITS)
        partial = dict(BLOCK_N=da_plan.BLOCK_N, WIDE_DOT=wide, MERGE=True, ROTARY=False, INTERLEAVED=False, **fill)
        kernels = [(da_kernels.decode_partial_kernel, partial, da_plan.NUM_WARPS),
                   (da_kernels.decode_merge_kernel, fill, 4)]
        if not prefix:
            kernels += [(da_kernels.decode_partial_kernel, dict(partial, ROTARY=True, INTERLEAVED=pair),
                         da_plan.NUM_WARPS) for pair in (False, True)]
        if prefix:
            m_pad = triton.next_power_of_2(da_plan.MAX_PREFIX_QUERIES // group * group)
            kernels.append((da_kernels.decode_prefix_kernel, dict(M_PAD=m_pad, SPLIT_LEN=128,
                                                                  BLOCK_N=da_plan.PREFIX_BLOCK_N, WIDE_DOT=wide),
                            da_plan.PREFIX_NUM_WARPS))
        for kernel, extra, warps in kernels:
            constexprs = {k: v for k, v in {**shapes, **extra}.items() if k in kernel.arg_names}
            signature = {name: "constexpr" if name in constexprs else
                         "*" + pointers.get(name, "fp32") if name.endswith("_ptr") else
                         "fp32" if name == "scale" else "i32" for name in kernel.arg_names}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": da_plan.NUM_STAGES, "launch_pdl": pdl})
            assert compiled.asm["cubin"], (kernel.__name__, dtype, dim, group)
            assert compiled.metadata.shared <= 227 * 1024, (kernel.__name__, compiled.metadata.shared)
print("compiled")
"""


def test_kernels_compile_for_an_h200(compile_for_sm90):
    """The interpreter does not compile: the kernels are built for sm_90 as on a GPU (Triton's
    own ptxas, no device needed; in a fresh process without the interpreter), at Qwen2.5 head
    shapes and each dtype, so a change that only a GPU compile rejects fails here too."""
    compile_for_sm90(_COMPILE_FOR_H200)
