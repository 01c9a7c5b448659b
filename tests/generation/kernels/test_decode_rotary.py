"""The decode step's rotary embedding and cache write (``logitless.generation.kernels.decode_rotary``) against
torchtune's own rotary modules, in the interpreter at small odd shapes (CUDA on a GPU)."""

import copy

import pytest
import torch
from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.phi3._position_embeddings import Phi3RotaryPositionalEmbeddings
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import RotaryPositionalEmbeddings

from logitless.generation.kernels.decode_rotary import (decode_rotary_cache, decode_rotary_cache_reference, rotary_table,
                                                rotation_coefficients)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODULES = {
    "llama": lambda d: RotaryPositionalEmbeddings(d, max_seq_len=64),
    "llama3_scaled": lambda d: Llama3ScaledRoPE(d, max_seq_len=64),
    "qwen2": lambda d: Qwen2RotaryPositionalEmbeddings(d, max_seq_len=64),
    "phi3": lambda d: Phi3RotaryPositionalEmbeddings(d, max_seq_len=64),
}


def _problem(b, hq, hkv, d, length, dtype, seed):
    """q, k, v as views of one projection output (as the fused q/k/v GEMM leaves them), random
    positions, a column and caches of random values (the untouched columns must stay as they were)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEVICE)
    q, k, v = (t.view(b, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    positions = torch.randint(0, 64, (b,), generator=g).to(DEVICE)
    col = torch.randint(0, length, (1,), generator=g).to(DEVICE)
    k_cache = torch.randn(b, hkv, length, d, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(b, hkv, length, d, generator=g).to(dtype).to(DEVICE)
    return q, k, v, positions, col, k_cache, v_cache


def _module_rotation(module, x, positions, dtype):
    """torchtune's module on ``(B, H, D)`` rows at their positions, computed in ``dtype``."""
    return module(x.to(dtype)[:, None], input_pos=positions[:, None])[:, 0]


def _exact_rotation(module, x, positions):
    """The module's rotation in float64: its table as the module multiplies by it (Qwen2's cast to
    the input dtype first), every product and sum exact."""
    exact = copy.deepcopy(module)
    table = exact.cache.to(x.dtype) if isinstance(module, Qwen2RotaryPositionalEmbeddings) else exact.cache
    exact.cache = table.double()
    return _module_rotation(exact, x, positions, torch.float64).double()


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,hq,hkv,d", [(3, 7, 1, 16), (5, 6, 2, 12), (2, 4, 4, 8)],
                         ids=["group7", "half6", "mha"])
def test_matches_the_module_at_least_as_well_as_eager(kind, dtype, b, hq, hkv, d):
    module = MODULES[kind](d).to(DEVICE)
    spec = rotary_table(module, d)
    assert spec is not None
    q, k, v, positions, col, k_cache, v_cache = _problem(b, hq, hkv, d, 11, dtype, seed=hq * d)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    q_rot = decode_rotary_cache(q, k, v, positions, spec, col, k_cache, v_cache)

    c = col.item()
    assert q_rot.shape == (b, hq, d) and q_rot.dtype == dtype and q_rot.is_contiguous()
    for got, x in ((q_rot, q), (k_cache[:, :, c], k)):
        exact = _exact_rotation(module, x, positions)
        eager = _module_rotation(module, x, positions, dtype).double()
        err, eager_err = (got.double() - exact).norm().item(), (eager - exact).norm().item()
        # one rounding of the fp32 result to the dtype (eager in bf16 rounds the products too)
        assert err <= 1.25 * eager_err + 1e-7 * exact.norm().item(), (kind, err, eager_err)
    assert torch.equal(v_cache[:, :, c], v)
    others = torch.arange(11, device=DEVICE) != c
    assert torch.equal(k_cache[:, :, others], k_before[:, :, others])
    assert torch.equal(v_cache[:, :, others], v_before[:, :, others])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_reference_gives_the_kernels_values(kind):
    d = 12
    spec = rotary_table(MODULES[kind](d).to(DEVICE), d)
    q, k, v, positions, col, k_cache, v_cache = _problem(4, 6, 2, d, 9, torch.bfloat16, seed=3)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    got = decode_rotary_cache(q, k, v, positions, spec, col, k_cache, v_cache)
    want = decode_rotary_cache_reference(q, k, v, positions, spec, col, ref_k, ref_v)
    # the same fp32 arithmetic rounded once: equal up to the order of a product's terms (one ulp)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(k_cache, ref_k, rtol=8e-3, atol=1e-5)
    assert torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotation_coefficients_rotate_as_the_module_at_least_as_well_as_eager(kind, dtype):
    """x cos + x_partner sin with the per-row coefficients (the attention kernel's rotation of a
    NewToken) against the module's rotation in float64."""
    from logitless.generation.kernels.decode_attention.reference import _rotate_reference

    d = 12
    module = MODULES[kind](d).to(DEVICE)
    spec = rotary_table(module, d)
    q, _, _, positions, _, _, _ = _problem(5, 6, 2, d, 4, dtype, seed=7)
    cos, sin = rotation_coefficients(spec, positions, d, dtype)
    assert cos.shape == sin.shape == (5, d) and cos.dtype == sin.dtype == torch.float32
    got = _rotate_reference(q, cos, sin, spec.interleaved)
    exact = _exact_rotation(module, q, positions)
    eager = _module_rotation(module, q, positions, dtype).double()
    err, eager_err = (got.double() - exact).norm().item(), (eager - exact).norm().item()
    assert err <= 1.25 * eager_err + 1e-7 * exact.norm().item(), (kind, err, eager_err)


