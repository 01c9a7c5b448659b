"""Triton epilogue kernels for the fused LM head.

The GEMMs (logits, dh, dW) run in cuBLAS through ``torch.matmul``; these kernels do everything in
between, over one chunk of rows of bf16/fp16/fp32 logits at a time:

* ``row_stats_kernel``: one pass over a row (split over ``NUM_SPLITS`` programs) computing, per
  split, the running max ``m``, ``s = sum exp(z - m)`` and ``t = sum exp(z - m) (z - m)`` with
  ``z = logit / T`` in fp32. Padded columns are ``-inf`` (never 0) and the running max starts at
  ``-inf``.
* ``merge_slab_kernel`` / ``finalize_state_kernel``: the forward-only path walks V in slabs and
  folds each slab's statistics into a running per-row state (taking them itself when a row of the
  tile is one split), then finalizes it.
* ``finalize_tile_stats_kernel``: the same outputs from per-(row, N tile) statistics that a GEMM
  epilogue wrote (QuACK's, ``logitless.ops.quack_head``).
* ``finalize_kernel``: merges the splits of a row into ``lse = m + log s``,
  ``entropy = log s - t / s`` and ``logp = z[label] - lse`` (0 at ignored rows).
* ``col_stats_kernel`` / ``dlogits_t_kernel``: the same two passes over a transposed ``(V slab, rows)``
  tile (the one-pass CE's cached first block, kept in dW's buffer), in 2-D blocks.
* ``slab_row_inputs_kernel`` / ``label_dlogits_kernel``: the per-row inputs of a GEMM epilogue
  that writes a slab's dlogits (QuACK's, ``logitless.ops.quack_head``) and the label entries it
  leaves to them.
* ``dlogits_kernel``: overwrites the logits of a chunk with the gradient w.r.t. the raw logits,
  ``(1/T) * (c_lp (onehot - p) - c_ent p (log p + entropy))``, in the logits' dtype, in place.
* ``take_columns_kernel`` / ``add_label_rows_kernel``: the one pass's pinned label columns
  (``head.PinnedColumns``): a chunk's dlogits at the most frequent labels' columns and at each
  row's own label are moved out before its dW GEMM; after the last chunk the label entries are
  summed per label in fp32 into dW's rows.
* ``scale_kernel``: multiplies a gradient in place by a scalar read on the device (skips when it
  is 1), so the scalar-upstream regime needs no host sync and no second copy of dW.

All row offsets are int64 (``N * V`` may exceed 2**31).
"""

import triton
import triton.language as tl


@triton.jit
def _merge(m_a, s_a, t_a, m_b, s_b, t_b):
    # Merges two (max, sum exp(z-max), sum exp(z-max)(z-max)) triples; a side that has seen no
    # finite value has m=-inf, s=0, t=0 and must contribute nothing (no -inf * 0 = NaN).
    m = tl.maximum(m_a, m_b)
    ref = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(m_a - ref)
    w_b = tl.exp(m_b - ref)
    t = w_a * (t_a + tl.where(s_a > 0, (m_a - ref) * s_a, 0.0)) + w_b * (
        t_b + tl.where(s_b > 0, (m_b - ref) * s_b, 0.0)
    )
    s = w_a * s_a + w_b * s_b
    return m, s, t


@triton.jit
def _merge_splits(part, NUM_SPLITS: tl.constexpr):
    """Merges one row's ``NUM_SPLITS`` partial (max, sum, weighted sum) triples stored at ``part``."""
    m = tl.load(part)
    s = tl.load(part + 1)
    t = tl.load(part + 2)
    for j in tl.static_range(1, NUM_SPLITS):
        m, s, t = _merge(m, s, t, tl.load(part + 3 * j), tl.load(part + 3 * j + 1),
                         tl.load(part + 3 * j + 2))
    return m, s, t


