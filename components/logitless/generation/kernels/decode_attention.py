"""Split-K (flash-decoding) attention of one new query token per row over a static KV cache.

The compiled sampler's decode step attends one new token per row to a cache of fixed length ``L``
of which only the first ``n_filled`` columns hold keys. SDPA's decode kernels stream a row's whole
window in one program, so their time follows the window, not the rows or the filled length. Here
the cache is cut into splits of ``split_len`` columns, on a grid that depends on the shapes only
(without a given split length, per-row attention cuts its grid for :data:`FILL_MIN_SPLIT` columns and
its programs choose the split from ``n_filled`` at each launch, :func:`fill_split_len`):

* ``decode_partial_kernel``, grid ``(B, Hkv, num_splits)``: one program per (row, K/V head,
  split) reads its split's keys and values once for all ``G`` query heads that share the K/V head
  (torchtune's order: query head ``h`` reads K/V head ``h // G``), up to ``n_filled`` only, and
  keeps an fp32 online softmax: the running max ``m``, the sum ``l`` of ``exp(s - m)`` and the
  weighted sum ``acc`` of the values, written to an fp32 workspace. A split that starts at or
  beyond ``n_filled`` exits at once (split 0 excepted): it loads and writes nothing, and the merge
  never waits for it nor reads it. A split whose keys are
  all masked (left padding) writes the empty partial ``m = -inf``, ``l = 0``, ``acc = 0``.
* the merge: the last partial program of a (row, K/V head) to finish (an arrival count per pair,
  :func:`reserve_arrivals`) merges that row's partials itself; without reserved counters
  ``decode_merge_kernel``, grid ``(B, Hkv)``, does, with the same sums. It merges the splits below
  ``cdiv(n_filled, split_len)``
  (the non-empty ones) of the ``G`` query heads into ``acc / l`` in the query's dtype; a row with
  no valid key at all gets 0, as SDPA gives for a fully masked row.

With a :class:`SharedPrefix` (a group's G rows holding the same prompt columns ``[0, width)``),
``decode_prefix_kernel``, grid ``(segments, Hkv, prefix splits)``, reads those columns once per
segment of consecutive rows, all of the segment's query heads as one operand of the products, into
prefix slots of the workspace; the partial kernel then starts each row at column ``width``, and the
merge folds both (op ``logitless::decode_attention_shared_prefix``).

With a :class:`NewToken` (the step's key and value before the rotary embedding, and each row's
rotation), the partial kernel also does what a kernel before it would: it rotates the query as it
loads it, and the program holding column ``n_filled - 1`` rotates the new key, writes it and the
value into the caches there and folds that column in from registers (op
``logitless::decode_attention_new_token``).

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
while the partials finish; after a shared prefix's kernel, the partial kernel streams its rows'
columns while the prefix programs stream theirs, and waits for them only before its merge.

Example:
    >>> q = torch.randn(8, 14, 64, device="cuda", dtype=torch.bfloat16)          # (B, Hq, D)
    >>> k = torch.randn(64, 2, 1536, 64, device="cuda", dtype=torch.bfloat16)    # a bigger cache
    >>> v = torch.randn_like(k)
    >>> valid = torch.ones(64, 1536, dtype=torch.bool, device="cuda")
    >>> n = torch.tensor([1100], device="cuda")
    >>> out = decode_attention(q, k[:8], v[:8], valid[:8], n)                      # (8, 14, 64)
"""

import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from logitless._platform import sm_count, triton_interpreting

