"""The decode attention's Triton kernels (launched by :mod:`.op`): ``decode_partial_kernel`` (a split
of one row's filled columns, optionally with the merge and the new token's rotation and cache write),
``decode_prefix_kernel`` (a shared prompt's columns once per segment of rows) and
``decode_merge_kernel`` (the merge of a row's splits when the partial kernel does not do it).
"""

import triton
import triton.language as tl


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
