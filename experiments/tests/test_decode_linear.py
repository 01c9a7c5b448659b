"""The decode step's linear layers (``experiments/decode_linear.py``) against float64, in the
interpreter at small odd shapes (CUDA on a GPU), and built for sm_90 as an H200 runs them."""

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from decode_linear import DecodeLinearLaunch, decode_linear, decode_linear_launch, decode_linear_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPERIMENTS = Path(__file__).resolve().parents[1]


def _problem(rows, n, k, *, gated=False, bias=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(2 * n if gated else n, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    return x, w, b


# (rows, n, k, launch): one span, several spans that divide K, spans whose last one is short
CASES = [(5, 40, 70, DecodeLinearLaunch(32, 32, 96, 4, 2)),
         (17, 33, 256, DecodeLinearLaunch(32, 64, 128, 4, 2)),
         (3, 50, 600, DecodeLinearLaunch(32, 64, 192, 4, 2)),
         (1, 16, 37, DecodeLinearLaunch(16, 16, 16, 4, 1))]


@pytest.mark.parametrize("rows,n,k,launch", CASES, ids=["one-span", "even-spans", "short-last-span", "16-wide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_matches_float64_at_least_as_well_as_f_linear(rows, n, k, launch, dtype, bias):
    x, w, b = _problem(rows, n, k, bias=bias, dtype=dtype)
    got = decode_linear(x, w, b, launch=launch)
    want = decode_linear_reference(x, w, b)
    plain = F.linear(x, w, b)
    assert got.shape == (rows, n) and got.dtype == dtype
    err, plain_err = (got.double() - want).abs().max().item(), (plain.double() - want).abs().max().item()
    # one rounding to the output dtype at most (fp32 sums: a few ulps of the K-term dot product)
    assert err <= max(plain_err, 1e-5 * want.abs().max().item()), (err, plain_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,n,k", [(7, 24, 300), (16, 40, 96), (2, 9, 33)])
def test_gated_product_is_silu_gate_times_up_rounded_once(rows, n, k, dtype):
    x, w, _ = _problem(rows, n, k, gated=True, dtype=dtype, seed=1)
    launch = DecodeLinearLaunch(16, 32, -(-k // 32) * 32, 4, 2)
    got = decode_linear(x, w, gated=True, launch=launch)
    want = decode_linear_reference(x, w, gated=True)
    gate, up = F.linear(x, w).chunk(2, dim=-1)  # the unfused path: each product rounded, then the activation
    plain = F.silu(gate) * up
    assert got.shape == (rows, n) and got.dtype == dtype
    err, plain_err = (got.double() - want).abs().max().item(), (plain.double() - want).abs().max().item()
    assert err <= max(plain_err, 1e-5 * want.abs().max().item()), (err, plain_err)


def test_default_launch_follows_its_rule():
    """Spans tile K; a gated product is one span; at 64 rows the fp32 partial sums stay under a quarter
    of the weight bytes and the rows' inputs at half a program's weight block; about two programs an
    SM where that allows; the pipeline fits in shared memory at 128 rows."""
    for n, k, gated in [(2048, 1536, False), (1536, 1536, False), (8960, 1536, True), (1536, 8960, False),
                        (1152, 896, False), (896, 4864, False), (18944, 3584, True), (37, 70, False)]:
        launch = decode_linear_launch(n, k, gated, num_sms=132)
        splits, blocks = launch.splits(k), -(-n // launch.block_n)
        assert launch.span % launch.block_k == 0 and (splits - 1) * launch.span < k <= splits * launch.span
        assert splits == 1 or not gated
        weight_rows = launch.block_n * (2 if gated else 1)
        if splits > 1:
            assert splits * 64 * n * 4 <= 0.25 * n * k * 2, (n, k, launch)
        assert 64 * launch.block_k <= 0.5 * weight_rows * launch.block_k or n < launch.block_n
        assert blocks * splits >= min(2 * 132, blocks * (1 if gated else max(1, k // 512))) * 0.75, (n, k, launch)
        assert launch.num_stages * (weight_rows + 128) * launch.block_k * 2 <= 192 * 1024


def test_under_torch_compile_the_split_sum_is_traced_with_the_op():
    x, w, b = _problem(9, 48, 320, bias=True)
    launch = DecodeLinearLaunch(16, 32, 128, 4, 2)  # three spans: fp32 partials summed outside the op
    compiled = torch.compile(lambda x, w, b: decode_linear(x, w, b, launch=launch) + 1.0, backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b), decode_linear(x, w, b, launch=launch) + 1.0, rtol=0, atol=0)


@pytest.mark.parametrize("call,match", [
    (lambda x, w: decode_linear(x[:, :5].T, w), "x: expected"),
    (lambda x, w: decode_linear(torch.zeros(129, 8, device=DEVICE), w[:, :8]), "at most 128 rows"),
    (lambda x, w: decode_linear(x, w.double()), "weight: expected"),
    (lambda x, w: decode_linear(x, w[:, :-1]), "weight: expected"),
    (lambda x, w: decode_linear(x, w[:-1], gated=True), "gated: expected an even number"),
    (lambda x, w: decode_linear(x, w, torch.zeros(3, device=DEVICE)), "bias: expected"),
    (lambda x, w: decode_linear(x, w, gated=True, launch=DecodeLinearLaunch(16, 16, 16, 4, 1)), "at least K"),
    (lambda x, w: decode_linear(x, w, launch=DecodeLinearLaunch(16, 32, 48, 4, 1)), "multiple of block_k"),
])
def test_bad_arguments_are_named(call, match):
    x, w, _ = _problem(4, 8, 32)
    with pytest.raises(ValueError, match=match):
        call(x, w)


_COMPILE_FOR_H200 = f"import sys\nsys.path.insert(0, {str(EXPERIMENTS)!r})\n" + """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from decode_linear import decode_linear_kernel as kernel, decode_linear_launch
# the decode products of Qwen2.5-1.5B at 64 rows, with the default tilings, as an H200 builds them
for n, k, gated, bias, dtype, pdl in ((2048, 1536, False, True, "bf16", True), (1536, 1536, False, False, "bf16", True),
                                      (8960, 1536, True, False, "bf16", True), (1536, 8960, False, False, "bf16", True),
                                      (1536, 8960, False, False, "fp32", False)):
    launch = decode_linear_launch(n, k, gated)
    constexprs = dict(HAS_BIAS=bias, GATED=gated, PRECISION="ieee" if dtype == "fp32" else "tf32",
                      EVEN_K=k % launch.span == 0, PDL=pdl, BLOCK_M=64, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k)
    out = "fp32" if launch.splits(k) > 1 else dtype
    pointers = {"x_ptr": dtype, "w_ptr": dtype, "bias_ptr": dtype, "out_ptr": out}
    signature = {name: "constexpr" if name in constexprs else "*" + pointers[name] if name.endswith("_ptr") else "i32"
                 for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages, "launch_pdl": pdl})
    assert compiled.asm["cubin"], (n, k, gated, dtype)
    assert compiled.metadata.shared <= 227 * 1024, (n, k, compiled.metadata.shared)
print("compiled")
"""


def test_kernel_compiles_for_an_h200(compile_for_sm90):
    """Built for sm_90 with Triton's own ptxas (no device needed), at Qwen2.5-1.5B's decode products."""
    compile_for_sm90(_COMPILE_FOR_H200)