__all__ = ["Launch", "NewToken", "SharedPrefix", "decode_attention", "decode_attention_reference",
           "default_split_len", "fill_split_len", "launch_split_len",
           "group_segments", "prefix_rows", "prefix_split_len_for", "reserve_arrivals", "resolve_launch",
           "shared_prefix_segments",
           "supports_programmatic_launch", "write_new_token_reference"]

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
#: Programs per SM the fixed split rule (:func:`default_split_len`, a length set at capture) aims at
#: for a full cache: one (longer splits at many rows) measured best for per-row attention in the same
#: sweep as the launch (2 and 4: 1.02x and 1.04x its time). Per-row attention now chooses its split
#: from the fill (:data:`FILL_MIN_SPLIT`); the rule serves a shared prompt's rows, with the constant below.
PROGRAMS_PER_SM = 1
#: The same with a shared prompt (:class:`SharedPrefix`): the rows' own splits then cover only the
#: columns after the prompt, a fraction of the cache, so the rule aims at more programs over the
#: whole of it. With splits that hold no column exiting at once, 64 rows of a 1536-column cache (a
#: 1024-column prompt in groups of 16) took 256-column splits at Qwen2.5-0.5B and 1.5B (0.79-1.00x
#: the time of 512) and kept 512 at 7B, whose 512 measured 0.96-1.00x 256's on an H200
#: (``benchmarks/results/decode_attention_early_exit_h200.csv``).
SHARED_PROGRAMS_PER_SM = 4
#: Per-row attention without a given split length chooses it on the device at every launch, from
#: ``n_filled`` (:func:`fill_split_len`): the shortest power of two from ``FILL_MIN_SPLIT`` up to
#: :data:`MAX_SPLIT` whose splits holding columns number at most ``FILL_PROGRAMS_PER_SM`` per SM over
#: the grid's (row, K/V head) pairs and at most ``FILL_MAX_ROW_SPLITS`` per pair (the merge walks a
#: pair's splits one after another). One captured grid then serves a rollout whose fill grows from the
#: prompt to the cache's end: short splits while few columns are filled, long ones near the end. On an
#: H200 (``benchmarks/results/decode_attention_fill_split_h200.csv``) the best fixed split over
#: Qwen2.5-0.5B/1.5B/7B was 128 columns at 64 rows and 384 of 640 filled (2 K/V heads), 512 at 7B's
#: 4 heads; at 8-16 rows of a 4096-column cache 128-256 at 1024 filled, 256 at 2048, and at 3584
#: 256 for 8 rows of 2 heads (14 splits a pair; 16 splits of 128 at 2048 cost 0.5-0.8 us more than 8 of
#: 256) and 512 otherwise: this rule picks each of them.
FILL_MIN_SPLIT, FILL_PROGRAMS_PER_SM, FILL_MAX_ROW_SPLITS = 128, 3, 14
#: Shared-prefix programs (:func:`decode_prefix_kernel`): rows x query heads of one program's query
#: operand at most (a longer segment is cut into several), its inner-loop block and warps (for an
#: operand above 64 x 128; 4 below). 128 queries keep the fp32 accumulator in registers at head_dim 128.
MAX_PREFIX_QUERIES, PREFIX_BLOCK_N, PREFIX_NUM_WARPS = 128, 64, 8
#: Bounds of the automatic prefix split length (columns): about one program per SM over a full cache.
MIN_PREFIX_SPLIT, MAX_PREFIX_SPLIT = 128, 1024


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