@triton.jit
def _span_stats(base, start, end, span, inv_t, BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr):
    """(max, sum exp(z - max), sum exp(z - max)(z - max)) of ``z = base[start:end] * inv_t``.

    Block-wide reductions (one exp per element); with ``PREFETCH`` the next block is loaded
    before the current one is reduced, so two blocks of loads are in flight per program.
    """
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    t = 0.0
    x_next = tl.load(base + start + offs, mask=start + offs < end, other=0.0)
    for k in range(0, span, BLOCK_V):
        cols = start + k + offs
        mask = cols < end
        if PREFETCH:
            x = x_next
            x_next = tl.load(base + cols + BLOCK_V, mask=cols + BLOCK_V < end, other=0.0)
        else:
            x = tl.load(base + cols, mask=mask, other=0.0)
        z = tl.where(mask, x.to(tl.float32) * inv_t, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.exp(z - ref)
        alpha = tl.exp(m - ref)
        t = alpha * (t + tl.where(s > 0, (m - ref) * s, 0.0)) + tl.sum(tl.where(mask, e * (z - ref), 0.0), 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
    return m, s, t


@triton.jit
def row_stats_kernel(
    logits_ptr, stride_row, part_ptr, V, span, inv_t,
    NUM_SPLITS: tl.constexpr, BLOCK_V: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid ``(rows, NUM_SPLITS)``: partial softmax statistics of columns ``[split*span, +span)``."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * span
    m, s, t = _span_stats(logits_ptr + row.to(tl.int64) * stride_row, start, tl.minimum(start + span, V),
                          span, inv_t, BLOCK_V, PREFETCH)
    out = part_ptr + (row.to(tl.int64) * NUM_SPLITS + split) * 3
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, t)


@triton.jit
def merge_slab_kernel(
    logits_ptr, stride_row, stride_col, part_ptr, state_ptr, zy_ptr, labels_ptr, idx_ptr, row0,
    v0, vlen, inv_t, ignore_index,
    NUM_SPLITS: tl.constexpr, HAS_IDX: tl.constexpr, FIRST: tl.constexpr,
    STATS: tl.constexpr = False, BLOCK_V: tl.constexpr = 64, PREFETCH: tl.constexpr = False,
):
    """Grid ``(rows,)``: folds a V-slab's partial statistics into the running per-row state.

    ``state`` is fp32 ``(rows_total, 3)`` indexed by (compacted) row ``row0 + row``; the label's
    logit is captured when it falls inside the slab ``[v0, v0 + vlen)``. With ``STATS`` the
    program takes the statistics of its row's slab itself (contiguous columns, one launch instead
    of ``row_stats_kernel`` + this one: the forward's tiles have one split per row); else it
    merges the ``NUM_SPLITS`` partials in ``part``.
    """
    row = tl.program_id(0)
    srow = row.to(tl.int64) + row0
    if HAS_IDX:
        orow = tl.load(idx_ptr + srow).to(tl.int64)
    else:
        orow = srow
    if STATS:
        m, s, t = _span_stats(logits_ptr + row.to(tl.int64) * stride_row, 0, vlen, vlen, inv_t,
                              BLOCK_V, PREFETCH)
    else:
        m, s, t = _merge_splits(part_ptr + row.to(tl.int64) * NUM_SPLITS * 3, NUM_SPLITS)
    st = state_ptr + srow * 3
    if not FIRST:
        m, s, t = _merge(tl.load(st), tl.load(st + 1), tl.load(st + 2), m, s, t)
    tl.store(st, m)
    tl.store(st + 1, s)
    tl.store(st + 2, t)
    label = tl.load(labels_ptr + orow)
    local = label - v0
    inside = (label != ignore_index) & (local >= 0) & (local < vlen)
    safe = tl.where(inside, local, 0).to(tl.int64)
    z_y = tl.load(logits_ptr + row.to(tl.int64) * stride_row + safe * stride_col).to(tl.float32) * inv_t
    tl.store(zy_ptr + srow, z_y, mask=inside)


@triton.jit
def finalize_state_kernel(
    state_ptr, zy_ptr, labels_ptr, idx_ptr, logp_ptr, ent_ptr, lse_ptr, n_rows, ignore_index,
    HAS_IDX: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(rows_total, BLOCK),)``: running state -> lse, entropy, logp at each token."""
    srow = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = srow < n_rows
    if HAS_IDX:
        orow = tl.load(idx_ptr + srow, mask=ok, other=0).to(tl.int64)
    else:
        orow = srow
    m = tl.load(state_ptr + srow * 3, mask=ok, other=0.0)
    s = tl.load(state_ptr + srow * 3 + 1, mask=ok, other=1.0)
    t = tl.load(state_ptr + srow * 3 + 2, mask=ok, other=0.0)
    z_y = tl.load(zy_ptr + srow, mask=ok, other=0.0)
    label = tl.load(labels_ptr + orow, mask=ok, other=ignore_index)
    valid = label != ignore_index
    log_s = tl.log(s)
    lse = m.to(tl.float64) + log_s.to(tl.float64)  # exact: see head.row_outputs
    tl.store(lse_ptr + orow, lse, mask=ok)
    tl.store(logp_ptr + orow, tl.where(valid, (z_y.to(tl.float64) - lse).to(tl.float32), 0.0), mask=ok)
    tl.store(ent_ptr + orow, tl.where(valid, log_s - t / s, 0.0), mask=ok)


@triton.jit
def finalize_tile_stats_kernel(
    tmax_ptr, s_ptr, sx_ptr, acc_y_ptr, labels_ptr, idx_ptr, logp_ptr, ent_ptr, lse_ptr,
    row_offset, n_tiles, inv_t, ignore_index, HAS_IDX: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_ENT: tl.constexpr = True,
):
    """Grid ``(rows of one launch,)``: per-(row, N tile) statistics of a GEMM epilogue -> lse,
    entropy, logp at the row's token.

    Tile ``t`` of a row holds its max accumulator ``a_t``, ``s_t = sum 2^x`` and ``w_t = sum 2^x x``
    with ``x = (acc - a_t) log2(e) / T`` (``logitless.ops._quack_epilogues``); ``acc_y`` is the
    label's accumulator. With ``a`` the row's max and ``d_t = (a_t - a) / T <= 0``:
    ``sum exp(z - a/T) = sum_t e^d_t s_t`` and ``sum exp(z - a/T) (z - a/T) = sum_t e^d_t
    (w_t ln 2 + d_t s_t)``. The LSE ``a/T + log s`` is formed in float64 (see
    ``head.row_outputs``) with the same fp32 ``1/T`` that the backward multiplies the logits by.
    """
    row = tl.program_id(0).to(tl.int64)
    srow = row + row_offset
    if HAS_IDX:
        orow = tl.load(idx_ptr + srow).to(tl.int64)
    else:
        orow = srow
    base = row * n_tiles
    a_max = tl.max(tl.full((BLOCK_T,), float("-inf"), tl.float32), 0)
    for t0 in range(0, n_tiles, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        a = tl.load(tmax_ptr + base + offs, mask=offs < n_tiles, other=float("-inf"))
        a_max = tl.maximum(a_max, tl.max(a, 0))
    s_row = 0.0
    t_row = 0.0
    for t0 in range(0, n_tiles, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        ok = offs < n_tiles
        a = tl.load(tmax_ptr + base + offs, mask=ok, other=0.0)
        s = tl.load(s_ptr + base + offs, mask=ok, other=0.0)
        d = tl.where(ok, (a - a_max) * inv_t, 0.0)
        f = tl.where(ok, tl.exp(d), 0.0)
        s_row += tl.sum(f * s, 0)
        if HAS_ENT:
            w = tl.load(sx_ptr + base + offs, mask=ok, other=0.0)
            t_row += tl.sum(f * (w * 0.6931471805599453 + d * s), 0)
    log_s = tl.log(s_row)
    inv_t64 = tl.full([], inv_t, tl.float32).to(tl.float64)
    lse = a_max.to(tl.float64) * inv_t64 + log_s.to(tl.float64)
    label = tl.load(labels_ptr + orow)
    valid = label != ignore_index
    z_y = tl.load(acc_y_ptr + row).to(tl.float64) * inv_t64
    tl.store(lse_ptr + orow, lse)
    tl.store(logp_ptr + orow, tl.where(valid, (z_y - lse).to(tl.float32), 0.0))
    if HAS_ENT:
        tl.store(ent_ptr + orow, tl.where(valid, log_s - t_row / s_row, 0.0))


@triton.jit
def finalize_kernel(
    logits_ptr, stride_row, part_ptr, labels_ptr, idx_ptr, row_offset,
    logp_ptr, ent_ptr, lse_ptr, V, inv_t, ignore_index,
    NUM_SPLITS: tl.constexpr, HAS_IDX: tl.constexpr,
):
    """Grid ``(rows,)``: merges the splits of a row, writes logp / entropy / lse at its token."""
    row = tl.program_id(0)
    if HAS_IDX:
        orow = tl.load(idx_ptr + row).to(tl.int64)
    else:
        orow = row.to(tl.int64) + row_offset
    m, s, t = _merge_splits(part_ptr + row.to(tl.int64) * NUM_SPLITS * 3, NUM_SPLITS)
    log_s = tl.log(s)
    lse = m.to(tl.float64) + log_s.to(tl.float64)  # exact: see head.row_outputs
    ent = log_s - t / s
    label = tl.load(labels_ptr + orow)
    valid = label != ignore_index
    # Labels are range-checked before any launch; the clamp only keeps the read in bounds.
    safe = tl.where(valid & (label >= 0) & (label < V), label, 0).to(tl.int64)
    z_y = tl.load(logits_ptr + row.to(tl.int64) * stride_row + safe).to(tl.float32) * inv_t
    tl.store(lse_ptr + orow, lse)
    tl.store(logp_ptr + orow, tl.where(valid, (z_y.to(tl.float64) - lse).to(tl.float32), 0.0))
    tl.store(ent_ptr + orow, tl.where(valid, ent, 0.0))


@triton.jit
def _row_coefficients(orow, valid, coef_ptr, glp_ptr, gent_ptr, ent_ptr, inv_t,
                      MODE_CE: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr):
    """Per-row ``(c_lp, c_ent, ent)`` of the dlogits formula, 0 at ignored rows (scalar or vector rows).

    ``c_lp = d obj / d logp / T`` (``-coef / T`` for cross-entropy), ``c_ent = d obj / d ent / T``.
    """
    zero = tl.where(valid, 0.0, 0.0)
    if MODE_CE:
        c_lp = zero - tl.load(coef_ptr).to(tl.float32)
    elif HAS_GLP:
        c_lp = tl.load(glp_ptr + orow, mask=valid, other=0.0).to(tl.float32)
    else:
        c_lp = zero
    c_lp = tl.where(valid, c_lp, 0.0) * inv_t
    c_ent = zero
    ent = zero
    if HAS_GENT:
        c_ent = tl.where(valid, tl.load(gent_ptr + orow, mask=valid, other=0.0).to(tl.float32), 0.0) * inv_t
        ent = tl.load(ent_ptr + orow, mask=valid, other=0.0)
    return c_lp, c_ent, ent


@triton.jit
def _grad_logits(logp, hit, c_lp, c_ent, ent, valid, HAS_GENT: tl.constexpr):
    """``c_lp (onehot - p) - c_ent p (log p + entropy)``, 0 at ignored rows; ``hit`` marks the label."""
    p = tl.exp(logp)
    g = tl.where(hit, c_lp, 0.0) - c_lp * p
    if HAS_GENT:
        g -= c_ent * p * (logp + ent)
    # an ignored row's logits may be NaN (a NaN hidden row): 0 * NaN must not reach dW
    return tl.where(valid, g, 0.0)


@triton.jit
def slab_row_inputs_kernel(
    labels_ptr, idx_ptr, row_offset, lse_ptr, ent_ptr, glp_ptr, gent_ptr, coef_ptr, rows_ptr, rows_stride,
    slab_label_ptr, n_rows, col0, width, inv_t, ignore_index,
    MODE_CE: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, HAS_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(rows, BLOCK),)``: the per-row inputs of a dlogits epilogue over one row block and
    V slab: ``rows_ptr`` ``(5, rows)`` fp32 (row stride ``rows_stride``) = the LSE as two fp32 (``hi + lo``), ``c_lp``, ``c_ent``,
    entropy (see ``_row_coefficients``); ``slab_label_ptr`` the label's column in the slab, -1 where
    it is outside the slab or the row is ignored."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n_rows
    if HAS_IDX:
        orow = tl.load(idx_ptr + row_offset + r, mask=ok, other=0).to(tl.int64)
    else:
        orow = r + row_offset
    label = tl.load(labels_ptr + orow, mask=ok, other=ignore_index)
    valid = ok & (label != ignore_index)
    lse = tl.load(lse_ptr + orow, mask=ok, other=0.0)
    lse_hi = lse.to(tl.float32)
    lse_lo = (lse - lse_hi.to(tl.float64)).to(tl.float32)
    c_lp, c_ent, ent = _row_coefficients(orow, valid, coef_ptr, glp_ptr, gent_ptr, ent_ptr, inv_t,
                                         MODE_CE, HAS_GLP, HAS_GENT)
    tl.store(rows_ptr + r, lse_hi, mask=ok)
    tl.store(rows_ptr + rows_stride + r, lse_lo, mask=ok)
    tl.store(rows_ptr + 2 * rows_stride + r, c_lp, mask=ok)
    tl.store(rows_ptr + 3 * rows_stride + r, c_ent, mask=ok)
    tl.store(rows_ptr + 4 * rows_stride + r, ent, mask=ok)
    rel = label - col0
    tl.store(slab_label_ptr + r, tl.where(valid & (rel >= 0) & (rel < width), rel, -1), mask=ok)


@triton.jit
def label_dlogits_kernel(
    dl_ptr, stride_row, slab_label_ptr, label_acc_ptr, rows_ptr, rows_stride, lse_ptr, idx_ptr, row_offset, n_rows,
    inv_t,
    HAS_GENT: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(cdiv(rows, BLOCK),)``: writes each row's dlogit at its label's column in the slab
    (``slab_row_inputs_kernel``), from the label's logit, in fp32 before the one rounding: a GEMM
    epilogue that leaves out the one-hot term rounded ``-c_lp p`` already, and adding ``c_lp`` to
    that would cancel at ``p`` near 1."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n_rows
    col = tl.load(slab_label_ptr + r, mask=ok, other=-1)
    hit = ok & (col >= 0)
    if HAS_IDX:
        orow = tl.load(idx_ptr + row_offset + r, mask=hit, other=0).to(tl.int64)
    else:
        orow = r + row_offset
    lse = tl.load(lse_ptr + orow, mask=hit, other=0.0)
    x = tl.load(label_acc_ptr + r, mask=hit, other=0.0)
    logp = ((x * inv_t).to(tl.float64) - lse).to(tl.float32)
    c_lp = tl.load(rows_ptr + 2 * rows_stride + r, mask=hit, other=0.0)
    c_ent = tl.load(rows_ptr + 3 * rows_stride + r, mask=hit, other=0.0)
    ent = tl.load(rows_ptr + 4 * rows_stride + r, mask=hit, other=0.0)
    g = _grad_logits(logp, hit, c_lp, c_ent, ent, hit, HAS_GENT)
    tl.store(dl_ptr + r * stride_row + col, g.to(dl_ptr.dtype.element_ty), mask=hit)


@triton.jit
def dlogits_kernel(
    logits_ptr, stride_row, labels_ptr, idx_ptr, row_offset, lse_ptr, ent_ptr,
    glp_ptr, gent_ptr, coef_ptr, V, col0, span, inv_t, ignore_index,
    MODE_CE: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    HAS_IDX: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid ``(rows, splits)``: logits -> d(objective)/d(logits), in place.

    The buffer holds columns ``[col0, col0 + V)`` of the full vocabulary (a V slab, or all of it).

    ``MODE_CE``: objective ``coef * sum(-logp)`` (``coef`` a device scalar: 1/n_valid or 1).
    Otherwise: ``sum(g_logp * logp + g_ent * entropy)`` with per-token upstream gradients.
    """
    row = tl.program_id(0)
    split = tl.program_id(1)
    if HAS_IDX:
        orow = tl.load(idx_ptr + row).to(tl.int64)
    else:
        orow = row.to(tl.int64) + row_offset
    label = tl.load(labels_ptr + orow)
    valid = label != ignore_index
    lse = tl.load(lse_ptr + orow)
    c_lp, c_ent, ent = _row_coefficients(orow, valid, coef_ptr, glp_ptr, gent_ptr, ent_ptr, inv_t,
                                         MODE_CE, HAS_GLP, HAS_GENT)
    base = logits_ptr + row.to(tl.int64) * stride_row
    start = split * span
    offs = tl.arange(0, BLOCK_V)
    for k in range(0, span, BLOCK_V):
        cols = start + k + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0)
        # z - lse in float64 from the exact LSE: one rounding, at the size of log p
        logp = ((x.to(tl.float32) * inv_t).to(tl.float64) - lse).to(tl.float32)
        g = _grad_logits(logp, cols + col0 == label, c_lp, c_ent, ent, valid, HAS_GENT)
        tl.store(base + cols, g.to(x.dtype), mask=mask)


@triton.jit
def col_stats_kernel(
    lt_ptr, part_ptr, S, R, span, inv_t,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid ``(cdiv(R, BLOCK_R), NUM_SPLITS)``: per-column partial statistics of a ``(S, R)`` tile.

    The transposed layout of ``row_stats_kernel``: column ``r`` is a row of logits, its
    vocabulary entries ``[split*span, +span)`` down the tile; ``part[r, split]`` gets (max,
    sum exp(z - max), sum exp(z - max)(z - max)).
    """
    cols = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    split = tl.program_id(1)
    start = split * span
    end = tl.minimum(start + span, S)
    col_ok = cols < R
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    t = tl.zeros([BLOCK_R], tl.float32)
    offs = tl.arange(0, BLOCK_S)
    for k in range(start, end, BLOCK_S):
        rows = k + offs
        mask = (rows < end)[:, None] & col_ok[None, :]
        x = tl.load(lt_ptr + rows.to(tl.int64)[:, None] * R + cols[None, :], mask=mask, other=0.0)
        z = tl.where(mask, x.to(tl.float32) * inv_t, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.exp(z - ref[None, :])
        alpha = tl.exp(m - ref)
        t = alpha * (t + tl.where(s > 0, (m - ref) * s, 0.0)) + tl.sum(tl.where(mask, e * (z - ref[None, :]), 0.0), 0)
        s = alpha * s + tl.sum(e, 0)
        m = m_new
    out = part_ptr + (cols.to(tl.int64) * NUM_SPLITS + split) * 3
    tl.store(out, m, mask=col_ok)
    tl.store(out + 1, s, mask=col_ok)
    tl.store(out + 2, t, mask=col_ok)


@triton.jit
def dlogits_t_kernel(
    lt_ptr, out_ptr, labels_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, coef_ptr, S, R, v0, span,
    inv_t, ignore_index,
    MODE_CE: tl.constexpr, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid ``(cdiv(R, BLOCK_R), cdiv(S, span))``: ``dlogits_kernel`` on a transposed ``(S, R)`` tile.

    Reads the logits of vocabulary entries ``[v0, v0 + S)`` (rows) for ``R`` token rows (columns)
    and writes their gradient into ``out`` (same layout), so the tile can be overwritten later.
    Per-column vectors (labels, LSE, entropy, upstreams) are indexed by column.
    """
    cols = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < R
    label = tl.load(labels_ptr + cols, mask=col_ok, other=ignore_index)
    valid = (label != ignore_index) & col_ok
    lse = tl.load(lse_ptr + cols, mask=col_ok, other=0.0)
    c_lp, c_ent, ent = _row_coefficients(cols, valid, coef_ptr, glp_ptr, gent_ptr, ent_ptr, inv_t,
                                         MODE_CE, HAS_GLP, HAS_GENT)
    start = tl.program_id(1) * span
    end = tl.minimum(start + span, S)
    offs = tl.arange(0, BLOCK_S)
    for k in range(start, end, BLOCK_S):
        rows = k + offs
        mask = (rows < end)[:, None] & col_ok[None, :]
        addr = rows.to(tl.int64)[:, None] * R + cols[None, :]
        x = tl.load(lt_ptr + addr, mask=mask, other=0.0)
        logp = ((x.to(tl.float32) * inv_t).to(tl.float64) - lse[None, :]).to(tl.float32)
        hit = (rows[:, None] + v0) == label[None, :]
        g = _grad_logits(logp, hit, c_lp[None, :], c_ent[None, :], ent[None, :], valid[None, :], HAS_GENT)
        tl.store(out_ptr + addr, g.to(x.dtype), mask=mask)


@triton.jit
def scale_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """``x *= g`` in place, ``g`` a device scalar; a no-op (no memory traffic) when ``g == 1``."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(x_ptr + offs, (x.to(tl.float32) * g).to(x.dtype), mask=mask)


@triton.jit
def take_columns_kernel(
    dl_ptr, stride_row, cols_ptr, out_ptr, stride_out, K, bins_ptr, slot_ptr, diag_ptr, row0,
    BLOCK: tl.constexpr,
):
    """Grid ``(rows, cdiv(K, BLOCK))``: moves a chunk's dlogits at the pinned columns out, zeroed.

    ``out[row, j] = dl[row, cols[j]]`` (``out`` is ``(rows, K)`` with row stride ``stride_out``),
    then ``dl[row, cols[j]] = 0``. The programs of the first column block also move the row's
    own label entry ``dl[row, label]`` into ``diag[row0 + row]`` (fp32) when its label is not
    pinned (``slot[label] < 0``; ``bins`` holds the labels, V where ignored, whose slot is not
    negative). The bf16 dW GEMM then adds exact zeros at all of them.
    """
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < K
    cols = tl.load(cols_ptr + j, mask=mask, other=0)
    src = dl_ptr + row * stride_row + cols
    x = tl.load(src, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + j, x, mask=mask)
    tl.store(src, tl.zeros_like(x), mask=mask)
    if tl.program_id(1) == 0:
        label = tl.load(bins_ptr + row0 + row).to(tl.int64)
        free = tl.load(slot_ptr + label) < 0
        own = dl_ptr + row * stride_row + label
        d = tl.load(own, mask=free, other=0.0)
        tl.store(diag_ptr + row0 + row, d.to(tl.float32), mask=free)
        tl.store(own, tl.zeros_like(d), mask=free)


@triton.jit
def add_label_rows_kernel(
    keys_ptr, perm_ptr, diag_ptr, h_ptr, idx_ptr, dw_ptr, rows, H, sentinel,
    HAS_IDX: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Grid ``(rows, cdiv(H, BLOCK_H))``: ``dw[t] += sum diag[r] h[r]`` over the rows labelled ``t``.

    ``keys`` are the rows' labels sorted (``perm`` the sort order; ``sentinel`` marks rows without
    a moved label entry, sorted last). The program at the first row of a run of equal keys sums the
    run in fp32, adds ``dw[t]`` and rounds once, in a fixed order: deterministic. ``h`` is the
    hidden state, its valid rows at ``idx`` when ``HAS_IDX``.
    """
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    t = tl.load(keys_ptr + i)
    prev = tl.load(keys_ptr + tl.maximum(i - 1, 0))
    if (t != sentinel) & ((i == 0) | (prev != t)):
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        j = i
        more = True
        while more:
            r = tl.load(perm_ptr + j)
            if HAS_IDX:
                hr = tl.load(idx_ptr + r)
            else:
                hr = r
            hv = tl.load(h_ptr + hr * H + cols, mask=cmask, other=0.0).to(tl.float32)
            acc += tl.load(diag_ptr + r) * hv
            j += 1
            more = (j < rows) & (tl.load(keys_ptr + tl.minimum(j, rows - 1)) == t)
        out = dw_ptr + t.to(tl.int64) * H + cols
        w = tl.load(out, mask=cmask, other=0.0)
        tl.store(out, (w.to(tl.float32) + acc).to(w.dtype), mask=cmask)