def test_rotary_table_only_for_modules_it_reproduces():
    class Shifted(Qwen2RotaryPositionalEmbeddings):  # a subclass may change forward: not taken
        pass

    assert rotary_table(None, 8) is None
    assert rotary_table(nn.Identity(), 8) is None
    assert rotary_table(Shifted(8, max_seq_len=16), 8) is None
    assert rotary_table(Qwen2RotaryPositionalEmbeddings(8, max_seq_len=16), 16) is None  # another head size
    assert rotary_table(RotaryPositionalEmbeddings(8, max_seq_len=16), 6) is None
    llama = rotary_table(RotaryPositionalEmbeddings(8, max_seq_len=16), 8)
    assert (llama.stride_pos, llama.stride_pair, llama.sin_offset, llama.interleaved, llama.round_table) == \
        (8, 2, 1, True, False)
    phi3 = rotary_table(Phi3RotaryPositionalEmbeddings(8, max_seq_len=16), 8)
    assert (phi3.stride_pos, phi3.sin_offset, phi3.interleaved, phi3.round_table) == (16, 8, False, False)


def test_bad_inputs_are_refused_naming_the_argument():
    d = 8
    spec = rotary_table(Qwen2RotaryPositionalEmbeddings(d, max_seq_len=16).to(DEVICE), d)
    q, k, v, positions, col, k_cache, v_cache = _problem(2, 4, 2, d, 5, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"positions must be int64 of shape \(2,\), got torch.int64 \(2, 1\)"):
        decode_rotary_cache(q, k, v, positions[:, None], spec, col, k_cache, v_cache)
    with pytest.raises(ValueError, match="col must be an int64 tensor of shape"):
        decode_rotary_cache(q, k, v, positions, spec, col.int(), k_cache, v_cache)
    with pytest.raises(ValueError, match="v_cache must be"):
        decode_rotary_cache(q, k, v, positions, spec, col, k_cache, v_cache[:, :1])
    with pytest.raises(ValueError, match="contiguous last dimension"):
        decode_rotary_cache(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, positions, spec, col, k_cache,
                            v_cache)
    with pytest.raises(ValueError, match="must share one of"):
        decode_rotary_cache(q, k.double(), v.double(), positions, spec, col, k_cache.double(), v_cache.double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (12, 2, 128), (28, 4, 128)], ids=["0.5b", "1.5b", "7b"])
def test_qwen2_5_shapes_in_a_cuda_graph_with_programmatic_launch(hq, hkv, d):
    """Qwen2.5's decode shapes at 64 rows in bf16, launched as the compiled step launches it (a
    programmatic launch inside a CUDA graph), against the same launch outside the graph."""
    module = Qwen2RotaryPositionalEmbeddings(d, max_seq_len=4096).cuda()
    spec = rotary_table(module, d)
    q, k, v, _, _, k_cache, v_cache = _problem(64, hq, hkv, d, 1536, torch.bfloat16, seed=d)
    positions = torch.randint(1024, 1536, (64,), device="cuda")
    col = torch.tensor([1400], device="cuda")
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = decode_rotary_cache(q, k, v, positions, spec, col, eager_k, eager_v, programmatic=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = decode_rotary_cache(q, k, v, positions, spec, col, k_cache, v_cache, programmatic=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want) and torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
    exact = _exact_rotation(module, q, positions)
    eager = _module_rotation(module, q, positions, torch.bfloat16).double()
    assert (got.double() - exact).norm() <= 1.25 * (eager - exact).norm()


_COMPILE_FOR_H200 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from logitless.generation.kernels.decode_rotary import decode_rotary_cache_kernel as kernel
# Qwen2.5-0.5B / 1.5B / 7B heads and a Llama 3 head, as an H200 builds them
for hq, hkv, d, interleaved, dtype, pdl in ((14, 2, 64, False, "bf16", True), (12, 2, 128, False, "bf16", True),
                                            (28, 4, 128, False, "bf16", True), (32, 8, 128, True, "bf16", True),
                                            (12, 2, 128, False, "fp32", False)):
    constexprs = dict(HQ=hq, HKV=hkv, HQ_PAD=triton.next_power_of_2(hq), HKV_PAD=max(2, triton.next_power_of_2(hkv)),
                      HALF=d // 2, HALF_PAD=d // 2, INTERLEAVED=interleaved, ROUND_TABLE=not interleaved, PDL=pdl)
    pointers = {"pos_ptr": "i64", "col_ptr": "i64", "table_ptr": "fp32"}
    signature = {name: "constexpr" if name in constexprs else "*" + pointers.get(name, dtype)
                 if name.endswith("_ptr") else "i32" for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 1, "launch_pdl": pdl})
    assert compiled.asm["cubin"], (hq, hkv, d, dtype)
print("compiled")
"""


def test_kernel_compiles_for_an_h200(compile_for_sm90):
    """Built for sm_90 with Triton's own ptxas (no device needed)."""
    compile_for_sm90(_COMPILE_FOR_H200)
