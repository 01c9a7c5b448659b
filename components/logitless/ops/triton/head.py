"""Host side of the fused head: cuBLAS GEMMs over bounded tiles, Triton epilogues in between.

Ignored rows are dropped first (``valid_rows``; their count comes from the caller's one host sync
in validation, else from a sync here). Three
paths, all with fp32 softmax statistics and fp32 accumulation inside every GEMM:

* forward only (``head_forward``, the no-grad pass and the forward of ``linear_log_probs``;
  ``F`` bytes of tiles without gradients, ``B`` when a backward follows):
  (row block x V slab) tiles of logits, ``row_stats_kernel`` per tile and ``merge_slab_kernel``
  folding it into a running per-row (max, sum, entropy) state; at one split per row (the tiles
  of thousands of rows) ``merge_slab_kernel`` takes the statistics itself, one launch per tile.
  One GEMM in total.
* recompute backward (``head_backward``, any per-token upstream): for each row block, V slabs of
  recomputed logits -> ``dlogits_kernel`` in place -> ``dh_block += dl @ W[slab]`` (fp32
  accumulator) and ``dW[slab] (+)= dl.T @ h_block`` (one rounding per row block). Three GEMMs.
* cross-entropy with a scalar upstream (``ce_fused``): gradients computed in the forward. When the
  valid rows fit in at most ``FUSED_MAX_CHUNKS`` chunks of full-V rows, or when no dW is wanted (a
  frozen head, as in LoRA: nothing is rounded across chunks then), one pass per chunk:
  logits -> statistics -> dlogits -> dh chunk, ``dW += dl.T @ h_c`` (3 GEMMs, dW rounded once per
  chunk). When the dlogits of every row at the pinned label columns would fit ``PINNED_BYTES``,
  the one pass also runs past that (up to ``PINNED_MAX_CHUNKS`` chunks) with the labels pinned
  (``PinnedColumns``): each chunk moves its dlogits at the most frequent labels' columns and at
  every other row's own label out (``take_columns_kernel``) and adds the pinned columns' dW rows
  to fp32 sums (one fp32-output GEMM per chunk); after the last chunk those rows are rounded into
  dW once and fp32 sums add the label entries to theirs (``add_label_rows_kernel``). Those rows
  carry most of dW's norm and are rounded once, as plain PyTorch's; the rest of dW once per chunk.
  Opt-in (``LOGITLESS_TRITON_CACHE_FIRST_BLOCK=1``): the first block of up to H rows keeps its
  logits, transposed, in dW's still-unwritten buffer (``cached_block_rows``, ``_cached_block``):
  it needs no workspace for them and is rounded into dW once, so fewer chunks follow (7B head,
  8192 rows: 1 + 6 instead of 11). Otherwise the two passes above (4 GEMMs, dW rounded once per
  row block): more rounding steps of dW cost more accuracy than plain PyTorch's at 152k
  vocabularies (measured, docs/history.md).

On QuACK (``LOGITLESS_HEAD_GEMM=quack|auto``, :func:`chunks_on_quack`) the one pass's chunks are
whole pairs of 128-row tiles (:func:`~logitless.ops.quack_head.chunk_rows_on_quack`); each chunk's
logits GEMM stores the bf16 logits with per-tile sums (``quack_head.ChunkStats``, no statistics
pass over the logits) and its dW GEMM adds into dW through the GEMM's store
(``quack_head.dw_accumulate``); dh stays cuBLAS.

With ``LOGITLESS_HEAD_GEMM=triton`` (:mod:`~logitless.ops.triton.gemm_epilogues`, opt-in until
measured; per call, where the inputs' rows are 16-byte aligned) the same paths run Triton GEMMs
with the epilogues inside: the forward's statistics come from ``logits_stats`` (no logits buffer:
fp32 partials per 128-column tile and the gathered rows, at most 16 MiB per launch), the recompute
backward's slabs from ``logits_dlogits`` (logits -> dlogits in registers, written once), and every
``dW[slab] (+)= dl.T @ h`` from ``dw_accumulate``. Forward and backward must run under the same
setting: the Triton forward's LSE is taken from fp32 logits, the cuBLAS backward's probabilities
from logits rounded to the input dtype, which then do not sum to 1.

Workspace beyond the inputs and the returned gradients (``B`` = ``WORKSPACE_BYTES``, 224 MiB;
``F`` = ``FORWARD_WORKSPACE_BYTES``, 88 MiB)::

    forward only:   rows_f * cols_f * itemsize (+ rows_f * H * itemsize gathered rows when some
                    are ignored) <= F   (+ N * 28 bytes of per-row fp32 state/outputs)
    recompute bwd:  rows_b * cols_b * itemsize + rows_b * H * 4 <= B   (+ rows_b * H * itemsize for
                    the gathered rows when some are ignored)
    fused CE:       n_c * V * itemsize <= B   (+ 2 * n_c * H * itemsize gathered rows / dh chunk;
                    on QuACK + 8 * n_c * V / tile_n per-tile sums, 12 with the entropy);
                    its cached first block: logits in dW's buffer, slabs + fp32 dh block <= B;
                    pinned labels (when rows * k * itemsize <= P, ``PINNED_BYTES``): k * H * 4
                    (their dW rows' fp32 sums) + n_c * k * itemsize (a chunk's pinned dlogits)
                    + rows * 4 (label entries, fp32)

At the Qwen2.5-7B head (V=152064, H=3584, bf16): forward 4224 x 10880 tiles (88 MiB; 4096 x 7680
and 28 MiB of gathered rows when some rows are ignored: slabs of even width), backward
8192 x 7168 tiles + an 8192 x 3584 fp32 block (224 MiB), fused CE 768-row chunks (223 MiB).
"""

import itertools
import os
from typing import Optional, Tuple

import torch

from logitless.ops import quack_head
from logitless.ops._rows import zero_ignored_rows
from logitless.ops.triton import gemm_epilogues, kernels
from logitless.settings import settings

