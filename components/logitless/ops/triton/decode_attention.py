"""Split-K (flash-decoding) attention of one new query token per row over a static KV cache.

The compiled sampler's decode step attends one new token per row to a cache of fixed length ``L``
of which only the first ``n_filled`` columns hold keys. SDPA's decode kernels stream a row's whole
window in one program, so their time follows the window, not the rows or the filled length. Here
the cache is cut into splits of ``split_len`` columns, on a grid that depends on the shapes only:

* ``decode_partial_kernel``, grid ``(B, Hkv, num_splits)``: one program per (row, K/V head,
  split) reads its split's keys and values once for all ``G`` query heads that share the K/V head
  (torchtune's order: query head ``h`` reads K/V head ``h // G``), up to ``n_filled`` only, and
  keeps an fp32 online softmax: the running max ``m``, the sum ``l`` of ``exp(s - m)`` and the
  weighted sum ``acc`` of the values, written to an fp32 workspace. A split that starts at or
  beyond ``n_filled`` loads and writes nothing: the merge never reads it. A split whose keys are
  all masked (left padding) writes the empty partial ``m = -inf``, ``l = 0``, ``acc = 0``.
* ``decode_merge_kernel``, grid ``(B, Hkv)``: merges the splits below ``cdiv(n_filled, split_len)``
  (the non-empty ones) of the ``G`` query heads into ``acc / l`` in the query's dtype; a row with
  no valid key at all gets 0, as SDPA gives for a fully masked row.

``n_filled`` is a ``(1,)`` device tensor read by the kernels, so nothing on the host depends on it:
no sync, and one CUDA graph serves every step. The op ``logitless::decode_attention`` is an opaque
``torch.library`` custom op (a ``triton_op`` would let inductor see the kernels, but its traceable
wrapper does not take the interpreter's kernels, so CPU tests could not compile it):
``torch.compile`` captures it in the decode step without a graph break, and inductor hands it the
cache buffers themselves (no copy). Off CUDA it runs :func:`decode_attention_reference` (plain
PyTorch) unless the Triton interpreter is requested (``TRITON_INTERPRET=1``, how the tests run the
kernels on CPU tensors).

The launch parameters were chosen for an H200 at Qwen2.5 shapes (head_dim 64 and 128, caches up to
a few thousand columns): the split length's floor (``MIN_SPLIT``) from a sweep at 8-64 rows, the
block, stages and programs per SM from a sweep at 16 and 64 rows, the warps a guess. On Hopper the
kernels are programmatic dependent launches (:func:`supports_programmatic_launch`): the partial
kernel is scheduled while the kernel before it (the query's rotary embedding) finishes, the merge
while the partials finish.

Example:
    >>> q = torch.randn(8, 14, 64, device="cuda", dtype=torch.bfloat16)          # (B, Hq, D)
    >>> k = torch.randn(64, 2, 1536, 64, device="cuda", dtype=torch.bfloat16)    # a bigger cache
    >>> v = torch.randn_like(k)
    >>> valid = torch.ones(64, 1536, dtype=torch.bool, device="cuda")
    >>> n = torch.tensor([1100], device="cuda")
    >>> out = decode_attention(q, k[:8], v[:8], valid[:8], n)                      # (8, 14, 64)
"""

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from logitless.ops.dispatch import _interpreting

