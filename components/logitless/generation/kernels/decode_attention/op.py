"""The decode attention's ops (``torch.library``), their launch and argument checks, and
:func:`decode_attention`, the call that checks its arguments once and runs the right op.

The launch constants and rules are read from :mod:`.plan` at each call (``plan.NAME``), so there is
one place that sets each of them.
"""

import math
from typing import Optional, Tuple

import torch
import triton
from torch import Tensor

from logitless._platform import triton_interpreting
from logitless.generation.kernels.decode_attention import kernels, plan
from logitless.generation.kernels.decode_attention.reference import (NewToken, SharedPrefix,
                                                                     decode_attention_reference,
                                                                     write_new_token_reference)

__all__ = ["ARRIVAL_SLOTS", "MERGE_IN_PARTIAL", "decode_attention", "reserve_arrivals"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: The last partial program of a (row, K/V head) merges its row (``decode_partial_kernel``'s
#: ``MERGE``) instead of a separate ``decode_merge_kernel`` launch; the counters it needs are
#: :data:`ARRIVAL_SLOTS` int32 per device (:func:`reserve_arrivals`), kept at zero between launches.
#: False: the merge kernel.
MERGE_IN_PARTIAL, ARRIVAL_SLOTS = True, 1 << 16
_ARRIVALS = {}


def reserve_arrivals(device: torch.device) -> None:
    """Allocates ``device``'s arrival counters for the merge inside the partial kernel, once.

    Call it outside ``torch.compile`` and CUDA-graph capture (a compiled caller, such as the
    compiled sampler, calls it before its first step): the counters must live outside any graph's
    memory pool, since every launch leaves them at zero for the next. Until it is called, the
    kernels merge with :func:`decode_merge_kernel`.
    """
    if device not in _ARRIVALS:
        _ARRIVALS[device] = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)


def _arrivals(device: torch.device, needed: int) -> Optional[Tensor]:
    """The device's arrival counters (zeros), or None where the merge kernel must run instead: none
    reserved yet (:func:`reserve_arrivals`), or more than :data:`ARRIVAL_SLOTS` (row, K/V head)
    pairs. One stream at a time may use them."""
    counters = _ARRIVALS.get(device)
    return counters if counters is not None and needed <= counters.numel() else None


def _launch(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor, scale: float, launch: plan.Launch,
            pdl: bool, prefix: Optional[Tuple[Tensor, Tensor, Tensor, Tensor, int, int]] = None,
            new_token: Optional[Tuple[Tensor, Tensor, Tensor, Tensor, bool]] = None) -> Tensor:
    # prefix: (width, seg_start, seg_rows, covered, max_rows, prefix_split_len) of a SharedPrefix;
    # new_token: (k, v, cos, sin, interleaved) of a NewToken
    split_len, block_n, num_warps, num_stages = launch[:4]
    # the grid and the workspace are cut for the shortest split; the kernels pick the split from n_filled
    fill = dict(fill_budget=plan.FILL_PROGRAMS_PER_SM * plan.sm_count(q.device), FILL_STEPS=launch.fill_steps,
                MAX_ROW_SPLITS=plan.FILL_MAX_ROW_SPLITS)
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    group = hq // hkv
    splits = triton.cdiv(length, split_len)
    prefix_slots = triton.cdiv(length, prefix[5]) if prefix is not None else 0
    slots = prefix_slots + splits
    g_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows at least
    d_pad = max(16, triton.next_power_of_2(d))
    wide = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and triton_interpreting())
    m = torch.empty(b, hkv, slots, group, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(b, hkv, slots, group, d_pad, dtype=torch.float32, device=q.device)
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
               v.stride(0), v.stride(1), v.stride(2), v.stride(3), key_valid.stride(0), key_valid.stride(1))
    width = covered = n_filled  # unread without a prefix
    rot_args, rot_flags = (q, q, m, m, 0, 0, 0, 0, 0), {}  # unread without a new token
    if new_token is not None:
        k_new, v_new, cos, sin, interleaved = new_token
        rot_args = (k_new, v_new, cos, sin, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
                    cos.stride(0))
        rot_flags = dict(ROTARY=True, INTERLEAVED=interleaved)
    prefix_split_len = split_len
    if prefix is not None:
        width, seg_start, seg_rows, covered, max_rows, prefix_split_len = prefix
        m_pad = max(16, triton.next_power_of_2(max_rows * group))
        kernels.decode_prefix_kernel[(seg_start.shape[0], hkv, prefix_slots)](
            q, k, v, key_valid, n_filled, width, seg_start, seg_rows, m, l, acc, *strides, length, scale,
            G=group, M_PAD=m_pad, D=d, D_PAD=d_pad, NUM_SLOTS=slots, SPLIT_LEN=prefix_split_len,
            BLOCK_N=min(plan.PREFIX_BLOCK_N, prefix_split_len), WIDE_DOT=wide, PDL=pdl,
            num_warps=plan.PREFIX_NUM_WARPS if m_pad * d_pad > 64 * 128 else 4, num_stages=num_stages, launch_pdl=pdl,
        )
    arrivals = _arrivals(q.device, b * hkv) if MERGE_IN_PARTIAL else None
    outs = (covered, out, out.stride(0), out.stride(1), out.stride(2))
    kernels.decode_partial_kernel[(b, hkv, splits)](
        q, k, v, key_valid, n_filled, width, m, l, acc, *strides, length, scale,
        arrivals if arrivals is not None else m, *outs, *rot_args, **rot_flags, G=group, G_PAD=g_pad, D=d,
        D_PAD=d_pad, NUM_SLOTS=slots, SLOT0=prefix_slots, SPLIT_LEN=split_len, BLOCK_N=block_n,
        HAS_PREFIX=prefix is not None, WIDE_DOT=wide, PDL=pdl, MERGE=arrivals is not None,
        PREFIX_SPLIT_LEN=prefix_split_len, **fill, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    if arrivals is None:
        kernels.decode_merge_kernel[(b, hkv)](
            m, l, acc, n_filled, width, *outs, length,
            G=group, G_PAD=g_pad, D=d, D_PAD=d_pad, NUM_SLOTS=slots, SLOT0=prefix_slots, SPLIT_LEN=split_len,
            PREFIX_SPLIT_LEN=prefix_split_len, HAS_PREFIX=prefix is not None, PDL=pdl, **fill, num_warps=4,
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
    if not (q.is_cuda or triton_interpreting()):
        return decode_attention_reference(q, k, v, key_valid, n_filled, scale)
    launch = plan.resolve_launch(q.shape[0], k.shape[1], k.shape[2], q.device, split_len, block_n, num_warps,
                                 num_stages)
    pdl = programmatic and plan.supports_programmatic_launch(q.device)
    return _launch(q, k, v, key_valid, n_filled, scale, launch, pdl)


@torch.library.custom_op("logitless::decode_attention_shared_prefix", mutates_args=())
def _decode_attention_shared_prefix_op(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor,
                                       width: Tensor, seg_start: Tensor, seg_rows: Tensor, covered: Tensor,
                                       max_rows: int, scale: float, split_len: int, block_n: int, num_warps: int,
                                       num_stages: int, prefix_split_len: int, programmatic: bool) -> Tensor:
    """:func:`decode_attention` with a :class:`SharedPrefix` given as its fields (launch parameters
    of 0: the defaults; ``prefix_split_len`` 0: :func:`prefix_split_len`)."""
    prefix = SharedPrefix(width, seg_start, seg_rows, covered, max_rows)
    if not (q.is_cuda or triton_interpreting()):
        return decode_attention_reference(q, k, v, key_valid, n_filled, scale, shared_prefix=prefix)
    launch = plan.resolve_launch(q.shape[0], k.shape[1], k.shape[2], q.device, split_len, block_n, num_warps,
                                 num_stages, shared_prompt=True)
    psl = prefix_split_len or plan.prefix_split_len_for(seg_start.shape[0], k.shape[1], k.shape[2], q.device)
    pdl = programmatic and plan.supports_programmatic_launch(q.device)
    prefix = (width, seg_start, seg_rows, covered, max_rows, psl)
    return _launch(q, k, v, key_valid, n_filled, scale, launch, pdl, prefix)


@torch.library.custom_op("logitless::decode_attention_new_token", mutates_args=("k", "v"))
def _decode_attention_new_token_op(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor,
                                   k_new: Tensor, v_new: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
                                   scale: float, split_len: int, block_n: int, num_warps: int, num_stages: int,
                                   programmatic: bool) -> Tensor:
    """:func:`decode_attention` with a :class:`NewToken` given as its fields (launch parameters of 0:
    the defaults); writes ``k`` and ``v`` at column ``n_filled - 1``."""
    token = NewToken(k_new, v_new, cos, sin, interleaved)
    if not (q.is_cuda or triton_interpreting()):
        q = write_new_token_reference(q, k, v, n_filled - 1, token)
        return decode_attention_reference(q, k, v, key_valid, n_filled, scale)
    launch = plan.resolve_launch(q.shape[0], k.shape[1], k.shape[2], q.device, split_len, block_n, num_warps,
                                 num_stages)
    pdl = programmatic and plan.supports_programmatic_launch(q.device)
    return _launch(q, k, v, key_valid, n_filled, scale, launch, pdl, new_token=token)


@_decode_attention_new_token_op.register_fake
def _(q, k, v, key_valid, n_filled, k_new, v_new, cos, sin, interleaved, scale, split_len, block_n, num_warps,
      num_stages, programmatic):
    return q.new_empty(q.shape)


@_decode_attention_shared_prefix_op.register_fake
def _(q, k, v, key_valid, n_filled, width, seg_start, seg_rows, covered, max_rows, scale, split_len, block_n,
      num_warps, num_stages, prefix_split_len, programmatic):
    return q.new_empty(q.shape)


@_decode_attention_op.register_fake
def _(q, k, v, key_valid, n_filled, scale, split_len, block_n, num_warps, num_stages, programmatic):
    return q.new_empty(q.shape)


def _check(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor, split_len: Optional[int],
           block_n: Optional[int], num_warps: Optional[int], num_stages: Optional[int],
           shared_prefix: Optional[SharedPrefix] = None) -> None:
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
    if shared_prefix is not None:
        _check_prefix(shared_prefix, q, k)


def _check_prefix(prefix: SharedPrefix, q: Tensor, k: Tensor) -> None:
    if not isinstance(prefix, SharedPrefix):
        raise ValueError(f"decode_attention: shared_prefix must be None or a SharedPrefix, got {type(prefix).__name__}")
    for name in ("width", "covered"):
        t = getattr(prefix, name)
        if not isinstance(t, Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (1,):
            raise ValueError(f"decode_attention: shared_prefix.{name} must be an int64 tensor of shape (1,), got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    start, rows = prefix.seg_start, prefix.seg_rows
    if (not isinstance(start, Tensor) or not isinstance(rows, Tensor) or start.dtype != torch.int32
            or rows.dtype != torch.int32 or start.dim() != 1 or start.shape != rows.shape or start.numel() < 1):
        raise ValueError(f"decode_attention: shared_prefix.seg_start and seg_rows must be int32 tensors of one shape "
                         f"(S,), S >= 1, got {getattr(start, 'dtype', None)} {tuple(getattr(start, 'shape', ()))} and "
                         f"{getattr(rows, 'dtype', None)} {tuple(getattr(rows, 'shape', ()))}")
    group = q.shape[1] // k.shape[1]
    if not isinstance(prefix.max_rows, int) or not 1 <= prefix.max_rows * group <= plan.MAX_PREFIX_QUERIES:
        raise ValueError(f"decode_attention: shared_prefix.max_rows x query heads per K/V head ({group}) must be in "
                         f"[1, {plan.MAX_PREFIX_QUERIES}], got max_rows={prefix.max_rows!r} (see prefix_rows)")
    if len({q.device} | {t.device for t in (prefix.width, start, rows, prefix.covered)}) != 1:
        raise ValueError(f"decode_attention: shared_prefix's tensors must be on q's device {q.device}")


def _check_new_token(token: NewToken, q: Tensor, k: Tensor, shared_prefix: Optional[SharedPrefix]) -> None:
    if not isinstance(token, NewToken):
        raise ValueError(f"decode_attention: new_token must be None or a NewToken, got {type(token).__name__}")
    if shared_prefix is not None:
        raise ValueError("decode_attention: new_token with shared_prefix is not supported; rotate the query and "
                         "write the caches first (logitless.generation.kernels.decode_rotary.decode_rotary_cache)")
    b, hkv, d = k.shape[0], k.shape[1], k.shape[3]
    for name in ("k", "v"):
        t = getattr(token, name)
        if tuple(t.shape) != (b, hkv, d) or t.dtype != k.dtype or t.stride(-1) != 1:
            raise ValueError(f"decode_attention: new_token.{name} must be ({b}, {hkv}, {d}) {k.dtype} with a "
                             f"contiguous last dimension, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    for name in ("cos", "sin"):
        t = getattr(token, name)
        if tuple(t.shape) != (b, d) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"decode_attention: new_token.{name} must be contiguous float32 ({b}, {d}) (see "
                             f"rotation_coefficients), got {tuple(t.shape)} {t.dtype}")
    if d % 2 or q.stride(-1) != 1:
        raise ValueError(f"decode_attention: new_token needs an even head size and q with a contiguous last "
                         f"dimension, got D={d}, q strides {q.stride()}")
    if len({q.device} | {t.device for t in token[:4]}) != 1:
        raise ValueError(f"decode_attention: new_token's tensors must be on q's device {q.device}")


def decode_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor, *,
                     scale: Optional[float] = None, split_len: Optional[int] = None, block_n: Optional[int] = None,
                     num_warps: Optional[int] = None, num_stages: Optional[int] = None,
                     programmatic_launch: bool = True, shared_prefix: Optional[SharedPrefix] = None,
                     prefix_split_len: Optional[int] = None, new_token: Optional[NewToken] = None) -> Tensor:
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
            ``block_n``); None = chosen by the kernels from ``n_filled`` at each launch
            (:func:`fill_split_len`), or with ``shared_prefix`` :func:`launch_split_len` aiming at
            :data:`SHARED_PROGRAMS_PER_SM`.
        block_n (Optional[int]): columns per inner-loop block (a power of two >= 16); None =
            :data:`BLOCK_N` (at most ``split_len``).
        num_warps (Optional[int]): warps per program of the partial kernel; None = :data:`NUM_WARPS`.
        num_stages (Optional[int]): software-pipeline stages of the partial kernel's loop; None =
            :data:`NUM_STAGES`.
        programmatic_launch (bool): launch the kernels as programmatic dependent launches where the
            GPU has them (:func:`supports_programmatic_launch`); same results either way.
        shared_prefix (Optional[SharedPrefix]): rows that share their first columns (a group's
            prompt): each segment's shared columns are read once, by one program per split whose
            query operand is all of the segment's query heads (:func:`decode_prefix_kernel`), the
            rest of each row as without it. None: every row reads its own columns.
        prefix_split_len (Optional[int]): shared columns per program (a power of two >= 16); None =
            :func:`prefix_split_len_for`.
        new_token (Optional[NewToken]): the step's own key and value before the rotary embedding:
            ``q`` is then the unrotated query, and the kernel rotates it and the key, and writes the
            key and the value into ``k`` and ``v`` at column ``n_filled - 1`` (op
            ``logitless::decode_attention_new_token``, which declares ``k`` and ``v`` mutated). Not
            with ``shared_prefix``.

    Returns:
        Tensor: ``(B, Hq, D)`` in ``q``'s dtype; 0 for a row without any valid key among the
        filled columns.

    Raises:
        ValueError: on shapes, dtypes, devices or launch parameters that do not fit, naming them.

    Example:
        >>> out = decode_attention(q, k_cache[:8], v_cache[:8], key_valid[:8], n_filled)
    """
    _check(q, k, v, key_valid, n_filled, split_len, block_n, num_warps, num_stages, shared_prefix)
    if new_token is not None:
        _check_new_token(new_token, q, k, shared_prefix)
    if prefix_split_len is not None and (not isinstance(prefix_split_len, int) or prefix_split_len < 16
                                         or prefix_split_len & (prefix_split_len - 1)):
        raise ValueError(f"decode_attention: prefix_split_len must be None or a power of two >= 16, got "
                         f"{prefix_split_len!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not torch.compiler.is_compiling() and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        reserve_arrivals(q.device)
    if new_token is not None:
        return torch.ops.logitless.decode_attention_new_token(q, k, v, key_valid, n_filled, *new_token, scale,
                                                              split_len or 0, block_n or 0, num_warps or 0,
                                                              num_stages or 0, bool(programmatic_launch))
    if shared_prefix is None:
        return torch.ops.logitless.decode_attention(q, k, v, key_valid, n_filled, scale, split_len or 0, block_n or 0,
                                                    num_warps or 0, num_stages or 0, bool(programmatic_launch))
    return torch.ops.logitless.decode_attention_shared_prefix(
        q, k, v, key_valid, n_filled, *shared_prefix, scale, split_len or 0, block_n or 0, num_warps or 0,
        num_stages or 0, prefix_split_len or 0, bool(programmatic_launch))