# Sizes and tile widths are read once, here (they size buffers); see logitless.settings for each
# knob's environment variable and what it trades.
#: Bytes of the reused logits buffer when gradients are computed (training).
WORKSPACE_BYTES = settings.triton_workspace_mb << 20
#: Bytes of the reused logits buffer for forward-only calls (no gradient).
FORWARD_WORKSPACE_BYTES = settings.triton_forward_workspace_mb << 20
#: Cross-entropy with a scalar upstream uses the one-pass, 3-GEMM path when the valid rows fit in
#: at most this many row chunks (dW is rounded once per chunk), else the 2-pass, 4-GEMM path.
FUSED_MAX_CHUNKS = settings.triton_fused_max_chunks
#: Label columns are pinned (``PinnedColumns``) when the ``(valid rows, k)`` dlogits would fit
#: these bytes (the cap under which pinning was measured; the pass holds only one chunk's of them
#: and the pinned dW rows' fp32 sums); 0: never pinned.
PINNED_BYTES = settings.triton_pinned_mb << 20
#: With pinned label columns, the one pass runs up to this many row chunks.
PINNED_MAX_CHUNKS = settings.triton_pinned_max_chunks
#: At most this many label columns (the most frequent labels) are pinned whole.
PINNED_COLUMNS = settings.triton_pinned_columns
#: Pinned columns per program of ``take_columns_kernel``.
TAKE_BLOCK = 256
#: One-pass CE: keep the first block's logits in dW's still-unwritten buffer (``cached_block_rows``).
#: Opt-in: tested against float64 in the CPU interpreter; the default stays off until it is
#: measured faster on a GPU.
CACHE_FIRST_BLOCK = settings.triton_cache_first_block
#: Forward-only tiles: at most this many rows per block, V slabs at least this wide.
MAX_BLOCK_ROWS = 4096
MIN_SLAB = 2048
#: Columns per program iteration in the epilogue kernels (the CPU interpreter uses a small one).
BLOCK_V = 64 if os.environ.get("TRITON_INTERPRET", "0") == "1" else settings.triton_block_v
#: Load the next column block before reducing the current one in the row-statistics kernel.
PREFETCH = settings.triton_prefetch
#: Programs per SM targeted by the epilogue grids (rows x column splits).
PROGRAMS_PER_SM = settings.triton_programs_per_sm
_NUM_WARPS = settings.triton_num_warps


