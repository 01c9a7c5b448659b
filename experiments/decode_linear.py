"""The decode step's linear layers for a few rows: ``x @ W.T`` spread over every SM.

A decode step multiplies a handful of rows (the live rows of a bucket, at most 64 or so) by each
weight matrix once, so its GEMMs are weight reads: at Qwen2.5-1.5B and 64 rows an H200 could read a
layer's weights in about 22 us, and cuBLAS took 42.5 us, its 64-row kernels leaving SMs idle
(gate/up: 102 tiles of 176 columns on 132 SMs; q/k/v and output at a quarter of the bandwidth).
Here one kernel, grid ``(column blocks, K spans)``, chooses both so that every SM streams weights:

* each program computes ``W[cols] @ x[:, span].T`` for one block of output columns and one span of
  the reduction dimension (``tl.dot`` with the weight block as the wide operand, so a few rows still
  map onto the tensor cores' 64-row instructions);
* with several spans (split-K) each writes fp32 partial sums ``(spans, M, N)`` that the caller adds
  (:func:`decode_linear` does; under ``torch.compile`` the sum fuses into the next pointwise op);
* ``gated``: the weight is ``[gate; up]`` (``2N x K``, as ``FusedProjections`` concatenates the MLP's
  w1 and w3) and the program returns ``silu(x W_gate.T) * (x W_up.T)`` for its columns (fp32, one
  rounding), so the MLP's activation never makes a round trip through memory;
* a bias (q/k/v of Qwen2) is added by the first span.

fp32 inputs multiply in IEEE fp32 (no TF32), so the fp32 decode step keeps cuBLAS's accuracy.

An experiment, not part of the package: built into the compiled sampler's decode step (q/k/v,
output, gate/up with the activation, down) it was slower than cuBLAS on an H200 (Qwen2.5-1.5B, 64
rows: 2.79 ms a step against 2.43 ms, ``results/generation_decode_linear_h200.csv``), so the sampler
runs cuBLAS only. ``bench_decode_linear.py`` times the products alone; ``tests/test_decode_linear.py``
checks them against float64.

Example:
    >>> x = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    >>> w = torch.randn(17920, 1536, device="cuda", dtype=torch.bfloat16)
    >>> act = decode_linear(x, w, gated=True)  # (64, 8960): silu(x @ w[:8960].T) * (x @ w[8960:].T)
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from logitless._platform import sm_count, triton_interpreting
from logitless.generation.kernels.decode_attention import supports_programmatic_launch
from logitless.ops.triton.gemm_epilogues import _dot, _precision

__all__ = ["DecodeLinearLaunch", "decode_linear", "decode_linear_launch", "decode_linear_reference"]

#: Rows a launch takes at most (one row block); more rows fall back to ``F.linear`` in the caller.
MAX_ROWS = 128


class DecodeLinearLaunch(NamedTuple):
    """How :func:`decode_linear` tiles one product: ``block_n`` output columns and ``span`` reduction
    columns (a multiple of ``block_k``) per program."""

    block_n: int
    block_k: int
    span: int
    num_warps: int
    num_stages: int

    def splits(self, k: int) -> int:
        return triton.cdiv(k, self.span)


@triton.jit
def decode_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, SPAN, stride_xm, stride_wn, stride_os,
                         stride_om, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr,
                         EVEN_K: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """``out[span] = x[:, span] @ W[cols, span].T`` (gated: ``silu(gate) * up``) for one column block
    and one span. ``PDL``: launched as a programmatic dependent launch; the program reads its first
    weight block (which no earlier kernel writes) before it waits for the kernel that wrote ``x``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    k0 = pid_k * SPAN
    k_end = tl.minimum(K, k0 + SPAN)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :]  # (BLOCK_M, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :]  # (BLOCK_N, BLOCK_K)
    up_offset = N.to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # the first block, peeled: its weights are read before the wait
    first_ok = col_ok[:, None] & ((k0 + ks) < k_end)[None, :]
    w = tl.load(w_ptrs, mask=first_ok, other=0.0)
    if GATED:
        w_up = tl.load(w_ptrs + up_offset, mask=first_ok, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    xt = tl.trans(tl.load(x_ptrs, mask=row_ok[:, None] & ((k0 + ks) < k_end)[None, :], other=0.0))
    acc = _dot(w, xt, acc, PRECISION)
    if GATED:
        acc_up = _dot(w_up, xt, acc_up, PRECISION)
    for k in range(BLOCK_K, SPAN, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        if EVEN_K:  # every span lies inside K: no column mask on the weight stream
            xt = tl.trans(tl.load(x_ptrs, mask=row_ok[:, None], other=0.0))
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            if GATED:
                w_up = tl.load(w_ptrs + up_offset, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + k + ks) < k_end
            xt = tl.trans(tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0))
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if GATED:
                w_up = tl.load(w_ptrs + up_offset, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(w, xt, acc, PRECISION)
        if GATED:
            acc_up = _dot(w_up, xt, acc_up, PRECISION)
    if PDL:  # the next kernel may launch now; it waits for this grid to finish before reading
        tl.extra.cuda.gdc_launch_dependents()
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_ptrs = out_ptr + pid_k * stride_os + rows[None, :] * stride_om + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & col_ok[:, None])


def decode_linear_launch(n: int, k: int, gated: bool = False, num_sms: int = 132) -> DecodeLinearLaunch:
    """The tiling of a product with ``n`` output columns (gated: per half) over ``k`` input columns.
    It does not depend on the row count (a symbolic size in the compiled decode step).

    Every program reads the rows' inputs over its span as well as its weight block, so column blocks
    are wide: 128 weight rows per program (64 gated columns: gate and up), which keeps the input at
    half the weight bytes for 64 rows. The reduction is split to reach about two programs per SM,
    but at most ``k / 512`` ways, which keeps the fp32 partial sums of 64 rows under a quarter of the
    weight bytes; a gated product is not split (its activation needs the whole sum). Pipeline
    stages: as many as fit in 192 KiB of shared memory at 128 rows, at most 4.

    Example:
        >>> decode_linear_launch(1536, 8960)
        DecodeLinearLaunch(block_n=128, block_k=64, span=576, num_warps=4, num_stages=4)
    """
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    block_n = 64 if gated else 128
    blocks = triton.cdiv(n, block_n)
    splits = 1 if gated else max(1, min(k // 512, triton.cdiv(2 * num_sms, blocks)))
    span = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    stage_bytes = (block_n * (2 if gated else 1) + MAX_ROWS) * block_k * 2
    return DecodeLinearLaunch(block_n, block_k, span, num_warps=4, num_stages=max(1, min(4, 192 * 1024 // stage_bytes)))


@torch.library.custom_op("logitless::decode_linear", mutates_args=())
def _decode_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], gated: bool, block_n: int, block_k: int,
                      span: int, num_warps: int, num_stages: int, programmatic: bool) -> Tensor:
    """``(splits, M, N)``: fp32 partial sums when ``splits > 1``, else ``x``'s dtype; see :func:`decode_linear`."""
    m, k = x.shape
    n = weight.shape[0] // (2 if gated else 1)
    splits = triton.cdiv(k, span)
    out = torch.empty(splits, m, n, device=x.device, dtype=torch.float32 if splits > 1 else x.dtype)
    pdl = programmatic and supports_programmatic_launch(x.device)
    if m and n:
        grid = (triton.cdiv(n, block_n), splits)
        decode_linear_kernel[grid](
            x, weight, bias if bias is not None else x, out, m, n, k, span, x.stride(0), weight.stride(0),
            out.stride(0), out.stride(1), HAS_BIAS=bias is not None, GATED=gated, PRECISION=_precision(x.dtype),
            EVEN_K=k % span == 0, PDL=pdl, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl)
    return out


@_decode_linear_op.register_fake
def _(x, weight, bias, gated, block_n, block_k, span, num_warps, num_stages, programmatic):
    n = weight.shape[0] // (2 if gated else 1)
    splits = -(-x.shape[1] // span)
    return x.new_empty(splits, x.shape[0], n, dtype=torch.float32 if splits > 1 else x.dtype)


def decode_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, gated: bool = False,
                  launch: Optional[DecodeLinearLaunch] = None, programmatic: bool = False) -> Tensor:
    """``F.linear(x, weight, bias)`` for a few rows, or the gated MLP activation, in one launch.

    Args:
        x (Tensor): ``(M, K)`` rows, ``M <= 128`` (fp32, bf16 or fp16; rows contiguous).
        weight (Tensor): ``(N, K)`` (``(2N, K)``, gate rows first, when ``gated``), ``x``'s dtype,
            rows contiguous.
        bias (Optional[Tensor]): ``(N,)`` or None (not with ``gated``).
        gated (bool): return ``silu(x @ weight[:N].T) * (x @ weight[N:].T)``.
        launch (Optional[DecodeLinearLaunch]): the tiling; None = :func:`decode_linear_launch` for
            ``x``'s device (pass it under ``torch.compile``: the default reads the device's SM count).
        programmatic (bool): a programmatic dependent launch where the GPU has them
            (:func:`~logitless.generation.kernels.decode_attention.supports_programmatic_launch`).

    Returns:
        Tensor: ``(M, N)`` in ``x``'s dtype.

    Raises:
        ValueError: on shapes, dtypes or devices the kernel does not take.

    Example:
        >>> qkv = decode_linear(h, w_qkv, b_qkv)  # h: (64, 1536) bf16, w_qkv: (2048, 1536)
    """
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x: expected (M, K) fp32/bf16/fp16 with contiguous rows, got shape {tuple(x.shape)}, "
                         f"strides {x.stride()}, dtype {x.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"x: at most {MAX_ROWS} rows, got {x.shape[0]} (use F.linear)")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.stride(1) != 1 or weight.dtype != x.dtype:
        raise ValueError(f"weight: expected ({'2N' if gated else 'N'}, {x.shape[1]}) {x.dtype} with contiguous rows, "
                         f"got shape {tuple(weight.shape)}, strides {weight.stride()}, dtype {weight.dtype}")
    if gated and (weight.shape[0] % 2 or bias is not None):
        raise ValueError(f"gated: expected an even number of weight rows and no bias, got {weight.shape[0]} rows, "
                         f"bias {'given' if bias is not None else None}")
    n = weight.shape[0] // (2 if gated else 1)
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(f"bias: expected ({n},) {x.dtype} contiguous, got {tuple(bias.shape)} {bias.dtype}")
    devices = {t.device for t in (x, weight, bias) if t is not None}
    if len(devices) != 1 or not (x.is_cuda or triton_interpreting()):
        raise ValueError(f"x, weight and bias must be on one CUDA device (or CPU under TRITON_INTERPRET=1), "
                         f"got {sorted(map(str, devices))}")
    launch = launch or decode_linear_launch(n, x.shape[1], gated, sm_count(x.device))
    if launch.span % launch.block_k or (gated and launch.span < x.shape[1]):
        raise ValueError(f"launch: span {launch.span} must be a multiple of block_k {launch.block_k}"
                         f"{f' and, gated, at least K = {x.shape[1]}' if gated else ''}")
    out = _decode_linear_op(x, weight, bias, gated, *launch, programmatic)
    return out[0] if out.shape[0] == 1 else out.sum(0).to(x.dtype)


def decode_linear_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
                            gated: bool = False) -> Tensor:
    """:func:`decode_linear` in float64 PyTorch (returned in float64), for tests and benchmarks."""
    x, weight = x.double(), weight.double()
    if not gated:
        return torch.nn.functional.linear(x, weight, None if bias is None else bias.double())
    gate, up = (x @ weight.T).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