def prefix_rows(heads_per_kv: int, group_size: int) -> int:
    """Rows per segment for groups of ``group_size`` rows sharing a prefix: the whole group, cut so
    that one program's query operand holds at most :data:`MAX_PREFIX_QUERIES` rows x heads.

    Example:
        >>> prefix_rows(6, 16), prefix_rows(7, 64)
        (16, 18)
    """
    return max(1, min(group_size, MAX_PREFIX_QUERIES // heads_per_kv))


def shared_prefix_segments(segment_of_row: Tensor, num_segments: int) -> Tuple[Tensor, Tensor]:
    """``(seg_start, seg_rows)`` of rows labelled with their segment, on the device, without a sync.

    Args:
        segment_of_row (Tensor): ``(R,)`` int64, non-decreasing: row ``r`` belongs to segment
            ``segment_of_row[r]`` (rows of one segment are consecutive), in ``[0, num_segments)``.
        num_segments (int): S, the segment table's length (segments without rows get 0 rows).

    Returns:
        Tuple[Tensor, Tensor]: ``(S,)`` int32 first rows and row counts.

    Example:
        >>> shared_prefix_segments(torch.tensor([0, 0, 2, 2, 2]), 3)
        (tensor([0, 2, 2], dtype=torch.int32), tensor([2, 0, 3], dtype=torch.int32))
    """
    rows = torch.bincount(segment_of_row, minlength=num_segments)[:num_segments]
    return (rows.cumsum(0) - rows).to(torch.int32), rows.to(torch.int32)


def group_segments(rows: Tensor, group_size: int, rows_per_segment: int,
                   num_groups: int) -> Tuple[Tensor, Tensor]:
    """``(seg_start, seg_rows)`` of a batch whose row ``r`` is row ``rows[r]`` of ``num_groups``
    groups of ``group_size`` consecutive rows, each group cut into segments of ``rows_per_segment``
    (:func:`prefix_rows`); a segment without rows left (compacted away) gets 0 rows.

    Args:
        rows (Tensor): ``(R,)`` int64, ascending: the original row of each row of the batch.
        group_size (int): G. rows_per_segment (int): rows per segment at most. num_groups (int): P.

    Returns:
        Tuple[Tensor, Tensor]: ``(P * ceil(G / rows_per_segment),)`` int32 first rows and row counts.

    Example:
        >>> group_segments(torch.tensor([0, 2, 3, 4]), 4, 2, 2)
        (tensor([0, 1, 3, 4], dtype=torch.int32), tensor([1, 2, 1, 0], dtype=torch.int32))
    """
    per_group = -(-group_size // rows_per_segment)
    segment = rows // group_size * per_group + rows % group_size // rows_per_segment
    return shared_prefix_segments(segment, num_groups * per_group)


@triton.jit
def _attend(q, k_base, v_base, valid_base, stride_kl, stride_kd, stride_vl, stride_vd, stride_ml, start, end, scale,
            M: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_DOT: tl.constexpr):
    """The online softmax of the ``M`` queries ``q`` over the valid keys of columns ``[start, end)`` of
    one cache row: its running max, sum of ``exp(s - max)`` and weighted sum of values (fp32)."""
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D_PAD], tl.float32)
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
    return m_i, l_i, acc


@triton.jit
def _split_len(n, pairs, budget, SPLIT_LEN: tl.constexpr, FILL_STEPS: tl.constexpr, MAX_ROW_SPLITS: tl.constexpr):
    """Columns per split for ``n`` columns to split over ``pairs`` (row, K/V head) pairs: ``SPLIT_LEN``,
    or with ``FILL_STEPS`` the shortest of ``SPLIT_LEN << i`` (``i <= FILL_STEPS``) whose splits holding
    columns number at most ``budget`` over the grid and ``MAX_ROW_SPLITS`` per pair (the longest if none
    does). Every program reads the same ``n``, so all choose the same length; see :func:`fill_split_len`."""
    split = SPLIT_LEN
    if FILL_STEPS > 0:
        split = n * 0 + SPLIT_LEN
        for _ in tl.static_range(FILL_STEPS):
            splits = tl.cdiv(n, split)
            split = tl.where((pairs * splits > budget) | (splits > MAX_ROW_SPLITS), split * 2, split)
    return split


@triton.jit
def _rotated(x_ptr, d, cos, sin, mask, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Elements ``d`` of the vectors at ``x_ptr`` (contiguous) rotated by their position:
    ``x_d cos_d + x_e sin_d``, ``e`` the other element of ``d``'s pair (``d ^ 1`` with ``INTERLEAVED``,
    else ``d -+ HALF``) and ``sin_d`` signed (:func:`~logitless.generation.kernels.decode_rotary.rotation_coefficients`),
    in fp32 with one rounding to the input dtype."""
    if INTERLEAVED:
        partner = d ^ 1
    else:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
    raw = tl.load(x_ptr + d, mask=mask, other=0.0)
    other = tl.load(x_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    return (raw.to(tl.float32) * cos + other * sin).to(raw.dtype)


@triton.jit
def decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, n_ptr, col0_ptr, m_ptr, l_ptr, acc_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_mb, stride_ml,
    L, scale,
    arrivals_ptr, covered_ptr, out_ptr, stride_ob, stride_oh, stride_od,
    k_new_ptr, v_new_ptr, cos_ptr, sin_ptr, stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cb,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SLOTS: tl.constexpr, SLOT0: tl.constexpr, SPLIT_LEN: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr, WIDE_DOT: tl.constexpr, PDL: tl.constexpr,
    MERGE: tl.constexpr = False, PREFIX_SPLIT_LEN: tl.constexpr = 1,
    ROTARY: tl.constexpr = False, INTERLEAVED: tl.constexpr = False,
    fill_budget=0, FILL_STEPS: tl.constexpr = 0, MAX_ROW_SPLITS: tl.constexpr = 1,
):
    """Grid ``(B, Hkv, splits)``: the online-softmax partial of columns
    ``[col0 + split * S, min(+S, n_filled))`` for the ``G`` query heads of one K/V
    head, into workspace slot ``SLOT0 + split`` (``col0`` = 0, or the shared prefix's width with
    ``HAS_PREFIX``: :func:`decode_prefix_kernel` covers the columns before it). A program whose
    split starts at or past ``n_filled`` exits at once (split 0 excepted): past the first steps of
    a rollout most of a grid sized for the whole cache is such programs, and they neither count
    themselves nor hold up the merge. ``S`` is ``SPLIT_LEN``, or with ``FILL_STEPS`` the split every
    program chooses from ``n_filled`` (:func:`_split_len`; the grid is cut for ``SPLIT_LEN``).

    Both products accumulate in fp32; ``WIDE_DOT`` widens their operands to fp32 first (exactly)
    and multiplies in IEEE fp32: for fp32 inputs (no TF32 rounding), and for bf16 under the
    interpreter, whose bf16 ``tl.dot`` returns garbage (triton 3.9). ``PDL``: launched as a
    programmatic dependent launch, so it waits for the previous kernel before its first load.

    ``MERGE``: the last program of a (row, K/V head) to finish also merges its partials into the
    output, as :func:`decode_merge_kernel` would (one launch fewer). Every program whose split holds
    columns (and split 0, which merges a row without columns of its own) counts itself in
    ``arrivals[row * Hkv + head]`` (int32, zero before the launch) after its stores; the one that
    brings the count to the number of such splits merges, in slot order (the same sums as the merge
    kernel's, so the same output bits), and sets the count back to zero for the next launch.

    With ``HAS_PREFIX`` and ``PDL`` the kernel before it is :func:`decode_prefix_kernel`, which lets it
    launch as soon as all its programs have passed their own wait: everything this kernel reads but
    the prefix partials (the query, the cache, the fill) was written before that, so its programs
    stream their columns while the prefix programs stream theirs, and wait for them only after their
    own stores, before the merge (and before exiting, so that the next kernel's wait covers both).

    ``ROTARY`` (a :class:`NewToken`, without a prefix): ``q`` is the unrotated query, rotated as it is
    loaded; the program whose split holds column ``n_filled - 1`` rotates the new key, stores it and
    the new value there, attends to the columns before it and then folds the new column in from
    registers, so that no load waits for those stores.
    """
    if PDL and not HAS_PREFIX:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n = tl.minimum(tl.load(n_ptr), L).to(tl.int32)
    col0 = 0
    if HAS_PREFIX:
        col0 = tl.minimum(tl.load(col0_ptr), n).to(tl.int32)
    split_len = _split_len(n - col0, tl.num_programs(0) * tl.num_programs(1), fill_budget, SPLIT_LEN, FILL_STEPS,
                           MAX_ROW_SPLITS)
    start = col0 + split * split_len
    end = tl.minimum(start + split_len, n)
    # the splits that hold columns: the others exit at once, and neither count themselves nor hold
    # up the merge (split 0 always runs, to merge a row with no columns of its own)
    active = tl.maximum(tl.cdiv(n - col0, split_len), 1)
    if split >= active:
        return
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    q_ok = ((g < G) & (start + 0 * g < end))[:, None] & (d < D)[None, :]  # an empty split loads nothing
    loop_end = end
    if ROTARY:
        d_ok = d < D
        cos = tl.load(cos_ptr + b * stride_cb + d, mask=d_ok, other=0.0)
        sin = tl.load(sin_ptr + b * stride_cb + d, mask=d_ok, other=0.0)
        q = _rotated(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh, d[None, :], cos[None, :],
                     sin[None, :], q_ok, D // 2, INTERLEAVED)
        col = n - 1
        own = (col >= start) & (col < end)  # this program holds the step's own column
        # the new key and value go into the caches, and into the softmax from registers after the
        # loop: nothing waits for the stores. `write` is `own` per element: the interpreter does not
        # broadcast a scalar mask
        write = d_ok & (col + 0 * d >= start) & (col + 0 * d < end)
        k_new = _rotated(k_new_ptr + b * stride_nkb + h * stride_nkh, d, cos, sin, write, D // 2, INTERLEAVED)
        v_new = tl.load(v_new_ptr + b * stride_nvb + h * stride_nvh + d, mask=write, other=0.0)
        tl.store(k_ptr + b * stride_kb + h * stride_kh + col.to(tl.int64) * stride_kl + d * stride_kd, k_new,
                 mask=write)
        tl.store(v_ptr + b * stride_vb + h * stride_vh + col.to(tl.int64) * stride_vl + d * stride_vd, v_new,
                 mask=write)
        loop_end = tl.where(own, col, end)
    else:
        q = tl.load(q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=q_ok, other=0.0)
    m_i, l_i, acc = _attend(q, k_ptr + b * stride_kb + h * stride_kh, v_ptr + b * stride_vb + h * stride_vh,
                            valid_ptr + b * stride_mb, stride_kl, stride_kd, stride_vl, stride_vd, stride_ml,
                            start, loop_end, scale, G_PAD, D, D_PAD, BLOCK_N, WIDE_DOT)
    if ROTARY:
        if own:  # the step's own column, as one more column of the loop's last block
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
            valid_new = tl.load(valid_ptr + b * stride_mb + col.to(tl.int64) * stride_ml) != 0
            s_new = tl.where(valid_new, s_new, float("-inf"))
            m_new = tl.maximum(m_i, s_new)
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - ref)
            p = tl.exp(s_new - ref)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
    if PDL:  # the next kernel may launch now; it waits for this grid to finish before reading
        tl.extra.cuda.gdc_launch_dependents()
    # (B, Hkv, NUM_SLOTS, G[, D_PAD]) fp32; the merge reads the non-empty splits only, so an empty
    # split writes nothing
    row = ((b * tl.num_programs(1) + h) * NUM_SLOTS + SLOT0 + split) * G + g
    keep = (g < G) & (start + 0 * g < end)
    tl.store(m_ptr + row, m_i, mask=keep)
    tl.store(l_ptr + row, l_i, mask=keep)
    tl.store(acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=keep[:, None])
    if PDL and HAS_PREFIX:  # the prefix partials are complete and visible past this point
        tl.extra.cuda.gdc_wait()
    if MERGE:
        tl.debug_barrier()  # every thread's stores are issued before the count (a release, gpu scope)
        counter = arrivals_ptr + b * tl.num_programs(1) + h
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == active - 1:
            _merge_row(m_ptr, l_ptr, acc_ptr, n, col0, covered_ptr, out_ptr, stride_ob, stride_oh, stride_od, b, h,
                       tl.num_programs(1), G, G_PAD, D, D_PAD, NUM_SLOTS, SLOT0, split_len, PREFIX_SPLIT_LEN,
                       HAS_PREFIX)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def decode_prefix_kernel(
    q_ptr, k_ptr, v_ptr, valid_ptr, n_ptr, width_ptr, seg_start_ptr, seg_rows_ptr, m_ptr, l_ptr, acc_ptr,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_mb, stride_ml,
    L, scale,
    G: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SLOTS: tl.constexpr, SPLIT_LEN: tl.constexpr, BLOCK_N: tl.constexpr, WIDE_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid ``(segments, Hkv, prefix splits)``: the partial of prefix columns
    ``[split * SPLIT_LEN, min(+SPLIT_LEN, width))`` for every query head of every row of one
    segment (``seg_rows`` consecutive rows from ``seg_start`` that share those columns), read once
    from the segment's first row: its ``rows x G`` queries are one ``M_PAD``-row operand of the
    products, so the shared keys and values cost one read per segment, not one per row. Writes
    workspace slot ``split`` of each of those rows; a segment of 0 rows reads and writes nothing.

    ``PDL``: it waits for the previous kernel, then at once lets the partial kernel launch, whose
    programs read only what was written before this kernel until they wait for it.
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n = tl.minimum(tl.load(n_ptr), L).to(tl.int32)
    width = tl.minimum(tl.load(width_ptr), n).to(tl.int32)
    rows = tl.load(seg_rows_ptr + s)
    r0 = tl.load(seg_start_ptr + s).to(tl.int64)
    start = split * SPLIT_LEN
    end = tl.where(rows > 0, tl.minimum(start + SPLIT_LEN, width), start)
    i = tl.arange(0, M_PAD)
    r = i // G
    g = i % G
    d = tl.arange(0, D_PAD)
    live = (r < rows) & (start + 0 * i < end)
    b = r0 + r
    q = tl.load(q_ptr + b[:, None] * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=live[:, None] & (d < D)[None, :], other=0.0)
    m_i, l_i, acc = _attend(q, k_ptr + r0 * stride_kb + h * stride_kh, v_ptr + r0 * stride_vb + h * stride_vh,
                            valid_ptr + r0 * stride_mb, stride_kl, stride_kd, stride_vl, stride_vd, stride_ml,
                            start, end, scale, M_PAD, D, D_PAD, BLOCK_N, WIDE_DOT)
    row = ((b * tl.num_programs(1) + h) * NUM_SLOTS + split) * G + g
    tl.store(m_ptr + row, m_i, mask=live)
    tl.store(l_ptr + row, l_i, mask=live)
    tl.store(acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=live[:, None])


@triton.jit
def _merge_slot(m_all, l_all, o, m_ptr, l_ptr, acc_ptr, row, g_ok, d, D_PAD: tl.constexpr):
    """Folds one slot's partial (rows ``row`` of the workspace) into the running merge (loads through
    L2: in the partial kernel's merge, other programs of the same launch wrote them)."""
    m = tl.load(m_ptr + row, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
    m_new = tl.maximum(m_all, m)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split without a valid key weighs 0
    w_all = tl.exp(m_all - ref)
    w = tl.exp(m - ref)
    l_all = l_all * w_all + tl.load(l_ptr + row, mask=g_ok, other=0.0, cache_modifier=".cg") * w
    o = o * w_all[:, None] + tl.load(acc_ptr + row[:, None] * D_PAD + d[None, :], mask=g_ok[:, None],
                                     other=0.0, cache_modifier=".cg") * w[:, None]
    return m_new, l_all, o


@triton.jit
def _merge_row(m_ptr, l_ptr, acc_ptr, n, col0, covered_ptr, out_ptr, stride_ob, stride_oh, stride_od, b, h, hkv,
               G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
               NUM_SLOTS: tl.constexpr, SLOT0: tl.constexpr, split_len,
               PREFIX_SPLIT_LEN: tl.constexpr, HAS_PREFIX: tl.constexpr):
    """Merges the non-empty partials of the ``G`` query heads of K/V head ``h`` of row ``b`` into
    their outputs: with ``HAS_PREFIX``, the prefix splits of a row inside a segment (rows below
    ``covered``), then the splits from ``col0`` on (one slot's ``(G, D)`` tile at a time)."""
    prefix_used = 0
    if HAS_PREFIX:
        prefix_used = tl.where(b < tl.load(covered_ptr), tl.cdiv(col0, PREFIX_SPLIT_LEN), 0)
    used = tl.cdiv(n - col0, split_len)  # the splits past n_filled are empty: not read
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    d = tl.arange(0, D_PAD)
    m_all = tl.full([G_PAD], float("-inf"), tl.float32)
    l_all = tl.zeros([G_PAD], tl.float32)
    o = tl.zeros([G_PAD, D_PAD], tl.float32)
    first = (b * hkv + h) * NUM_SLOTS
    for slot in range(0, prefix_used):
        m_all, l_all, o = _merge_slot(m_all, l_all, o, m_ptr, l_ptr, acc_ptr, (first + slot) * G + g, g_ok, d, D_PAD)
    for split in range(0, used):
        m_all, l_all, o = _merge_slot(m_all, l_all, o, m_ptr, l_ptr, acc_ptr, (first + SLOT0 + split) * G + g, g_ok,
                                      d, D_PAD)
    o = o / tl.where(l_all > 0, l_all, 1.0)[:, None]  # no valid key at all: 0
    heads = h * G + g
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & (d < D)[None, :])


@triton.jit
def decode_merge_kernel(
    m_ptr, l_ptr, acc_ptr, n_ptr, col0_ptr, covered_ptr, out_ptr, stride_ob, stride_oh, stride_od, L,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SLOTS: tl.constexpr, SLOT0: tl.constexpr, SPLIT_LEN: tl.constexpr, PREFIX_SPLIT_LEN: tl.constexpr,
    HAS_PREFIX: tl.constexpr, PDL: tl.constexpr,
    fill_budget=0, FILL_STEPS: tl.constexpr = 0, MAX_ROW_SPLITS: tl.constexpr = 1,
):
    """Grid ``(B, Hkv)``: merges the non-empty partials of the ``G`` query heads of one K/V head
    into their outputs (one slot's ``(G, D)`` tile at a time): with ``HAS_PREFIX``, the prefix
    splits of a row inside a segment (rows below ``covered``), then the splits from ``col0`` on."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    n = tl.minimum(tl.load(n_ptr), L).to(tl.int32)
    col0 = 0
    if HAS_PREFIX:
        col0 = tl.minimum(tl.load(col0_ptr), n).to(tl.int32)
    split_len = _split_len(n - col0, tl.num_programs(0) * tl.num_programs(1), fill_budget, SPLIT_LEN, FILL_STEPS,
                           MAX_ROW_SPLITS)
    _merge_row(m_ptr, l_ptr, acc_ptr, n, col0, covered_ptr, out_ptr, stride_ob, stride_oh, stride_od, b, h,
               tl.num_programs(1), G, G_PAD, D, D_PAD, NUM_SLOTS, SLOT0, split_len, PREFIX_SPLIT_LEN, HAS_PREFIX)


def default_split_len(rows: int, kv_heads: int, length: int, num_sms: int = 132,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """A split length fixed for the whole cache: about ``programs_per_sm`` programs per SM over a full
    cache, a power of two in ``[MIN_SPLIT, MAX_SPLIT]`` (per-row attention without a given split
    chooses from the fill instead, :func:`fill_split_len`).

    Many rows get long splits, so that fewer partials are written and merged. Few rows (a compacted
    bucket) stop at ``MIN_SPLIT``: shorter splits would spread their keys over more programs, but the
    merge, which walks each row's splits in order, then costs more than the spread gains.

    Args:
        rows (int): B.
        kv_heads (int): Hkv.
        length (int): the cache length L.
        num_sms (int): streaming multiprocessors of the GPU (an H200 has 132).
        programs_per_sm (int): :data:`PROGRAMS_PER_SM`, or :data:`SHARED_PROGRAMS_PER_SM` for the
            rows' own columns after a shared prompt.

    Returns:
        int: columns per split.

    Example:
        >>> default_split_len(64, 4, 4096), default_split_len(8, 2, 1536), default_split_len(64, 2, 1536, 132, 4)
        (512, 256, 256)
    """
    target = rows * kv_heads * length / (programs_per_sm * num_sms)
    split = 1 << max(0, int(math.floor(math.log2(max(target, 1.0)))))
    return max(MIN_SPLIT, min(MAX_SPLIT, split))


def fill_split_len(columns: int, pairs: int, num_sms: int = 132, min_split: int = FILL_MIN_SPLIT,
                   max_split: int = MAX_SPLIT) -> int:
    """The split length the per-row kernels choose on the device for ``columns`` filled columns
    (without a given split length): the shortest power of two from ``min_split`` up to
    ``max_split`` whose splits holding columns number at most :data:`FILL_PROGRAMS_PER_SM` per SM
    over ``pairs`` (row, K/V head) pairs and at most :data:`FILL_MAX_ROW_SPLITS` per pair, else
    ``max_split``. The kernels compute the same from ``n_filled`` (``_split_len``).

    Args:
        columns (int): filled columns (``n_filled``).
        pairs (int): rows x K/V heads of the launch.
        num_sms (int): streaming multiprocessors of the GPU (an H200 has 132).
        min_split (int): the shortest split (the launch's grid is cut for it).
        max_split (int): the longest, a power-of-two multiple of ``min_split``.

    Returns:
        int: columns per split.

    Example:
        >>> fill_split_len(384, 64 * 2), fill_split_len(640, 64 * 2), fill_split_len(384, 64 * 4)
        (128, 256, 512)
    """
    split, budget = min_split, FILL_PROGRAMS_PER_SM * num_sms
    while split < max_split:
        splits = -(-columns // split)
        if pairs * splits <= budget and splits <= FILL_MAX_ROW_SPLITS:
            break
        split *= 2
    return split


def launch_split_len(rows: int, kv_heads: int, length: int, block_n: int, device: torch.device,
                     programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """The fixed split length of the rows' own columns after a shared prompt when none is given
    (:func:`resolve_launch`): :func:`default_split_len` for ``device``'s SMs, at least one ``block_n`` block.

    Args:
        rows (int): B. kv_heads (int): Hkv. length (int): the cache length L.
        block_n (int): columns per inner-loop block.
        device (torch.device): where the kernel runs (its SM count; 132 off CUDA).
        programs_per_sm (int): as :func:`default_split_len`'s.

    Returns:
        int: columns per split.

    Example:
        >>> launch_split_len(8, 2, 1536, 64, torch.device("cpu"))
        256
    """
    return max(block_n, default_split_len(rows, kv_heads, length, sm_count(device), programs_per_sm))


def prefix_split_len_for(segments: int, kv_heads: int, length: int, device: torch.device) -> int:
    """The shared-prefix split length when none is given: about one program per SM over a full
    cache of ``length`` columns, a power of two in ``[MIN_PREFIX_SPLIT, MAX_PREFIX_SPLIT]``.

    Example:
        >>> prefix_split_len_for(4, 2, 1536, torch.device("cpu"))
        128
    """
    target = segments * kv_heads * length / sm_count(device)
    split = 1 << max(0, int(math.floor(math.log2(max(target, 1.0)))))
    return max(MIN_PREFIX_SPLIT, min(MAX_PREFIX_SPLIT, split))


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


class Launch(NamedTuple):
    """The partial kernel's launch (:func:`resolve_launch`).

    Fields: ``split_len`` (columns per split, the grid's cut), ``block_n``, ``num_warps``,
    ``num_stages`` and ``max_split_len``: ``split_len`` for a fixed split; larger when the kernels
    choose the split on the device from ``n_filled`` (:func:`fill_split_len`), from ``split_len`` up
    to it.
    """

    split_len: int
    block_n: int
    num_warps: int
    num_stages: int
    max_split_len: int

    @property
    def fill_steps(self) -> int:
        """Doublings of ``split_len`` the kernels may choose (0: a fixed split)."""
        return (self.max_split_len // self.split_len).bit_length() - 1


def resolve_launch(rows: int, kv_heads: int, length: int, device: torch.device, split_len: int = 0,
                   block_n: int = 0, num_warps: int = 0, num_stages: int = 0,
                   shared_prompt: bool = False) -> Launch:
    """The launch the kernels run with: the parameters given (non-zero), the defaults for the rest.

    The block defaults to :data:`BLOCK_N`, at most a given split; the warps and stages to
    :data:`NUM_WARPS` and :data:`NUM_STAGES`. Without a given split, the rows' own splits after a
    shared prompt take :func:`launch_split_len` (aiming at :data:`SHARED_PROGRAMS_PER_SM`), and
    per-row attention a split chosen on the device from ``n_filled`` between
    :data:`FILL_MIN_SPLIT` (at least one block) and :data:`MAX_SPLIT` (:func:`fill_split_len`).

    Args:
        rows (int): B. kv_heads (int): Hkv. length (int): the cache length L.
        device (torch.device): where the kernels run (its SM count).
        split_len, block_n, num_warps, num_stages (int): as given; 0 = the default.
        shared_prompt (bool): the rows' own splits after a :class:`SharedPrefix`.

    Returns:
        Launch: ``(split_len, block_n, num_warps, num_stages, max_split_len)``.

    Example:
        >>> resolve_launch(8, 2, 1536, torch.device("cpu"), split_len=64)
        Launch(split_len=64, block_n=64, num_warps=4, num_stages=2, max_split_len=64)
        >>> resolve_launch(64, 2, 640, torch.device("cpu"))
        Launch(split_len=128, block_n=128, num_warps=4, num_stages=2, max_split_len=512)
    """
    if split_len:
        block_n = block_n or min(BLOCK_N, split_len)
        longest = split_len
    else:
        block_n = block_n or BLOCK_N
        if shared_prompt:
            split_len = longest = launch_split_len(rows, kv_heads, length, block_n, device, SHARED_PROGRAMS_PER_SM)
        else:
            split_len = max(block_n, FILL_MIN_SPLIT)
            longest = max(split_len, MAX_SPLIT)
    return Launch(split_len, block_n, num_warps or NUM_WARPS, num_stages or NUM_STAGES, longest)


def supports_programmatic_launch(device: torch.device) -> bool:
    """Whether ``device`` can run kernels as programmatic dependent launches (a CUDA GPU of compute
    capability 9.0 or later, outside the interpreter): a kernel may then be scheduled while the one
    before it finishes, and waits for it (``gdc_wait``) before its first load.

    Example:
        >>> supports_programmatic_launch(torch.device("cpu"))
        False
    """
    return device.type == "cuda" and not triton_interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


def _launch(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, n_filled: Tensor, scale: float, launch: Launch,
            pdl: bool, prefix: Optional[Tuple[Tensor, Tensor, Tensor, Tensor, int, int]] = None,
            new_token: Optional[Tuple[Tensor, Tensor, Tensor, Tensor, bool]] = None) -> Tensor:
    # prefix: (width, seg_start, seg_rows, covered, max_rows, prefix_split_len) of a SharedPrefix;
    # new_token: (k, v, cos, sin, interleaved) of a NewToken
    split_len, block_n, num_warps, num_stages = launch[:4]
    # the grid and the workspace are cut for the shortest split; the kernels pick the split from n_filled
    fill = dict(fill_budget=FILL_PROGRAMS_PER_SM * sm_count(q.device), FILL_STEPS=launch.fill_steps,
                MAX_ROW_SPLITS=FILL_MAX_ROW_SPLITS)
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
        decode_prefix_kernel[(seg_start.shape[0], hkv, prefix_slots)](
            q, k, v, key_valid, n_filled, width, seg_start, seg_rows, m, l, acc, *strides, length, scale,
            G=group, M_PAD=m_pad, D=d, D_PAD=d_pad, NUM_SLOTS=slots, SPLIT_LEN=prefix_split_len,
            BLOCK_N=min(PREFIX_BLOCK_N, prefix_split_len), WIDE_DOT=wide, PDL=pdl,
            num_warps=PREFIX_NUM_WARPS if m_pad * d_pad > 64 * 128 else 4, num_stages=num_stages, launch_pdl=pdl,
        )
    arrivals = _arrivals(q.device, b * hkv) if MERGE_IN_PARTIAL else None
    outs = (covered, out, out.stride(0), out.stride(1), out.stride(2))
    decode_partial_kernel[(b, hkv, splits)](
        q, k, v, key_valid, n_filled, width, m, l, acc, *strides, length, scale, arrivals if arrivals is not None else m,
        *outs, *rot_args, **rot_flags, G=group, G_PAD=g_pad, D=d, D_PAD=d_pad, NUM_SLOTS=slots, SLOT0=prefix_slots,
        SPLIT_LEN=split_len,
        BLOCK_N=block_n, HAS_PREFIX=prefix is not None, WIDE_DOT=wide, PDL=pdl, MERGE=arrivals is not None,
        PREFIX_SPLIT_LEN=prefix_split_len, **fill, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )
    if arrivals is None:
        decode_merge_kernel[(b, hkv)](
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
    launch = resolve_launch(q.shape[0], k.shape[1], k.shape[2], q.device, split_len, block_n, num_warps, num_stages)
    return _launch(q, k, v, key_valid, n_filled, scale, launch, programmatic and supports_programmatic_launch(q.device))


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
    launch = resolve_launch(q.shape[0], k.shape[1], k.shape[2], q.device, split_len, block_n, num_warps, num_stages,
                            shared_prompt=True)
    psl = prefix_split_len or prefix_split_len_for(seg_start.shape[0], k.shape[1], k.shape[2], q.device)
    return _launch(q, k, v, key_valid, n_filled, scale, launch, programmatic and supports_programmatic_launch(q.device),
                   (width, seg_start, seg_rows, covered, max_rows, psl))


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
    launch = resolve_launch(q.shape[0], k.shape[1], k.shape[2], q.device, split_len, block_n, num_warps, num_stages)
    return _launch(q, k, v, key_valid, n_filled, scale, launch, programmatic and supports_programmatic_launch(q.device),
                   new_token=token)


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
    if not isinstance(prefix.max_rows, int) or not 1 <= prefix.max_rows * group <= MAX_PREFIX_QUERIES:
        raise ValueError(f"decode_attention: shared_prefix.max_rows x query heads per K/V head ({group}) must be in "
                         f"[1, {MAX_PREFIX_QUERIES}], got max_rows={prefix.max_rows!r} (see prefix_rows)")
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