def chunk_rows(n_rows: int, vocab: int, itemsize: int, budget: int) -> int:
    """Rows per chunk so that a ``(rows, vocab)`` logits buffer fits ``budget`` bytes.

    Rounded down to a multiple of 64 (whole GEMM tiles) once above 128 rows; at least 1.

    Args:
        n_rows (int): rows to process.
        vocab (int): V.
        itemsize (int): bytes per logit.
        budget (int): bytes allowed for the buffer.

    Returns:
        int: rows per chunk, in ``[1, max(n_rows, 1)]``.

    Example:
        >>> chunk_rows(8192, 152064, 2, 224 << 20)
        768
    """
    rows = max(1, budget // (vocab * itemsize))
    if rows > 128:
        rows -= rows % 64
    return max(1, min(rows, n_rows))


def _num_splits(rows: int, vocab: int, device: torch.device, block: int = 0) -> Tuple[int, int]:
    # Enough programs to keep every SM streaming even for small chunks: split rows over V, in
    # whole blocks of `block` (BLOCK_V by default) columns. Returns (splits, span).
    block = block or BLOCK_V
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    blocks = -(-vocab // block)
    splits = max(1, min(blocks, -(-PROGRAMS_PER_SM * sms // max(rows, 1)), 32))
    span = -(-blocks // splits) * block
    return -(-vocab // span), span


def rows_for_gradients(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                       idx: Optional[torch.Tensor], n_valid: int = -1) -> torch.Tensor:
    """``hidden`` as the gradient GEMMs may read it: ignored rows never enter them.

    Compacted (``idx`` given) they are skipped; with every row valid there is nothing to do. Only
    without compaction (CUDA-graph capture, ``LOGITLESS_TRITON_COMPACT=0``) and with some (or an
    unknown number of) ignored rows is the hidden copied with those rows zeroed: their dlogits are 0,
    but ``0 * NaN = NaN`` inside ``dW = dl.T @ h`` would spread a NaN row over all of dW.

    Args:
        hidden (torch.Tensor): ``(N, H)``. labels (torch.Tensor): ``(N,)``. ignore_index (int).
        idx (Optional[torch.Tensor]): from :func:`valid_rows`.
        n_valid (int): the caller's count of non-ignored labels (-1: unknown).

    Returns:
        torch.Tensor: ``hidden`` itself or a copy with the ignored rows zeroed.
    """
    if idx is not None or n_valid == labels.numel():
        return hidden
    return zero_ignored_rows(hidden, labels != ignore_index)


def valid_rows(labels: torch.Tensor, ignore_index: int, n_valid: int = -1) -> Optional[torch.Tensor]:
    """Indices of non-ignored rows, or ``None`` to process every row in place.

    Compaction makes ignored rows free but needs their count on the host. Given ``n_valid`` (the
    public ops read it in validation's one host sync), it costs no sync: nothing at all when no
    row is ignored, else one ``nonzero_static``. Without it, ``nonzero`` syncs once. Compaction is
    skipped (ignored rows then cost as much as valid ones, with zero results) while a CUDA graph
    is being captured or with ``LOGITLESS_TRITON_COMPACT=0``.

    Args:
        labels (torch.Tensor): ``(N,)`` int64.
        ignore_index (int): the ignored label.
        n_valid (int): the number of non-ignored labels, or -1 when the caller has not counted.

    Returns:
        Optional[torch.Tensor]: int64 indices, or ``None`` when no compaction is done.
    """
    if not settings.triton_compact:
        return None
    if labels.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if n_valid == labels.numel():
        return None
    if n_valid >= 0:
        return torch.nonzero_static(labels != ignore_index, size=n_valid).squeeze(1)
    idx = torch.nonzero(labels != ignore_index).squeeze(1)
    return None if idx.numel() == labels.numel() else idx


def chunks_on_quack(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the one pass's chunks run their logits GEMM (with the statistics) and their dW GEMMs
    on QuACK (:class:`~logitless.ops.quack_head.ChunkStats`): ``LOGITLESS_HEAD_GEMM`` is not
    ``triton`` and :func:`~logitless.ops.quack_head.outputs_apply` holds."""
    return not gemm_epilogues.use(hidden, weight) and quack_head.outputs_apply(hidden, weight, settings.head_gemm)


def one_pass_rows(n_rows: int, hidden: torch.Tensor, weight: torch.Tensor, budget: int) -> int:
    """Rows per chunk of the one pass: :func:`chunk_rows`, or
    :func:`~logitless.ops.quack_head.chunk_rows_on_quack` where :func:`chunks_on_quack` holds."""
    vocab, itemsize = weight.shape[0], hidden.element_size()
    if chunks_on_quack(hidden, weight):
        return quack_head.chunk_rows_on_quack(n_rows, vocab, itemsize, budget)
    return chunk_rows(n_rows, vocab, itemsize, budget)


class _Chunks:
    """Iterates row chunks: yields ``(h_c, idx_c, start, logits_view)`` over a reused buffer.

    On QuACK (:func:`chunks_on_quack`) the chunk's logits GEMM also fills their statistics
    (``self.quack``), which :func:`_stats` then folds; it needs the labels and ``1 / T`` for that,
    and ``entropy=False`` when no entropy is read (then left unwritten).
    """

    def __init__(self, hidden, weight, idx, budget, first=0, labels=None, inv_t=1.0, entropy=True):
        self.hidden, self.weight, self.idx, self.first = hidden, weight, idx, first
        self.labels, self.inv_t = labels, inv_t
        self.rows = hidden.shape[0] if idx is None else idx.numel()
        vocab = weight.shape[0]
        self.n_c = one_pass_rows(self.rows - first, hidden, weight, budget)
        on_quack = labels is not None and self.rows > first and chunks_on_quack(hidden, weight)
        self.quack = quack_head.ChunkStats(self.n_c, vocab, hidden.device, entropy) if on_quack else None
        # Rows 16-byte aligned where the Triton dW GEMM reads the buffer through a tensor descriptor.
        ld = gemm_epilogues.aligned_cols(vocab, hidden.element_size()) if gemm_epilogues.use(hidden, weight) else vocab
        self.buf = hidden.new_empty((self.n_c, ld))[:, :vocab] if self.rows > first else None
        # One buffer for the gathered rows: a chunk's rows replace the previous chunk's in stream
        # order, instead of two chunks' copies being alive while the next is gathered.
        self.gathered = hidden.new_empty((self.n_c, hidden.shape[1])) if idx is not None and self.rows > first \
            else None
        self.splits, self.span = _num_splits(self.n_c, vocab, hidden.device)
        self.part = None if self.quack is not None else \
            hidden.new_empty((self.n_c, self.splits, 3), dtype=torch.float32)

    def __iter__(self):
        for start in range(self.first, self.rows, self.n_c):
            end = min(start + self.n_c, self.rows)
            if self.idx is None:
                h_c, idx_c = self.hidden[start:end], None
            else:
                idx_c = self.idx[start:end]
                h_c = torch.index_select(self.hidden, 0, idx_c, out=self.gathered[: end - start])
            logits = self.buf[: end - start]
            if self.quack is not None:
                # a copy either way: QuACK refuses a label slice not 16-byte aligned (an odd start)
                y_c = self.labels[start:end].clone() if idx_c is None else self.labels.index_select(0, idx_c)
                self.quack.logits(h_c, self.weight, y_c, logits, self.inv_t)
            else:
                torch.matmul(h_c, self.weight.t(), out=logits)
            yield h_c, idx_c, start, logits


def queued_chunks(hidden, weight, idx, labels, inv_t, entropy, first=0):
    """:class:`_Chunks` of the one pass with its first chunk's logits GEMM queued at once.

    The one pass's setup (row outputs, gradient buffers, pinned columns) is a few small kernels;
    after validation's host sync the GPU would otherwise idle while the host issues each of them.
    ``first``: rows already done by the cached first block (:func:`_cached_block`).

    Returns:
        Tuple[_Chunks, Iterator]: the chunks, and an iterator over all of them (the first included).
    """
    ch = _Chunks(hidden, weight, idx, WORKSPACE_BYTES, first=first, labels=labels, inv_t=inv_t, entropy=entropy)
    chunks = iter(ch)
    first = next(chunks, None)
    return ch, itertools.chain([first] if first is not None else [], chunks)


def _row_stats(ch, logits, inv_t):
    rows, vocab = logits.shape
    kernels.row_stats_kernel[(rows, ch.splits)](
        logits, logits.stride(0), ch.part, vocab, ch.span, inv_t,
        NUM_SPLITS=ch.splits, BLOCK_V=BLOCK_V, PREFETCH=PREFETCH, num_warps=_NUM_WARPS,
    )


def _stats(ch, logits, idx_c, start, labels, logp, ent, lse, inv_t, ignore_index):
    if ch.quack is not None:  # the chunk's GEMM left per-tile statistics: fold them
        ch.quack.finalize(labels, ch.idx, start, logits.shape[0], logp, ent, lse, inv_t, ignore_index)
        return
    rows = logits.shape[0]
    _row_stats(ch, logits, inv_t)
    kernels.finalize_kernel[(rows,)](
        logits, logits.stride(0), ch.part, labels, idx_c if idx_c is not None else labels, start,
        logp, ent, lse, logits.shape[1], inv_t, ignore_index,
        NUM_SPLITS=ch.splits, HAS_IDX=idx_c is not None, num_warps=1,
    )


def _dlogits(ch, logits, idx_c, start, labels, lse, ent, glp, gent, coef, inv_t, ignore_index, col0=0):
    rows, vocab = logits.shape
    dummy = lse
    kernels.dlogits_kernel[(rows, ch.splits)](
        logits, logits.stride(0), labels, idx_c if idx_c is not None else labels, start, lse,
        ent if ent is not None else dummy, glp if glp is not None else dummy,
        gent if gent is not None else dummy, coef if coef is not None else dummy,
        vocab, col0, ch.span, inv_t, ignore_index,
        MODE_CE=coef is not None, HAS_GLP=glp is not None, HAS_GENT=gent is not None,
        HAS_IDX=idx_c is not None, BLOCK_V=BLOCK_V, num_warps=_NUM_WARPS,
    )


def _grads(ch, logits, h_c, idx_c, start, dh, dw, first, pin=None):
    # dlogits is now in `logits`: the two gradient GEMMs, fp32 accumulation inside cuBLAS; dh
    # reads every column, dW's pinned columns are moved out first (PinnedColumns).
    if dh is not None:
        if idx_c is None:
            torch.matmul(logits, ch.weight, out=dh[start : start + logits.shape[0]])
        else:
            dh.index_copy_(0, idx_c, torch.matmul(logits, ch.weight))
    if dw is not None:
        if pin is not None:
            pin.take(logits, start, h_c)
        if ch.quack is not None:  # QuACK's GEMM adding into dW through its store
            quack_head.dw_accumulate(dw, logits, h_c, first)
        else:
            _dw_update(dw, logits, h_c, ch.weight, first)


def _dw_update(dw_slab, dl, h_b, weight, first):
    # dW[slab] = dl.T @ h_b (first) or += it, one rounding to dW's dtype either way: the Triton dW
    # GEMM (its accumulator starts from the dW tile) where enabled and dl's rows are aligned, else cuBLAS.
    if gemm_epilogues.use(h_b, weight) and gemm_epilogues.supported(dl, dl):
        gemm_epilogues.dw_accumulate(dw_slab, dl, h_b, accumulate=not first)
    elif first:
        torch.matmul(dl.t(), h_b, out=dw_slab)
    else:
        dw_slab.addmm_(dl.t(), h_b)


def pinned_columns(rows: int, vocab: int, chunks: int, itemsize: int) -> int:
    """How many label columns a one-pass call pins (0: none), from host-known sizes only.

    The ``min(rows, vocab, PINNED_COLUMNS)`` most frequent labels are pinned whole; every other
    row's own label entry is moved out on its own (:class:`PinnedColumns`). Done when their
    ``(rows, k)`` dlogits fit ``PINNED_BYTES`` and dW is rounded more than once (two or more
    chunks), whatever H: moving ``k`` of V columns costs about ``16 k / V`` of a pass over a
    chunk's dlogits, the second pass it saves a GEMM (H200, 10% ignored labels,
    docs/history.md: 3.37 against 4.24 GEMMs at the 7B head, 4.12 against 4.87 at 0.5B).

    Args:
        rows (int): valid rows. vocab (int): V. chunks (int): row chunks of the pass.
        itemsize (int): bytes per element of the inputs.

    Returns:
        int: label columns to pin.

    Example:
        >>> pinned_columns(7373, 152064, 10, 2)  # 15 MB of bf16 dlogits
        1024
    """
    k = min(rows, vocab, PINNED_COLUMNS)
    if chunks < 2 or k == 0 or rows * k * itemsize > PINNED_BYTES:
        return 0
    return k


class PinnedColumns:
    """The one pass's dlogits at its labels, kept out of the per-chunk bf16 dW accumulation.

    A chunk's gradient ``p - onehot`` is largest at its labels' columns, so their dW rows carry
    most of dW's norm (all but ~0.3% of it for Gaussian logits; ~60% for peaked ones). Rounding
    those rows to bf16 after every chunk is what made the one pass less accurate than plain
    PyTorch. Two parts are moved out of each chunk's buffer, after its dh GEMM and before its
    ``dW += dl.T @ h`` (which then adds exact zeros there):

    * the ``k`` most frequent labels' whole columns, into a ``(chunk rows, k)`` buffer: a frequent
      token also collects large probabilities from rows labelled otherwise; their dW rows are
      summed over the chunks in fp32 (``acc += dl_pinned.T @ h_c``, a ``(k, H)`` fp32 buffer) and
      :meth:`finish` rounds them once: plain PyTorch's rounding, without holding every row's
      pinned dlogits until the end (``(valid rows, k)``: 57 MiB at 32768 rows);
    * every other row's entry at its own label (``p - 1``, the largest), into an fp32 vector;
      :meth:`finish` sums them per label in fp32 into dW's row and rounds once
      (``add_label_rows_kernel``).

    Moving ``k`` columns touches about ``16 k / V`` of a row's 32-byte sectors; pinning every label
    (``k`` = valid rows) made the move cost a pass over the chunk (0.09 GEMMs at the 7B head).

    Args:
        labels (torch.Tensor): ``(N,)`` int64. idx (Optional[torch.Tensor]): the valid rows (or None).
        ignore_index (int). k (int): columns to pin (:func:`pinned_columns`).
        rows (int): valid rows. vocab (int): V. like (torch.Tensor): the hidden states ``(N, H)``
            (dtype, device, H). chunk (int): rows per chunk of the pass.

    Example:
        >>> pin = PinnedColumns(labels, idx, -100, k, rows, vocab, hidden, chunk=ch.n_c)
        >>> pin.take(dl, start, h_c)   # each chunk, after the dh GEMM, before the dW GEMM
        >>> pin.finish(dw, hidden, idx)
    """

    def __init__(self, labels, idx, ignore_index, k, rows, vocab, like, chunk):
        y = labels if idx is None else labels.index_select(0, idx)
        dev = labels.device
        # Counts over V + 1 bins, ignored labels in the last: no host sync, no index out of range.
        self.bins = torch.where(y == ignore_index, vocab, y)
        counts = torch.zeros(vocab + 1, dtype=torch.int32, device=dev)
        counts.scatter_add_(0, self.bins, torch.ones_like(y, dtype=torch.int32))
        self.cols = torch.topk(counts[:vocab], k, sorted=False).indices.sort().values
        # slot[v] >= 0: column v is pinned (the last bin: ignored rows, whose entries never move)
        self.slot = torch.full((vocab + 1,), -1, dtype=torch.int32, device=dev)
        self.slot[self.cols] = torch.arange(k, dtype=torch.int32, device=dev)
        self.slot[vocab] = 0
        self.vocab = vocab
        self.diag = torch.zeros(rows, dtype=torch.float32, device=dev)
        # Rows 16-byte aligned: cuBLAS reads an unaligned operand with a far slower kernel.
        self.dl = like.new_empty((min(chunk, rows), -(-k // 8) * 8))[:, :k]
        self.acc = torch.zeros((k, like.shape[1]), dtype=torch.float32, device=dev)

    def take(self, dl: torch.Tensor, start: int, h_c: torch.Tensor) -> None:
        """Moves ``dl``'s pinned columns and label entries (the valid rows from ``start``) out and
        adds the pinned columns' products with the chunk's rows ``h_c`` to the fp32 sums."""
        rows, k = dl.shape[0], self.cols.numel()
        kernels.take_columns_kernel[(rows, triton_cdiv(k, TAKE_BLOCK))](
            dl, dl.stride(0), self.cols, self.dl, self.dl.stride(0), k,
            self.bins, self.slot, self.diag, start, BLOCK=TAKE_BLOCK, num_warps=4)
        _acc32(self.acc, self.dl[:rows].t(), h_c, first=False)

    def finish(self, dw: torch.Tensor, hidden: torch.Tensor, idx: Optional[torch.Tensor]) -> None:
        """Writes the pinned columns' dW rows and adds the label entries' to theirs."""
        dw.index_copy_(0, self.cols, self.acc.to(dw.dtype))
        self.acc = self.dl = None
        # Rows whose label entry was moved, sorted by label (the rest sort last): one program per
        # run of equal labels sums it in a fixed order.
        keys = torch.where(self.slot[self.bins] < 0, self.bins, self.vocab)
        keys, perm = torch.sort(keys, stable=True)
        rows, hid = keys.numel(), dw.shape[1]
        block = min(1024, 1 << (hid - 1).bit_length())
        kernels.add_label_rows_kernel[(rows, triton_cdiv(hid, block))](
            keys, perm, self.diag, hidden, idx if idx is not None else perm, dw, rows, hid, self.vocab,
            HAS_IDX=idx is not None, BLOCK_H=block, num_warps=4)


def row_outputs(hidden: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed per-row ``(logp, ent, lse)``: fp32, fp32 and float64.

    The LSE is ``m + log s`` held exactly in float64 (two fp32 numbers), so ``z - lse`` rounds
    once, at the size of ``log p``, as ``torch.log_softmax``'s ``(z - m) - log s`` does; an fp32
    LSE rounds at the size of the logits (``offset / T``), an error that the gradient's row sum
    ``1 - sum p`` carries into dh along any direction the logits share (a bias-like feature).
    """
    return (hidden.new_zeros((n,), dtype=torch.float32), hidden.new_zeros((n,), dtype=torch.float32),
            hidden.new_zeros((n,), dtype=torch.float64))


def forward_tiles(rows: int, vocab: int, itemsize: int, budget: int, row_bytes: int = 0) -> Tuple[int, int]:
    """``(block_rows, slab_cols)`` of the forward-only tiles:
    ``rows * (cols * itemsize + row_bytes) <= budget``.

    Forward-only passes need no full row at once, so they walk (row block x V slab) tiles with a
    running softmax state per row: every GEMM stays large (4096 x 10240 at the 7B head) and the
    weight is streamed once per row block instead of once per small row chunk.

    Args:
        rows (int): rows to process. vocab (int): V. itemsize (int): bytes per logit.
        budget (int): bytes of the logits buffer and the per-row buffers together.
        row_bytes (int): bytes held per row of a block besides its logits (the gathered hidden row
            when ignored rows are compacted away).

    Returns:
        Tuple[int, int]: rows per block and columns per slab.

    Example:
        >>> forward_tiles(8192, 152064, 2, 80 << 20)
        (4096, 10240)
        >>> forward_tiles(8192, 152064, 2, 80 << 20, row_bytes=3584 * 2)  # gathered bf16 rows of H = 3584
        (4096, 6656)
    """
    block_rows = max(1, min(rows, MAX_BLOCK_ROWS))
    cols = (budget - block_rows * row_bytes) // (block_rows * itemsize)
    cols = vocab if cols >= vocab else max(min(MIN_SLAB, vocab), cols - cols % 256 if cols > 256 else cols)
    if 256 < cols < vocab:
        # slabs of even width: a last slab of a few columns costs a GEMM launch for little work
        even = -(-vocab // -(-vocab // cols))
        cols = min(cols, -(-even // 128) * 128)
    block_rows = max(1, min(rows, budget // (cols * itemsize + row_bytes)))
    if block_rows > 128:
        block_rows -= block_rows % 64
    return block_rows, cols


def head_forward(hidden, weight, labels, ignore_index: int, temperature: float,
                 for_backward: bool = False, n_valid: int = -1):
    """Per-token log-prob, entropy and LSE (fp32 ``(N,)`` each, 0 at ignored rows but ``lse``).

    Walks (row block x V slab) tiles of logits: at most ``FORWARD_WORKSPACE_BYTES`` of them for a
    forward-only call, ``WORKSPACE_BYTES`` when a backward will follow (whose own buffers are that
    large anyway, so the peak does not move; larger GEMM tiles are faster: 1.13 vs 1.16 GEMMs at
    the 7B head, 1.41 vs 1.50 at the 0.5B head, H200, ``experiments/sweep_forward_workspace.py``).
    Where :func:`logitless.ops.quack_head.outputs_apply` holds, QuACK's GEMM computes the same
    outputs with the statistics in its epilogue instead (no logits tiles).

    Args:
        hidden (torch.Tensor): ``(N, H)`` contiguous.
        weight (torch.Tensor): ``(V, H)`` contiguous.
        labels (torch.Tensor): ``(N,)`` int64.
        ignore_index (int): ignored label.
        temperature (float): logits are divided by it.
        for_backward (bool): a backward will follow (the training workspace may be used).
        n_valid (int): non-ignored labels as counted by the caller (-1: count here, a sync).

    Returns:
        Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ``logp, ent, lse``.
    """
    return _forward(hidden, weight, labels, valid_rows(labels, ignore_index, n_valid), ignore_index,
                    1.0 / temperature, for_backward)


def _forward(hidden, weight, labels, idx, ignore_index, inv_t, for_backward):
    budget = WORKSPACE_BYTES if for_backward else FORWARD_WORKSPACE_BYTES
    n, vocab = hidden.shape[0], weight.shape[0]
    logp, ent, lse = row_outputs(hidden, n)
    rows = n if idx is None else idx.numel()
    if rows == 0:
        return logp, ent, lse
    if quack_head.outputs_apply(hidden, weight, settings.head_gemm):
        quack_head.forward_outputs(hidden, weight, labels, idx, inv_t, ignore_index, for_backward, logp, ent, lse,
                                   budget)
        return logp, ent, lse
    state = hidden.new_empty((rows, 3), dtype=torch.float32)
    z_y = hidden.new_zeros((rows,), dtype=torch.float32)
    if gemm_epilogues.use(hidden, weight):
        step = gemm_epilogues.stats_rows(vocab, hidden.shape[1], hidden.dtype, idx is not None,
                                         min(budget, gemm_epilogues.STATS_WORKSPACE_BYTES))
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            h_b = hidden[r0:r1] if idx is None else hidden.index_select(0, idx[r0:r1])
            gemm_epilogues.logits_stats(h_b, weight, labels, idx, r0, state, z_y, inv_t, ignore_index)
    else:
        _stats_over_tiles(hidden, weight, labels, idx, rows, state, z_y, inv_t, ignore_index, budget)
    block = 1024
    kernels.finalize_state_kernel[(-(-rows // block),)](
        state, z_y, labels, idx if idx is not None else labels, logp, ent, lse, rows, ignore_index,
        HAS_IDX=idx is not None, BLOCK=block, num_warps=4,
    )
    return logp, ent, lse


def _stats_over_tiles(hidden, weight, labels, idx, rows, state, z_y, inv_t, ignore_index, budget):
    # cuBLAS logits tiles in a reused buffer, row_stats + merge_slab folding each into `state`;
    # compacted rows are gathered into one reused buffer that the budget counts.
    vocab, hid = weight.shape
    row_bytes = 0 if idx is None else hid * hidden.element_size()
    block_rows, cols = forward_tiles(rows, vocab, hidden.element_size(), budget, row_bytes)
    buf = hidden.new_empty((block_rows * cols,))
    gathered = None if idx is None else hidden.new_empty((block_rows, hid))
    splits, span = _num_splits(block_rows, cols, hidden.device)
    part = hidden.new_empty((block_rows, splits, 3), dtype=torch.float32)
    ch = _Tile(splits, span, part)
    for r0 in range(0, rows, block_rows):
        r1 = min(r0 + block_rows, rows)
        h_b = hidden[r0:r1] if idx is None else torch.index_select(hidden, 0, idx[r0:r1], out=gathered[: r1 - r0])
        for v0 in range(0, vocab, cols):
            v1 = min(v0 + cols, vocab)
            logits = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
            torch.matmul(h_b, weight[v0:v1].t(), out=logits)
            if v1 - v0 != cols:  # the last, narrower slab
                ch = _Tile(*_num_splits(block_rows, v1 - v0, hidden.device), part)
            # One split per row (the forward's tiles are thousands of rows): the fold takes the
            # row's statistics itself, one launch instead of two.
            fused = ch.splits == 1
            if not fused:
                _row_stats(ch, logits, inv_t)
            kernels.merge_slab_kernel[(r1 - r0,)](
                logits, logits.stride(0), 1, part, state, z_y, labels,
                idx if idx is not None else labels, r0, v0, v1 - v0, inv_t, ignore_index,
                NUM_SPLITS=ch.splits, HAS_IDX=idx is not None, FIRST=v0 == 0, STATS=fused,
                BLOCK_V=BLOCK_V, PREFETCH=PREFETCH, num_warps=_NUM_WARPS if fused else 1,
            )
        ch = _Tile(splits, span, part)


class _Tile:
    """Launch geometry of the epilogue kernels for one logits buffer shape."""

    def __init__(self, splits, span, part):
        self.splits, self.span, self.part = splits, span, part


def backward_tiles(rows: int, vocab: int, hid: int, itemsize: int, budget: int,
                   need_dh: bool) -> Tuple[int, int]:
    """``(block_rows, slab_cols)`` of the recompute backward, fp32 dh block included in ``budget``.

    The backward walks V in slabs for each block of rows: ``dW[slab]`` comes from one GEMM over
    the whole row block (one rounding per row block, not per small chunk) and dh accumulates in
    fp32 across slabs. The fp32 ``(block_rows, H)`` accumulator takes at most half of
    ``budget`` (fewer row blocks: fewer roundings of dW); the logits slab takes the rest.

    Args:
        rows (int): rows to process. vocab (int): V. hid (int): H. itemsize (int): bytes per logit.
        budget (int): bytes for the logits slab and the fp32 dh block. need_dh (bool): dh wanted.

    Returns:
        Tuple[int, int]: rows per block and columns per slab.

    Example:
        >>> backward_tiles(8192, 152064, 3584, 2, 224 << 20, True)
        (8192, 7168)
    """
    acc = hid * 4 if need_dh else 0
    block = max(1, rows)
    if acc:
        block = min(block, max(64, budget // 2 // acc))
    cols = max(0, budget - block * acc) // (block * itemsize)
    if cols < min(MIN_SLAB, vocab):
        cols = min(MIN_SLAB, vocab)
        block = max(1, min(block, budget // (cols * itemsize + acc)))
    cols = vocab if cols >= vocab else (cols - cols % 256 if cols > 256 else cols)
    if block > 128:
        block -= block % 64
    return max(1, min(block, rows)), cols


_OUT_DTYPE_OK = True


def _acc32(acc, a, b, first):
    # acc (fp32) [+]= a @ b with fp32 accumulation and no low-precision intermediate.
    global _OUT_DTYPE_OK
    if a.dtype == torch.float32:
        torch.matmul(a, b, out=acc) if first else acc.addmm_(a, b)
        return
    if a.is_cuda and _OUT_DTYPE_OK:
        try:  # bf16/fp16 inputs, fp32 output in one cuBLAS call (torch >= 2.8)
            if first:
                torch.mm(a, b, out_dtype=torch.float32, out=acc)
            else:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            _OUT_DTYPE_OK = False
    if a.is_cuda:  # older torch: a temporary in the input dtype, accumulated in fp32
        res = torch.matmul(a, b)
        acc.copy_(res) if first else acc.add_(res)
    else:  # CPU (the interpreter tests): no mixed-dtype GEMM there
        torch.matmul(a.float(), b.float(), out=acc) if first else acc.addmm_(a.float(), b.float())


def head_backward(hidden, weight, labels, lse, ent, g_logp, g_ent, ignore_index: int,
                  temperature: float, need_dh: bool, need_dw: bool, n_valid: int = -1):
    """Gradients of ``sum(g_logp * logp + g_ent * ent)`` w.r.t. hidden and weight (recompute).

    Args:
        hidden, weight, labels: as in :func:`head_forward`.
        lse, ent (torch.Tensor): fp32 ``(N,)`` saved by the forward.
        g_logp, g_ent (Optional[torch.Tensor]): fp32 ``(N,)`` upstream gradients (None: zero).
        ignore_index (int), temperature (float): as in the forward.
        need_dh, need_dw (bool): which gradients to compute.
        n_valid (int): as in :func:`head_forward` (the forward's count, kept by autograd).

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``dh`` ``(N, H)`` and ``dw`` ``(V, H)`` in the inputs'
        dtype (empty ``(0,)`` tensors for the ones not needed).
    """
    idx = valid_rows(labels, ignore_index, n_valid)
    return _slab_backward(rows_for_gradients(hidden, labels, ignore_index, idx, n_valid), weight, labels, idx,
                          lse, ent if g_ent is not None else None, g_logp, g_ent, None,
                          1.0 / temperature, ignore_index, need_dh, need_dw)


def _slab_backward(hidden, weight, labels, idx, lse, ent, glp, gent, coef, inv_t, ignore_index,
                   need_dh, need_dw):
    rows = hidden.shape[0] if idx is None else idx.numel()
    vocab, hid = weight.shape
    dh = _grad_buffer(hidden, need_dh, zero=idx is not None or rows == 0)
    dw = _grad_buffer(weight, need_dw, zero=rows == 0)
    if rows == 0 or not (need_dh or need_dw):
        return dh, dw
    block, cols = backward_tiles(rows, vocab, hid, hidden.element_size(), WORKSPACE_BYTES, need_dh)
    in_gemm = gemm_epilogues.use(hidden, weight)
    quack = None if in_gemm or not quack_head.dlogits_apply(hidden, weight, settings.head_gemm) \
        else quack_head.SlabDlogits(block, hidden.device)
    # The Triton GEMMs read the dlogits through a tensor descriptor: 16-byte aligned row stride.
    ld = gemm_epilogues.aligned_cols(cols, hidden.element_size()) if in_gemm else cols
    buf = hidden.new_empty((block * ld,))
    dh32 = hidden.new_empty((block, hid), dtype=torch.float32) if need_dh else None
    for bi, r0 in enumerate(range(0, rows, block)):
        r1 = min(r0 + block, rows)
        idx_b = None if idx is None else idx[r0:r1]
        h_b = hidden[r0:r1] if idx is None else hidden.index_select(0, idx_b)
        for v0 in range(0, vocab, cols):
            v1 = min(v0 + cols, vocab)
            if in_gemm:  # logits GEMM with the dlogits in its epilogue
                logits = buf[: (r1 - r0) * ld].view(r1 - r0, ld)[:, : v1 - v0]
                gemm_epilogues.logits_dlogits(h_b, weight[v0:v1], logits, labels, idx_b, r0, v0, lse,
                                              ent, glp, gent, coef, inv_t, ignore_index)
            else:
                logits = buf[: (r1 - r0) * (v1 - v0)].view(r1 - r0, v1 - v0)
                if quack is not None:  # QuACK's logits GEMM storing the dlogits
                    quack(h_b, weight[v0:v1], logits, labels, idx, r0, v0, lse, ent, glp, gent, coef, inv_t,
                          ignore_index)
                else:
                    torch.matmul(h_b, weight[v0:v1].t(), out=logits)
                    tile = _Tile(*_num_splits(r1 - r0, v1 - v0, hidden.device), None)
                    _dlogits(tile, logits, idx_b, r0, labels, lse, ent, glp, gent, coef, inv_t,
                             ignore_index, col0=v0)
            if need_dh:
                _acc32(dh32[: r1 - r0], logits, weight[v0:v1], first=v0 == 0)
            if need_dw:
                _dw_update(dw[v0:v1], logits, h_b, weight, first=bi == 0)
        if need_dh:
            if idx is None:
                dh[r0:r1].copy_(dh32[: r1 - r0])
            else:
                dh.index_copy_(0, idx_b, dh32[: r1 - r0].to(dh.dtype))
    return dh, dw


def _grad_buffer(like, needed, zero):
    if not needed:
        return like.new_empty((0,))
    return torch.zeros_like(like) if zero else torch.empty_like(like)


def cached_block_rows(rows: int, n_c: int, hid: int, need_dw: bool) -> int:
    """Rows of the one-pass CE's first block, whose logits are cached in dW's buffer (0: none).

    dW's buffer ``(V, H)`` is free until dW is first written, so the logits of up to ``H`` rows
    fit there, transposed ``(V, rows)``. That first block then costs no workspace and is rounded
    into dW once, so fewer small chunks follow: at the 7B head (8192 rows, H = 3584, 768-row
    chunks) 1 + 6 roundings of dW instead of 11. Used when dW is wanted and the rows need more
    than one chunk; at most ``WORKSPACE_BYTES / (8 H)`` rows, so that the block's fp32 dh
    accumulator takes at most half of the workspace.

    Args:
        rows (int): valid rows. n_c (int): rows per regular chunk. hid (int): H.
        need_dw (bool): dW is computed.

    Returns:
        int: rows of the cached block.

    Example:
        >>> cached_block_rows(8192, 768, 3584, True)  # with LOGITLESS_TRITON_CACHE_FIRST_BLOCK=1
        3584
    """
    if not (CACHE_FIRST_BLOCK and need_dw) or rows <= n_c:
        return 0
    return max(0, min(rows, hid, WORKSPACE_BYTES // (8 * hid)))


#: 2-D blocks of the transposed-tile kernels (the CPU interpreter uses small ones).
T_BLOCK_S, T_BLOCK_R = (8, 8) if os.environ.get("TRITON_INTERPRET", "0") == "1" else (64, 64)
#: V rows per GEMM of the cached block's statistics pass (its logits go straight into dW's buffer).
CACHED_SLAB = 8192


def _t_geometry(s_rows, r_cols, device):
    # A transposed (S, R) tile: column blocks take the place of rows, S is split like V.
    return _num_splits(-(-r_cols // T_BLOCK_R), s_rows, device, block=T_BLOCK_S)


def _cached_block(hidden, weight, labels, idx, rows_b, ignore_index, inv_t, dh, dw, upstream, outputs=None):
    """The one-pass path on the first ``rows_b`` valid rows with their logits kept in ``dw``'s buffer.

    ``upstream(logp_b, ent_b, rows)`` gives the gradient of the objective w.r.t. the block's
    log-probs and entropies once they are known: ``(coef, None, None)`` for cross-entropy (``coef``
    a device scalar), ``(None, g_logp_b, g_ent_b)`` for a token objective; ``rows`` are the block's
    row indices among the ``N`` rows.

    Pass 1: for each V slab, ``lt[v0:v1] = W[v0:v1] @ h.T`` straight into
    ``lt = dw[:V * rows_b].view(V, rows_b)`` (the logits, transposed), ``col_stats_kernel`` and the
    running per-row state. Pass 2 walks V slabs from the end: ``dlogits_t_kernel`` reads
    ``lt[v0:v1]`` and writes the gradient into the workspace, ``dh += dl @ W[slab]`` (fp32) and
    ``dW[v0:v1] = dl.T @ h``, which overwrites only consumed logits: it spans elements
    ``[v0 H, v1 H)``, the unconsumed ``lt`` rows ``[0, v0 rows_b)``, and ``rows_b <= H``. Three
    GEMMs, no recompute, no transposed copy; returns ``(logp, ent, lse)`` of all ``N`` rows (0
    outside the block), written into ``outputs`` where given (zeroed, as :func:`row_outputs`).
    """
    n = hidden.shape[0]
    vocab, hid = weight.shape
    dev = hidden.device
    idx_b = None if idx is None else idx[:rows_b]
    h_b = hidden[:rows_b] if idx_b is None else hidden.index_select(0, idx_b)
    y_b = labels[:rows_b] if idx_b is None else labels.index_select(0, idx_b)
    lt = dw.view(-1)[: vocab * rows_b].view(vocab, rows_b)
    state = hidden.new_empty((rows_b, 3), dtype=torch.float32)
    z_y = hidden.new_zeros((rows_b,), dtype=torch.float32)
    for v0 in range(0, vocab, CACHED_SLAB):
        v1 = min(v0 + CACHED_SLAB, vocab)
        slab = lt[v0:v1]
        torch.matmul(weight[v0:v1], h_b.t(), out=slab)
        splits, span = _t_geometry(v1 - v0, rows_b, dev)
        part = hidden.new_empty((rows_b, splits, 3), dtype=torch.float32)
        kernels.col_stats_kernel[(-(-rows_b // T_BLOCK_R), splits)](
            slab, part, v1 - v0, rows_b, span, inv_t,
            NUM_SPLITS=splits, BLOCK_S=T_BLOCK_S, BLOCK_R=T_BLOCK_R, num_warps=_NUM_WARPS,
        )
        kernels.merge_slab_kernel[(rows_b,)](
            slab, 1, rows_b, part, state, z_y, y_b, y_b, 0, v0, v1 - v0, inv_t, ignore_index,
            NUM_SPLITS=splits, HAS_IDX=False, FIRST=v0 == 0, num_warps=1,
        )
    logp_b, ent_b, lse_b = row_outputs(hidden, rows_b)
    kernels.finalize_state_kernel[(-(-rows_b // 1024),)](
        state, z_y, y_b, y_b, logp_b, ent_b, lse_b, rows_b, ignore_index, HAS_IDX=False, BLOCK=1024,
        num_warps=4,
    )
    rows = torch.arange(rows_b, device=dev) if idx_b is None else idx_b
    coef, glp_b, gent_b = upstream(logp_b, ent_b, rows)
    need_dh = dh is not None
    acc = hid * 4 if need_dh else 0
    itemsize = hidden.element_size()
    cols = max(MIN_SLAB, (WORKSPACE_BYTES - rows_b * acc) // (rows_b * itemsize))
    buf = hidden.new_empty((rows_b * min(cols, vocab),))
    dh32 = hidden.new_empty((rows_b, hid), dtype=torch.float32) if need_dh else None
    dummy = lse_b
    for v1 in range(vocab, 0, -cols):
        v0 = max(0, v1 - cols)
        dl = buf[: rows_b * (v1 - v0)].view(v1 - v0, rows_b)  # transposed, like lt
        splits, span = _t_geometry(v1 - v0, rows_b, dev)
        kernels.dlogits_t_kernel[(-(-rows_b // T_BLOCK_R), splits)](
            lt[v0:v1], dl, y_b, lse_b, ent_b if gent_b is not None else dummy,
            glp_b if glp_b is not None else dummy, gent_b if gent_b is not None else dummy,
            coef if coef is not None else dummy, v1 - v0, rows_b, v0, span, inv_t, ignore_index,
            MODE_CE=coef is not None, HAS_GLP=glp_b is not None, HAS_GENT=gent_b is not None,
            BLOCK_S=T_BLOCK_S, BLOCK_R=T_BLOCK_R, num_warps=_NUM_WARPS,
        )
        if need_dh:
            _acc32(dh32, dl.t(), weight[v0:v1], first=v1 == vocab)
        torch.matmul(dl, h_b, out=dw[v0:v1])
    if need_dh:
        if idx_b is None:
            dh[:rows_b].copy_(dh32)
        else:
            dh.index_copy_(0, idx_b, dh32.to(dh.dtype))
    outputs = outputs if outputs is not None else row_outputs(hidden, n)
    for full, t in zip(outputs, (logp_b, ent_b, lse_b)):
        if idx_b is None:
            full[:rows_b] = t
        else:
            full.index_copy_(0, idx_b, t)
    return tuple(outputs)


def one_pass_chunks(rows: int, n_c: int, cached: int) -> int:
    """Row chunks of the one pass: the cached first block (if any), then chunks of ``n_c`` rows."""
    return (cached > 0) + -(-(rows - cached) // n_c)


def one_pass_pins(rows: int, n_c: int, cached: int, vocab: int, need_dw: bool, itemsize: int) -> int:
    """Whether a scalar-upstream call runs in one pass, and with how many pinned label columns.

    One pass when dW is not wanted, or the valid rows fit ``FUSED_MAX_CHUNKS`` chunks, or label
    columns can be pinned (:func:`pinned_columns`; not with a cached first block, whose dW rows
    are written before the chunks) and they fit ``PINNED_MAX_CHUNKS``.

    Args:
        rows (int): valid rows. n_c (int): rows per chunk. cached (int): rows of the cached first
            block (:func:`cached_block_rows`). vocab (int): V. need_dw (bool).
        itemsize (int): bytes per element of the inputs.

    Returns:
        int: -1 for the two-pass path, else the columns to pin (0: none).
    """
    if not need_dw:
        return 0
    chunks = one_pass_chunks(rows, n_c, cached)
    k = 0 if cached else pinned_columns(rows, vocab, chunks, itemsize)
    if k and chunks <= PINNED_MAX_CHUNKS:
        return k
    return 0 if chunks <= FUSED_MAX_CHUNKS else -1


def ce_fused(hidden, weight, labels, ignore_index: int, temperature: float, mean: bool,
             need_dh: bool, need_dw: bool, n_valid: int = -1):
    """Cross-entropy with its gradients computed in the same pass (scalar upstream of 1).

    Args:
        hidden, weight, labels, ignore_index, temperature: as in :func:`head_forward`.
        mean (bool): average over non-ignored tokens (else sum).
        need_dh, need_dw (bool): which gradients to compute.
        n_valid (int): as in :func:`head_forward`.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, torch.Tensor]: fp32 scalar loss, ``dh``, ``dw`` (the
        gradients of the loss itself; scale them by the upstream gradient in backward).
    """
    n = hidden.shape[0]
    idx = valid_rows(labels, ignore_index, n_valid)
    hidden = rows_for_gradients(hidden, labels, ignore_index, idx, n_valid)
    inv_t = 1.0 / temperature
    rows = n if idx is None else idx.numel()
    n_c = one_pass_rows(rows, hidden, weight, WORKSPACE_BYTES)
    cached = cached_block_rows(rows, n_c, weight.shape[1], need_dw)
    pin = one_pass_pins(rows, n_c, cached, weight.shape[0], need_dw, hidden.element_size())
    ch = chunks = None
    if pin >= 0 and not cached:
        ch, chunks = queued_chunks(hidden, weight, idx, labels, inv_t, entropy=False)
    logp, ent, lse = row_outputs(hidden, n)
    count = (labels != ignore_index).sum()
    coef = (1.0 / count.clamp(min=1).float()) if mean else hidden.new_ones((), dtype=torch.float32)
    if pin < 0:
        # Too many row chunks: dW would be rounded to the input dtype once per chunk. Two passes
        # (slab forward for the LSE, slab backward) cost a fourth GEMM but round dW once per
        # row block of thousands of rows.
        logp, _, lse = _forward(hidden, weight, labels, idx, ignore_index, inv_t, for_backward=True)
        dh, dw = _slab_backward(hidden, weight, labels, idx, lse, None, None, None, coef, inv_t,
                                ignore_index, need_dh, need_dw)
        return -(logp.sum() * coef), dh, dw
    dh = _grad_buffer(hidden, need_dh, zero=idx is not None)
    dw = _grad_buffer(weight, need_dw, zero=rows == 0)
    if cached:
        logp, ent, lse = _cached_block(hidden, weight, labels, idx, cached, ignore_index, inv_t,
                                       dh if need_dh else None, dw, lambda *_: (coef, None, None))
        ch, chunks = queued_chunks(hidden, weight, idx, labels, inv_t, entropy=False, first=cached)
    pinned = PinnedColumns(labels, idx, ignore_index, pin, rows, weight.shape[0], hidden, ch.n_c) \
        if pin > 0 else None
    for i, (h_c, idx_c, start, logits) in enumerate(chunks):
        _stats(ch, logits, idx_c, start, labels, logp, ent, lse, inv_t, ignore_index)
        _dlogits(ch, logits, idx_c, start, labels, lse, None, None, None, coef, inv_t, ignore_index)
        _grads(ch, logits, h_c, idx_c, start, dh if need_dh else None, dw if need_dw else None,
               i == 0 and not cached, pinned)
    if pinned is not None:
        # the logits workspace is free before the pinned rows' GEMM
        ch = chunks = logits = h_c = None
        pinned.finish(dw, hidden, idx)
    loss = -(logp.sum() * coef)
    return loss, dh, dw


def scale_(x: torch.Tensor, g: torch.Tensor) -> None:
    """``x *= g`` in place on the device, without a host sync; free when ``g == 1``.

    Args:
        x (torch.Tensor): contiguous tensor to scale (a gradient).
        g (torch.Tensor): scalar tensor on the same device.
    """
    if x.numel() == 0:
        return
    block = 4096
    g32 = g.reshape(()).to(torch.float32)
    kernels.scale_kernel[(triton_cdiv(x.numel(), block),)](x, g32, x.numel(), BLOCK=block, num_warps=8)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
