"""What the decode attention computes, in plain PyTorch: the oracle of the kernels' tests and what the
op runs off CUDA (unless ``TRITON_INTERPRET=1``); and the two optional inputs that change its work,
:class:`SharedPrefix` and :class:`NewToken`.
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["NewToken", "SharedPrefix", "decode_attention_reference", "write_new_token_reference"]

class SharedPrefix(NamedTuple):
    """Rows whose first cache columns hold the same keys and values (a prompt and its G completions).

    Rows ``seg_start[s] .. seg_start[s] + seg_rows[s] - 1`` form segment ``s``; columns
    ``[0, width)`` of all of them are read from the segment's first row only, once for the whole
    segment (the other rows' copies of those columns are never read). Rows from ``covered`` on
    belong to no segment: their first ``width`` columns are not attended at all (finished filler rows
    of a compacted bucket). All tensors live on the device, so a captured graph serves every step.

    Attributes:
        width (Tensor): ``(1,)`` int64, the shared columns.
        seg_start (Tensor): ``(S,)`` int32, each segment's first row (segments in row order).
        seg_rows (Tensor): ``(S,)`` int32, rows per segment, at most ``max_rows`` (0: an unused segment).
        covered (Tensor): ``(1,)`` int64: rows ``[0, covered)`` are each inside one segment (the
            kernels read a prefix partial for them), later rows inside none.
        max_rows (int): the most rows a segment holds; ``max_rows x (Hq // Hkv)`` is one program's
            query operand (:data:`MAX_PREFIX_QUERIES` at most, see :func:`prefix_rows`).
    """

    width: Tensor
    seg_start: Tensor
    seg_rows: Tensor
    covered: Tensor
    max_rows: int


class NewToken(NamedTuple):
    """The step's own key and value, before the rotary embedding: with it, :func:`decode_attention`
    takes the unrotated query, rotates the query and the key by each row's position, and writes the
    key and the value into the caches at column ``n_filled - 1``, so that no kernel before it has to.

    Element ``d`` of a vector ``x`` of row ``b`` becomes ``x_d cos[b, d] + x_e sin[b, d]``, where ``e`` is
    the other element of ``d``'s pair: ``d ^ 1`` with ``interleaved`` (pairs ``(2i, 2i + 1)``), else
    ``d + D/2`` or ``d - D/2``; :func:`~logitless.generation.kernels.decode_rotary.rotation_coefficients` makes
    ``cos`` and ``sin`` from a rotary module's table.

    Attributes:
        k (Tensor): ``(B, Hkv, D)`` the new keys, the last dimension contiguous.
        v (Tensor): ``(B, Hkv, D)`` the new values, likewise.
        cos (Tensor): ``(B, D)`` fp32, contiguous.
        sin (Tensor): ``(B, D)`` fp32, signed (negative on each pair's first element), contiguous.
        interleaved (bool): how elements pair (above).
    """

    k: Tensor
    v: Tensor
    cos: Tensor
    sin: Tensor
    interleaved: bool


def _rotate_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    # x (B, H, D) rotated as the kernels do: fp32 products, one rounding
    d = x.shape[-1]
    index = torch.arange(d, device=x.device)
    partner = index ^ 1 if interleaved else (index + d // 2) % d
    wide = x.float()
    return (wide * cos[:, None] + wide[..., partner] * sin[:, None]).to(x.dtype)


def write_new_token_reference(q: Tensor, k: Tensor, v: Tensor, col: Tensor, token: NewToken) -> Tensor:
    """Plain PyTorch: writes ``token``'s rotated key and its value into the caches ``k`` and ``v`` at
    column ``col`` (``(1,)`` int64) and returns the rotated query, as the kernels rotate (fp32
    products, one rounding)."""
    k.index_copy_(2, col, _rotate_reference(token.k, token.cos, token.sin, token.interleaved)[:, :, None])
    v.index_copy_(2, col, token.v.to(v.dtype)[:, :, None])
    return _rotate_reference(q, token.cos, token.sin, token.interleaved)


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor,
                               scale: float, shared_prefix: Optional[SharedPrefix] = None) -> Tensor:
    """The same attention in plain PyTorch (fp32 softmax, shapes independent of ``n_filled``).

    Args:
        q (Tensor): ``(B, Hq, D)``.
        k (Tensor): ``(B, Hkv, L, D)``.
        v (Tensor): ``(B, Hkv, L, D)``.
        key_valid (Tensor): ``(B, L)`` bool.
        n_filled (Tensor): ``(1,)`` int64, columns ``0 .. n_filled - 1`` hold keys.
        scale (float): multiplies ``q . k``.
        shared_prefix (Optional[SharedPrefix]): each segment's rows read their first ``width``
            columns (keys, values and validity) from the segment's first row; rows outside every
            segment do not attend to them (reads the segment table on the host: a sync).

    Returns:
        Tensor: ``(B, Hq, D)`` in ``q``'s dtype; 0 for a row without any valid key.

    Example:
        >>> out = decode_attention_reference(q, k, v, valid, torch.tensor([5]), 0.125)
    """
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    ok = key_valid & (torch.arange(length, device=q.device) < n_filled)  # (B, L)
    if shared_prefix is not None:
        k, v, ok = _read_shared_prefix(k, v, ok, shared_prefix)
    keep = ok[:, None, :, None]
    # masked columns may hold anything (NaN included): never let them reach the arithmetic
    k32 = torch.where(keep, k, torch.zeros((), dtype=k.dtype, device=k.device)).float()
    v32 = torch.where(keep, v, torch.zeros((), dtype=v.dtype, device=v.device)).float()
    q32 = q.float().view(b, hkv, hq // hkv, d)
    s = torch.einsum("bhgd,bhld->bhgl", q32, k32) * scale
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row without a valid key: all -inf -> 0
    return torch.einsum("bhgl,bhld->bhgd", p, v32).reshape(b, hq, d).to(q.dtype)


def _read_shared_prefix(k: Tensor, v: Tensor, ok: Tensor, prefix: SharedPrefix) -> Tuple[Tensor, Tensor, Tensor]:
    # The cache each row sees under `prefix`: its first `width` columns from its segment's first row
    # (or masked, outside every segment).
    b, length = ok.shape
    width = min(int(prefix.width), length)
    source = torch.arange(b, device=ok.device)
    inside = torch.zeros(b, dtype=torch.bool, device=ok.device)
    for start, rows in zip(prefix.seg_start.tolist(), prefix.seg_rows.tolist()):
        source[start:start + rows] = start
        inside[start:start + rows] = True
    inside &= torch.arange(b, device=ok.device) < int(prefix.covered)
    k, v, ok = k.clone(), v.clone(), ok.clone()
    k[:, :, :width] = k[source, :, :width]
    v[:, :, :width] = v[source, :, :width]
    ok[:, :width] = ok[source, :width] & inside[:, None]
    return k, v, ok
