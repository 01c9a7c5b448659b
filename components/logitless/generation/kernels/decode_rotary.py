"""The decode step's rotary embedding and KV-cache write in one launch.

After the q/k/v projections of one new token per row, torchtune's attention rotates the query and
the key by the token's position, then writes the key and the value into the cache. Under
``torch.compile`` those are three or four small kernels a layer (the query's rotation, the key's
rotation with its cache write, the value's cache write), each a few microseconds of launch latency
for a few kilobytes. ``decode_rotary_cache_kernel``, grid ``(B,)``, does all of it for one row:

* the row's cos and sin come straight from the rotary module's own table (its ``cache`` buffer) at
  the row's position, laid out as the module keeps them (:class:`RotaryTable`);
* every query head is rotated into a new ``(B, Hq, D)`` tensor, every key head is rotated into the
  key cache at column ``col``, every value head is copied into the value cache there;
* the arithmetic is fp32 with one rounding to the input dtype, as inductor compiles the module
  (Qwen2's module rounds cos and sin to the input dtype first, and so does the kernel).

Supported modules (:func:`rotary_table`): torchtune's ``RotaryPositionalEmbeddings`` and
``Llama3ScaledRoPE`` (pairs ``(2i, 2i + 1)``), ``Qwen2RotaryPositionalEmbeddings`` and
``Phi3RotaryPositionalEmbeddings`` (pairs ``(i, i + D/2)``). Anything else keeps the module.

The op ``logitless::decode_rotary_cache`` declares the two caches mutated, so ``torch.compile``
orders the attention's reads after the writes and writes the caches in place. Off CUDA it runs
:func:`decode_rotary_cache_reference` unless ``TRITON_INTERPRET=1``.

Example:
    >>> rope = Qwen2RotaryPositionalEmbeddings(128, max_seq_len=4096)
    >>> q = torch.randn(64, 12, 128, device="cuda", dtype=torch.bfloat16)          # (B, Hq, D)
    >>> k, v = torch.randn(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16)     # (B, Hkv, D)
    >>> k_cache = torch.zeros(64, 2, 1536, 128, device="cuda", dtype=torch.bfloat16)
    >>> v_cache = torch.zeros_like(k_cache)
    >>> pos = torch.full((64,), 1100, device="cuda")
    >>> col = torch.tensor([1100], device="cuda")
    >>> q_rot = decode_rotary_cache(q, k, v, pos, rotary_table(rope.to("cuda"), 128), col, k_cache, v_cache)
"""

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor, nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.phi3._position_embeddings import Phi3RotaryPositionalEmbeddings
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import RotaryPositionalEmbeddings

from logitless._platform import triton_interpreting
from logitless.generation.kernels.decode_attention.plan import supports_programmatic_launch
from logitless.generation.kernels.decode_attention.reference import NewToken, write_new_token_reference