__all__ = ["decode_attention", "decode_attention_reference", "default_split_len", "launch_split_len",
           "resolve_launch", "supports_programmatic_launch"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The partial kernel's default launch: columns per inner-loop block, warps per program and
#: software-pipeline stages. Best geometric mean over Qwen2.5-0.5B/1.5B/7B heads, 16 and 64 rows,
#: 1088 and 3584 filled columns on an H200 among block 32/64/128 x 2/3 stages
#: (``benchmarks/results/decode_attention_launch_h200.csv``): 0.86x the former 64 x 3 at head_dim 64,
#: 0.95x at 128.
BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 4, 2
#: Bounds of the automatic split length (columns). At 8-16 rows on an H200, splits shorter than 256
#: were at most 3% faster and up to 2.1x slower (64 columns;
#: ``benchmarks/results/decode_attention_split_len_h200.csv``): the merge walks a row's splits one
#: after another in only ``B x Hkv`` programs.
MIN_SPLIT, MAX_SPLIT = 256, 512
#: Programs per SM the automatic split length aims at for a full cache: one (longer splits at many
#: rows) measured best in the same sweep as the launch (2 and 4: 1.02x and 1.04x its time).
PROGRAMS_PER_SM = 1


@triton.jit
def decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, n_ptr, m_ptr, l_ptr, acc_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_mb, stride_ml,
    L, scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(B, Hkv, NUM_SPLITS)``: the online-softmax partial of columns
    ``[split * SPLIT_LEN, min(+SPLIT_LEN, n_filled))`` for the ``G`` query heads of one K/V head.

    Both products accumulate in fp32; ``WIDE_DOT`` widens their operands to fp32 first (exactly)
    and multiplies in IEEE fp32: for fp32 inputs (no TF32 rounding), and for bf16 under the
    interpreter, whose bf16 ``tl.dot`` returns garbage (triton 3.9). ``PDL``: launched as a
    programmatic dependent launch, so it waits for the previous kernel before its first load.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n = tl.minimum(tl.load(n_ptr), L).to(tl.int32)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, n)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_ok = ((g < G) & (start + 0 * g < end))[:, None] & d_ok[None, :]  # an empty split loads nothing
    q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=q_ok, other=0.0)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    valid_base = valid_ptr + b * stride_mb
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    cols0 = tl.arange(0, BLOCK_N)
    for c in range(start, end, BLOCK_N):
        cols = c + cols0
        inside = cols < end
        ok = inside & (tl.load(valid_base + cols.to(tl.int64) * stride_ml, mask=inside, other=0) != 0)
        tile = ok[:, None] & d_ok[None, :]  # masked keys are never read: they may hold anything
        # both tiles are requested before the first product: twice the bytes in flight per program
        k = tl.load(k_base + cols.to(tl.int64)[:, None] * stride_kl + d[None, :] * stride_kd, mask=tile, other=0.0)
        v = tl.load(v_base + cols.to(tl.int64)[:, None] * stride_vl + d[None, :] * stride_vd, mask=tile, other=0.0)
        if WIDE_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf) before any valid key
        alpha = tl.exp(m_i - ref)
        p = tl.exp(s - ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p_in = p.to(v.dtype)  # rounded like the inputs, as flash attention's P @ V
        if WIDE_DOT:
            pv = tl.dot(p_in.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p_in, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if PDL:  # the merge may launch now; it waits for this grid to finish before reading
        tl.extra.cuda.gdc_launch_dependents()
    # (B, Hkv, NUM_SPLITS, G[, D_PAD]) fp32; the merge reads the non-empty splits only, so an empty
    # split writes nothing
    row = ((b * tl.num_programs(1) + h) * NUM_SPLITS + split) * G + g
    keep = (g < G) & (start + 0 * g < end)
    tl.store(m_ptr + row, m_i, mask=keep)
    tl.store(l_ptr + row, l_i, mask=keep)
    tl.store(acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=keep[:, None])


@triton.jit
def decode_merge_kernel(
    m_ptr, l_ptr, acc_ptr, n_ptr, out_ptr, stride_ob, stride_oh, stride_od, L,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(B, Hkv)``: merges the non-empty split partials of the ``G`` query heads of one K/V
    head into their outputs (one split's ``(G, D)`` tile at a time)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    n = tl.minimum(tl.load(n_ptr), L).to(tl.int32)
    used = tl.cdiv(n, SPLIT_LEN)  # the splits past n_filled are empty: not read
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    m_all = tl.full([G_PAD], float("-inf"), tl.float32)
    l_all = tl.zeros([G_PAD], tl.float32)
    o = tl.zeros([G_PAD, D_PAD], tl.float32)
    first = (b * tl.num_programs(1) + h) * NUM_SPLITS
    for split in range(0, used):
        row = (first + split) * G + g
        g_ok = g < G
        m = tl.load(m_ptr + row, mask=g_ok, other=float("-inf"))
        m_new = tl.maximum(m_all, m)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split without a valid key weighs 0
        w_all = tl.exp(m_all - ref)
        w = tl.exp(m - ref)
        l_all = l_all * w_all + tl.load(l_ptr + row, mask=g_ok, other=0.0) * w
        o = o * w_all[:, None] + tl.load(acc_ptr + row[:, None] * D_PAD + d[None, :], mask=g_ok[:, None],
                                         other=0.0) * w[:, None]
        m_all = m_new
    o = o / tl.where(l_all > 0, l_all, 1.0)[:, None]  # no valid key at all: 0
    heads = h * G + g
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])


def default_split_len(rows: int, kv_heads: int, length: int, num_sms: int = 132) -> int:
    """The split length when none is given: about ``PROGRAMS_PER_SM`` programs per SM over a full
    cache, a power of two in ``[MIN_SPLIT, MAX_SPLIT]``.

    Many rows get long splits, so that fewer partials are written and merged. Few rows (a compacted
    bucket) stop at ``MIN_SPLIT``: shorter splits would spread their keys over more programs, but the
    merge, which walks each row's splits in order, then costs more than the spread gains.

    Args:
        rows (int): B.
        kv_heads (int): Hkv.
        length (int): the cache length L.
        num_sms (int): streaming multiprocessors of the GPU (an H200 has 132).

    Returns:
        int: columns per split.

    Example:
        >>> default_split_len(64, 4, 4096), default_split_len(8, 2, 1536)
        (512, 256)
    """
    target = rows * kv_heads * length / (PROGRAMS_PER_SM * num_sms)
    split = 1 << max(0, int(math.floor(math.log2(max(target, 1.0)))))
    return max(MIN_SPLIT, min(MAX_SPLIT, split))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def launch_split_len(rows: int, kv_heads: int, length: int, block_n: int, device: torch.device) -> int:
    """The split length the kernel runs with when none is given: :func:`default_split_len` for
    ``device``'s SMs, at least one ``block_n`` block.

    Args:
        rows (int): B. kv_heads (int): Hkv. length (int): the cache length L.
        block_n (int): columns per inner-loop block.
        device (torch.device): where the kernel runs (its SM count; 132 off CUDA).

    Returns:
        int: columns per split.

    Example:
        >>> launch_split_len(8, 2, 1536, 64, torch.device("cpu"))
        256
    """
    return max(block_n, default_split_len(rows, kv_heads, length, _num_sms(device)))


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor,
                               scale: float) -> Tensor:
    """The same attention in plain PyTorch (fp32 softmax, shapes independent of ``n_filled``).

    Args:
        q (Tensor): ``(B, Hq, D)``.
        k (Tensor): ``(B, Hkv, L, D)``.
        v (Tensor): ``(B, Hkv, L, D)``.
        key_valid (Tensor): ``(B, L)`` bool.
        n_filled (Tensor): ``(1,)`` int64, columns ``0 .. n_filled - 1`` hold keys.
        scale (float): multiplies ``q . k``.

    Returns:
        Tensor: ``(B, Hq, D)`` in ``q``'s dtype; 0 for a row without any valid key.

    Example:
        >>> out = decode_attention_reference(q, k, v, valid, torch.tensor([5]), 0.125)
    """
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    ok = key_valid & (torch.arange(length, device=q.device) < n_filled)  # (B, L)
    keep = ok[:, None, :, None]
    # masked columns may hold anything (NaN included): never let them reach the arithmetic
    k32 = torch.where(keep, k, torch.zeros((), dtype=k.dtype, device=k.device)).float()
    v32 = torch.where(keep, v, torch.zeros((), dtype=v.dtype, device=v.device)).float()
    q32 = q.float().view(b, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,bhld->bhgl", q32, k32) * scale
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row without a valid key: all -inf -> 0
    return torch.einsum("bhgl,bhld->bhgd", p, v32).reshape(b, hq, d).to(q.dtype)


def resolve_launch(rows: int, kv_heads: int, length: int, device: torch.device, split_len: int = 0,
                   block_n: int = 0, num_warps: int = 0, num_stages: int = 0) -> Tuple[int, int, int, int]:
    """The launch the kernels run with: the parameters given (non-zero), the defaults for the rest.

    The block defaults to :data:`BLOCK_N`, at most a given split; the split to
    :func:`launch_split_len`; the warps and stages to :data:`NUM_WARPS` and :data:`NUM_STAGES`.

    Args:
        rows (int): B. kv_heads (int): Hkv. length (int): the cache length L.
        device (torch.device): where the kernels run (its SM count).
        split_len, block_n, num_warps, num_stages (int): as given; 0 = the default.

    Returns:
        Tuple[int, int, int, int]: ``(split_len, block_n, num_warps, num_stages)``.

    Example:
        >>> resolve_launch(8, 2, 1536, torch.device("cpu"), split_len=64)
        (64, 64, 4, 2)
    """
    if split_len:
        block_n = block_n or min(BLOCK_N, split_len)
    else:
        block_n = block_n or BLOCK_N
        split_len = launch_split_len(rows, kv_heads, length, block_n, device)
    return split_len, block_n, num_warps or NUM_WARPS, num_stages or NUM_STAGES


def supports_programmatic_launch(device: torch.device) -> bool:
    """Whether ``device`` can run kernels as programmatic dependent launches (a CUDA GPU of compute
    capability 9.0 or later, outside the interpreter): a kernel may then be scheduled while the one
    before it finishes, and waits for it (``gdc_wait``) before its first load.

    Example:
        >>> supports_programmatic_launch(torch.device("cpu"))
        False
    """
    return device.type == "cuda" and not _interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


def _launch(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor, scale: float,
            split_len: int, block_n: int, num_warps: int, num_stages: int, pdl: bool) -> Tensor:
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    group = hq // hkv
    splits = triton.cdiv(length, split_len)
    g_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows at least
    d_pad = max(16, triton.next_power_of_2(d))
    m = torch.empty(b, hkv, splits, group, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(b, hkv, splits, group, d_pad, dtype=torch.float32, device=q.device)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    decode_partial_kernel[(b, hkv, splits)](
        q, k, v, key_valid, n_filled, m, l, acc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        key_valid.stride(0), key_valid.stride(1),
        length, scale,
        G=group, G_PAD=g_pad, D=d, D_PAD=d_pad, NUM_SPLITS=splits, SPLIT_LEN=split_len, BLOCK_N=block_n,
        WIDE_DOT=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreting()), PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    decode_merge_kernel[(b, hkv)](
        m, l, acc, n_filled, out, out.stride(0), out.stride(1), out.stride(2), length,
        G=group, G_PAD=g_pad, D=d, D_PAD=d_pad, NUM_SPLITS=splits, SPLIT_LEN=split_len, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )
    return out


@torch.library.custom_op("logitless::decode_attention", mutates_args=())
def _decode_attention_op(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor, scale: float,
                         split_len: int, block_n: int, num_warps: int, num_stages: int,
                         programmatic: bool) -> Tensor:
    """``(B, Hq, D)`` attention output; see :func:`decode_attention` (a launch parameter of 0: its
    default, :func:`resolve_launch`; ``programmatic``: programmatic dependent launches where
    :func:`supports_programmatic_launch` allows)."""
    if not (q.is_cuda or _interpreting()):
        return decode_attention_reference(q, k, v, key_valid, n_filled, scale)
    launch = resolve_launch(q.shape[0], k.shape[1], k.shape[2], q.device, split_len, block_n, num_warps, num_stages)
    return _launch(q, k, v, key_valid, n_filled, scale, *launch, programmatic and supports_programmatic_launch(q.device))


@_decode_attention_op.register_fake
def _(q, k, v, key_valid, n_filled, scale, split_len, block_n, num_warps, num_stages, programmatic):
    return q.new_empty(q.shape)


def _check(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor, split_len: Optional[int],
           block_n: Optional[int], num_warps: Optional[int], num_stages: Optional[int]) -> None:
    # metadata only: no value of a device tensor is read (no host sync)
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention: expected q (B, Hq, D), k and v (B, Hkv, L, D), got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[1] < 1 or hq % k.shape[1]:
        raise ValueError(f"decode_attention: k (B, Hkv, L, D) = {tuple(k.shape)} does not fit q (B, Hq, D) = "
                         f"{tuple(q.shape)}; expected the same B and D and Hq a multiple of Hkv")
    if key_valid.dtype != torch.bool or tuple(key_valid.shape) != (b, k.shape[2]):
        raise ValueError(f"decode_attention: key_valid must be bool (B, L) = {(b, k.shape[2])}, got "
                         f"{key_valid.dtype} {tuple(key_valid.shape)}")
    if n_filled.dtype != torch.int64 or tuple(n_filled.shape) != (1,):
        raise ValueError(f"decode_attention: n_filled must be an int64 tensor of shape (1,), got {n_filled.dtype} "
                         f"{tuple(n_filled.shape)}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, k, v must share one of {_DTYPES}, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if len({q.device, k.device, v.device, key_valid.device, n_filled.device}) != 1:
        raise ValueError(f"decode_attention: all inputs must be on one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}, key_valid {key_valid.device}, n_filled {n_filled.device}")
    for name, value in (("block_n", block_n), ("split_len", split_len)):
        if value is not None and (not isinstance(value, int) or value < 16 or value & (value - 1)):
            raise ValueError(f"decode_attention: {name} must be None or a power of two >= 16, got {value!r}")
    if split_len is not None and block_n is not None and split_len % block_n:
        raise ValueError(f"decode_attention: split_len={split_len} must be a multiple of block_n={block_n}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"decode_attention: num_warps must be None or one of 1, 2, 4, 8, 16, got {num_warps!r}")
    if num_stages is not None and (not isinstance(num_stages, int) or isinstance(num_stages, bool)
                                   or not 1 <= num_stages <= 8):
        raise ValueError(f"decode_attention: num_stages must be None or an int in [1, 8], got {num_stages!r}")


def decode_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor, *,
                     scale: Optional[float] = None, split_len: Optional[int] = None, block_n: Optional[int] = None,
                     num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                     programmatic_launch: bool = True) -> Tensor:
    """Attention of one new query token per row with grouped-query heads, split along the cache.

    Args:
        q (Tensor): ``(B, Hq, D)`` queries, any strides; query head ``h`` reads K/V head ``h // G``
            (``G = Hq // Hkv``, torchtune's order).
        k (Tensor): ``(B, Hkv, L, D)`` key cache, any strides (e.g. the first ``B`` rows of a bigger
            cache: never copied).
        v (Tensor): ``(B, Hkv, L, D)`` value cache, as ``k``.
        key_valid (Tensor): ``(B, L)`` bool, False at each row's left padding.
        n_filled (Tensor): ``(1,)`` int64 on the device: columns ``0 .. n_filled - 1`` hold keys
            (the step's own key included), shared by all rows; later columns are never read.
        scale (Optional[float]): multiplies ``q . k``; None = ``1 / sqrt(D)``.
        split_len (Optional[int]): cache columns per program (a power of two, a multiple of
            ``block_n``); None = :func:`launch_split_len` for the shapes and the GPU.
        block_n (Optional[int]): columns per inner-loop block (a power of two >= 16); None =
            :data:`BLOCK_N` (at most ``split_len``).
        num_warps (Optional[int]): warps per program of the partial kernel; None = :data:`NUM_WARPS`.
        num_stages (Optional[int]): software-pipeline stages of the partial kernel's loop; None =
            :data:`NUM_STAGES`.
        programmatic_launch (bool): launch the kernels as programmatic dependent launches where the
            GPU has them (:func:`supports_programmatic_launch`); same results either way.

    Returns:
        Tensor: ``(B, Hq, D)`` in ``q``'s dtype; 0 for a row without any valid key among the
        filled columns.

    Raises:
        ValueError: on shapes, dtypes, devices or launch parameters that do not fit, naming them.

    Example:
        >>> out = decode_attention(q, k_cache[:8], v_cache[:8], key_valid[:8], n_filled)
    """
    _check(q, k, v, key_valid, n_filled, split_len, block_n, num_warps, num_stages)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return torch.ops.logitless.decode_attention(q, k, v, key_valid, n_filled, scale, split_len or 0, block_n or 0,
                                                num_warps or 0, num_stages or 0, bool(programmatic_launch))