__all__ = ["RotaryTable", "decode_rotary_cache", "decode_rotary_cache_reference", "rotary_table",
           "rotation_coefficients"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RotaryTable(NamedTuple):
    """Where a rotary module keeps the cos and sin of pair ``i`` at position ``p``: cos at
    ``table.flatten()[p * stride_pos + i * stride_pair]``, sin ``sin_offset`` elements further.

    ``interleaved``: pair ``i`` rotates elements ``(2i, 2i + 1)`` (else ``(i, i + D/2)``);
    ``round_table``: cos and sin are rounded to the input dtype before the products (Qwen2's module)."""

    table: Tensor
    stride_pos: int
    stride_pair: int
    sin_offset: int
    interleaved: bool
    round_table: bool


#: The rotary modules the kernel reproduces, by how they pair elements and round their table.
_PAIRED = (RotaryPositionalEmbeddings, Llama3ScaledRoPE)  # pairs (2i, 2i + 1), fp32 products
_HALVES_ROUNDED = (Qwen2RotaryPositionalEmbeddings,)  # pairs (i, i + D/2), table cast to the input dtype
_HALVES = (Phi3RotaryPositionalEmbeddings,)  # pairs (i, i + D/2), fp32 table


def rotary_table(module: Optional[nn.Module], head_dim: int) -> Optional[RotaryTable]:
    """The :class:`RotaryTable` of a torchtune rotary module, or None where the kernel does not
    reproduce it (another class, a subclass, no built table, another head size).

    Args:
        module (Optional[nn.Module]): the attention's ``pos_embeddings``.
        head_dim (int): D.

    Returns:
        Optional[RotaryTable]: the module's own ``cache`` buffer and its layout.

    Example:
        >>> from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
        >>> spec = rotary_table(Qwen2RotaryPositionalEmbeddings(8, max_seq_len=16), 8)
        >>> spec.stride_pos, spec.stride_pair, spec.sin_offset, spec.interleaved, spec.round_table
        (16, 1, 8, False, True)
    """
    if module is None or head_dim % 2:
        return None
    table = getattr(module, "cache", None)
    if not isinstance(table, Tensor) or not table.is_contiguous() or table.dtype not in _DTYPES:
        return None
    kind = type(module)
    if kind in _PAIRED and table.dim() == 3 and tuple(table.shape[1:]) == (head_dim // 2, 2):
        return RotaryTable(table, head_dim, 2, 1, True, False)
    if kind in _HALVES_ROUNDED + _HALVES and table.dim() == 2 and table.shape[1] == 2 * head_dim:
        return RotaryTable(table, 2 * head_dim, 1, head_dim, False, kind in _HALVES_ROUNDED)
    return None


def rotation_coefficients(spec: RotaryTable, positions: Tensor, head_dim: int,
                          dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Each row's rotation as :class:`~logitless.generation.kernels.decode_attention.NewToken` takes it: cos
    and signed sin per element, fp32, read from a rotary module's table at each row's position.

    Args:
        spec (RotaryTable): the module's table (:func:`rotary_table`).
        positions (Tensor): ``(B,)`` int64, each row's position.
        head_dim (int): D.
        dtype (torch.dtype): the rotated vectors' dtype (a table the module rounds is rounded to it).

    Returns:
        Tuple[Tensor, Tensor]: ``(B, D)`` fp32 ``cos`` and ``sin``, ``sin`` negated on the first element
        of each pair, so that element ``d`` rotates to ``x_d cos_d + x_e sin_d`` (``e`` its pair's other).

    Example:
        >>> cos, sin = rotation_coefficients(rotary_table(rope, 128), positions, 128, torch.bfloat16)
    """
    d = head_dim
    index = torch.arange(d, device=positions.device)
    pair = index // 2 if spec.interleaved else index % (d // 2)
    first = index % 2 == 0 if spec.interleaved else index < d // 2
    at = positions.reshape(-1, 1) * spec.stride_pos + pair * spec.stride_pair
    flat = spec.table.reshape(-1)
    cos, sin = flat[at], flat[at + spec.sin_offset]
    if spec.round_table:
        cos, sin = cos.to(dtype), sin.to(dtype)
    cos, sin = cos.float(), sin.float()
    return cos.contiguous(), torch.where(first, -sin, sin).contiguous()


@triton.jit
def _rotate_heads(src_ptr, stride_sh, dst_ptr, stride_dh, heads, lo, hi, pair_ok, cos, sin,
                  H_PAD: tl.constexpr, ROTATE: tl.constexpr):
    """Rotates (or, without ``ROTATE``, copies) ``heads`` rows of D elements from ``src`` to ``dst``."""
    h = tl.arange(0, H_PAD)[:, None]
    ok = (h < heads) & pair_ok[None, :]
    x1 = tl.load(src_ptr + h * stride_sh + lo[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + h * stride_sh + hi[None, :], mask=ok, other=0.0).to(tl.float32)
    if ROTATE:
        y1 = x1 * cos[None, :] - x2 * sin[None, :]
        y2 = x2 * cos[None, :] + x1 * sin[None, :]
    else:
        y1, y2 = x1, x2
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + h * stride_dh + lo[None, :], y1.to(out_ty), mask=ok)
    tl.store(dst_ptr + h * stride_dh + hi[None, :], y2.to(out_ty), mask=ok)


@triton.jit
def decode_rotary_cache_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, col_ptr, out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_pb,
    stride_ob, stride_oh, stride_kcb, stride_kch, stride_kcl, stride_vcb, stride_vch, stride_vcl,
    stride_tp, stride_ti, SIN_OFFSET,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr, ROUND_TABLE: tl.constexpr, PDL: tl.constexpr,
):
    """Row ``b``: the rotated query heads into ``out``, the rotated key heads and the value heads
    into the caches at column ``col``. ``PDL``: waits for the projections, then lets the attention
    launch (it waits for this kernel before its first load)."""
    b = tl.program_id(0).to(tl.int64)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pos = tl.load(pos_ptr + b * stride_pb)
    col = tl.load(col_ptr)
    i = tl.arange(0, HALF_PAD)
    pair_ok = i < HALF
    if INTERLEAVED:
        lo = 2 * i
        hi = lo + 1
    else:
        lo = i
        hi = i + HALF
    trig = table_ptr + pos * stride_tp + i * stride_ti
    cos = tl.load(trig, mask=pair_ok, other=0.0)
    sin = tl.load(trig + SIN_OFFSET, mask=pair_ok, other=0.0)
    if ROUND_TABLE:  # the module multiplies by cos and sin cast to the input dtype
        cos = cos.to(out_ptr.dtype.element_ty)
        sin = sin.to(out_ptr.dtype.element_ty)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(q_ptr + b * stride_qb, stride_qh, out_ptr + b * stride_ob, stride_oh, HQ, lo, hi, pair_ok, cos,
                  sin, HQ_PAD, True)
    _rotate_heads(k_ptr + b * stride_kb, stride_kh, k_cache_ptr + b * stride_kcb + col * stride_kcl, stride_kch,
                  HKV, lo, hi, pair_ok, cos, sin, HKV_PAD, True)
    _rotate_heads(v_ptr + b * stride_vb, stride_vh, v_cache_ptr + b * stride_vcb + col * stride_vcl, stride_vch,
                  HKV, lo, hi, pair_ok, cos, sin, HKV_PAD, False)


def decode_rotary_cache_reference(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, spec: RotaryTable,
                                  col: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """:func:`decode_rotary_cache` in plain PyTorch (the same fp32 arithmetic and one rounding):
    writes the caches and returns the rotated query."""
    token = NewToken(k, v, *rotation_coefficients(spec, positions, q.shape[-1], q.dtype), spec.interleaved)
    return write_new_token_reference(q, k_cache, v_cache, col, token)


@torch.library.custom_op("logitless::decode_rotary_cache", mutates_args=("k_cache", "v_cache"))
def _decode_rotary_cache_op(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, table: Tensor, stride_pos: int,
                            stride_pair: int, sin_offset: int, interleaved: bool, round_table: bool, col: Tensor,
                            k_cache: Tensor, v_cache: Tensor, programmatic: bool) -> Tensor:
    """``(B, Hq, D)`` rotated query; writes the caches. See :func:`decode_rotary_cache`."""
    spec = RotaryTable(table, stride_pos, stride_pair, sin_offset, interleaved, round_table)
    if not (q.is_cuda or triton_interpreting()):
        return decode_rotary_cache_reference(q, k, v, positions, spec, col, k_cache, v_cache)
    b, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    pdl = programmatic and supports_programmatic_launch(q.device)
    if b:
        decode_rotary_cache_kernel[(b,)](
            q, k, v, positions, table, col, out, k_cache, v_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), positions.stride(0),
            out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_pos, stride_pair, sin_offset,
            HQ=hq, HKV=hkv, HQ_PAD=max(2, triton.next_power_of_2(hq)), HKV_PAD=max(2, triton.next_power_of_2(hkv)),
            HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), INTERLEAVED=interleaved, ROUND_TABLE=round_table,
            PDL=pdl, num_warps=4 if hq * d >= 2048 else 2, launch_pdl=pdl,
        )
    return out


@_decode_rotary_cache_op.register_fake
def _(q, k, v, positions, table, stride_pos, stride_pair, sin_offset, interleaved, round_table, col, k_cache, v_cache,
      programmatic):
    return q.new_empty(q.shape)


def decode_rotary_cache(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, spec: RotaryTable, col: Tensor,
                        k_cache: Tensor, v_cache: Tensor, *, programmatic: bool = False) -> Tensor:
    """Rotates one new token's query and key per row by its position and writes the key and the
    value into the caches at column ``col``, in one launch.

    Args:
        q (Tensor): ``(B, Hq, D)``, the last dimension contiguous (a view of the projections' output).
        k (Tensor): ``(B, Hkv, D)``, likewise.
        v (Tensor): ``(B, Hkv, D)``, likewise.
        positions (Tensor): ``(B,)`` int64, each row's position (an index of ``spec``'s table).
        spec (RotaryTable): the rotary module's table (:func:`rotary_table`).
        col (Tensor): ``(1,)`` int64, the cache column written (a device tensor: no host sync).
        k_cache (Tensor): ``(B, Hkv, L, D)``, written at ``[:, :, col]`` with the rotated key.
        v_cache (Tensor): ``(B, Hkv, L, D)``, written at ``[:, :, col]`` with the value.
        programmatic (bool): a programmatic dependent launch where the GPU has them
            (:func:`~logitless.generation.kernels.decode_attention.supports_programmatic_launch`).

    Returns:
        Tensor: ``(B, Hq, D)``, the rotated query, contiguous, in ``q``'s dtype.

    Raises:
        ValueError: on shapes, dtypes or devices the kernel does not take.

    Example:
        >>> q_rot = decode_rotary_cache(q, k, v, pos, rotary_table(rope, 128), col, k_cache, v_cache)
    """
    _check(q, k, v, positions, spec, col, k_cache, v_cache)
    return _decode_rotary_cache_op(q, k, v, positions, *spec, col, k_cache, v_cache, programmatic)


def _check(q, k, v, positions, spec, col, k_cache, v_cache) -> None:
    # metadata only: no value of a device tensor is read (no host sync)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"decode_rotary_cache: expected q (B, Hq, D), k and v (B, Hkv, D), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, _, d = q.shape
    if k.shape[0] != b or k.shape[2] != d or d % 2:
        raise ValueError(f"decode_rotary_cache: k {tuple(k.shape)} does not fit q {tuple(q.shape)}; expected the "
                         f"same B and an even D")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("decode_rotary_cache: q, k, v and the caches need a contiguous last dimension")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 4 or cache.shape[:2] != k.shape[:2] or cache.shape[3] != d or cache.dtype != k.dtype:
            raise ValueError(f"decode_rotary_cache: {name} must be (B, Hkv, L, D) = ({b}, {k.shape[1]}, L, {d}) "
                             f"{k.dtype}, got {tuple(cache.shape)} {cache.dtype}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_rotary_cache: q, k, v must share one of {_DTYPES}, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (b,):
        raise ValueError(f"decode_rotary_cache: positions must be int64 of shape ({b},), got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if col.dtype != torch.int64 or tuple(col.shape) != (1,):
        raise ValueError(f"decode_rotary_cache: col must be an int64 tensor of shape (1,), got {col.dtype} "
                         f"{tuple(col.shape)}")
    if not spec.table.is_contiguous() or spec.table.numel() < spec.stride_pos:
        raise ValueError(f"decode_rotary_cache: the rotary table must be contiguous with a row of at least "
                         f"{spec.stride_pos} elements, got {tuple(spec.table.shape)}")
    devices = {t.device for t in (q, k, v, positions, spec.table, col, k_cache, v_cache)}
    if len(devices) != 1:
        raise ValueError(f"decode_rotary_cache: all inputs must be on one device, got {sorted(map(str, devices))}")
