"""The head's GEMMs with the softmax work in a CuTe-DSL GEMM's epilogue (QuACK).

QuACK (``quack-kernels``, an optional dependency) runs the head GEMM as a warp-specialised Hopper
kernel whose epilogue reduces every fp32 output tile in registers, so the logits are never stored.
Three GEMMs of the head use it:

* :func:`log_probs`: log-probs alone, no entropy, no gradient (GRPO's reference and old-policy
  passes, a loss-only evaluation): the epilogue folds each tile into the row's online log-sum-exp
  and picks out the label's logit. On an H200 0.92-1.01 of one cuBLAS GEMM's time at the 7B, 8B,
  0.5B and 32768-row heads (the GEMM writes its bf16 output; this one does not), against 1.10-1.64
  for the cuBLAS + Triton-epilogue path (docs/history.md).
* :func:`forward_outputs`: log-probs, entropy and the float64 log-sum-exp of ``impl="triton"``'s
  forward (:func:`logitless.ops.triton.head.head_forward`), with or without a backward to follow:
  per (row, N tile) the tile's max (a prepass over the accumulator), ``sum 2^x`` and ``sum 2^x x``,
  folded per row by a Triton kernel. When a backward follows, the accumulator is rounded to bf16
  first: the backward recomputes bf16 logits, and the log-sum-exp must be theirs.
* :class:`SlabDlogits`: the recompute backward's logits GEMM over a (row block, V slab), which
  stores the gradient w.r.t. the bf16-rounded logits instead of the logits (the label's entry is
  written after it, in fp32 before its rounding); dh and dW stay cuBLAS GEMMs.
* :class:`ChunkStats` and :func:`dw_accumulate`: the one pass of cross-entropy and of the token
  objective (full-V row chunks, gradients in the same pass): the chunk's logits GEMM stores the bf16
  logits and the same per-tile statistics as :func:`forward_outputs`, so no pass reads the logits
  for them; ``dW (+)= dl.T @ h_c`` adds each chunk's product to dW through the GEMM's tensor-memory
  store (a reduce-add in L2: dW is not read back into the SMs), where cuBLAS's ``addmm_`` reads dW in
  an epilogue that does not overlap its main loop. dh stays a cuBLAS GEMM.

``LOGITLESS_HEAD_GEMM`` chooses it: ``quack`` asks for it (an error if ``quack-kernels`` is not
installed), ``auto`` takes it where it applies and QuACK is installed. It applies to bf16 inputs on
an sm_90 GPU with ``H`` a multiple of 8 (the GEMM's tensor-memory-access rows), outside
``torch.compile`` tracing, for :func:`forward_outputs` and :class:`ChunkStats` a vocabulary that one
of the epilogue's N tiles divides (:func:`stats_tile_n`), for :class:`SlabDlogits` one with ``V % 8 == 0`` and
``V >= 1024`` (:func:`dlogits_apply`); every other call runs the cuBLAS + Triton path as before.
Every tensor handed to QuACK starts 16-byte aligned (it refuses others).
"""

import functools
import importlib.util
from typing import Optional

import torch

__all__ = ["quack_installed", "forward_applies", "outputs_apply", "dlogits_apply", "stats_tile_n", "log_probs",
           "forward_outputs", "SlabDlogits", "ChunkStats", "dw_accumulate", "chunk_rows_on_quack",
           "ROWS_PER_LAUNCH", "TILE_N_CHOICES"]

#: Rows per GEMM launch: the epilogue's per-(row, tile) log-sum-exp partials of 8192 rows take about
#: 0.05 GiB at a 152k vocabulary (0.19 GiB at 32768 rows in one launch), within the forward's 0.1 GiB.
ROWS_PER_LAUNCH = 8192

#: N tiles of :func:`forward_outputs`'s epilogue in order of preference (192: QuACK's sm_90 default);
#: the tile must divide the vocabulary (its max prepass and its sums would see the zeros of a ragged
#: tile's columns past ``V``).
TILE_N_CHOICES = (192, 128, 256)

_LOG2E = 1.4426950408889634


@functools.cache
def quack_installed() -> bool:
    """Whether ``quack-kernels`` can be imported (its module found once per process; not imported)."""
    return importlib.util.find_spec("quack") is not None


def forward_applies(hidden: torch.Tensor, weight: torch.Tensor, mode: str) -> bool:
    """Whether a forward-only log-prob call (no entropy, no gradient) runs on QuACK's GEMM.

    Args:
        hidden (torch.Tensor): ``(N, H)``.
        weight (torch.Tensor): ``(V, H)``.
        mode (str): ``LOGITLESS_HEAD_GEMM`` as the call sees it.

    Returns:
        bool: True for ``mode`` ``"quack"`` or ``"auto"`` with bf16 CUDA inputs on an sm_90 GPU,
        ``H % 8 == 0``, outside ``torch.compile`` tracing, and QuACK installed.

    Example:
        >>> forward_applies(torch.randn(4, 8), torch.randn(11, 8), "auto")  # CPU tensors
        False
    """
    if mode not in ("quack", "auto"):
        return False
    if torch.compiler.is_compiling():
        return False
    if not (hidden.is_cuda and hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
        return False
    if hidden.shape[1] % 8 != 0 or hidden.shape[0] == 0:
        return False
    if torch.cuda.get_device_capability(hidden.device) != (9, 0):
        return False
    return quack_installed()


def log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int,
              temperature: float) -> torch.Tensor:
    """Per-row ``log softmax(hidden @ weight.T / temperature)[label]``; 0 at ignored rows.

    Args:
        hidden (torch.Tensor): ``(N, H)`` bf16, contiguous, on an sm_90 GPU.
        weight (torch.Tensor): ``(V, H)`` bf16, contiguous.
        labels (torch.Tensor): ``(N,)`` int64 in ``[0, V)`` or ``ignore_index`` (validated by the
            caller).
        ignore_index (int): rows with this label get 0.
        temperature (float): > 0, divides the logits (in fp32, in the epilogue).

    Returns:
        torch.Tensor: ``(N,)`` float32.

    Example:
        >>> logp = log_probs(h, w, y, ignore_index=-100, temperature=0.7)  # doctest: +SKIP
    """
    from logitless.ops import _quack_epilogues

    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], ROWS_PER_LAUNCH):
        rows = slice(start, start + ROWS_PER_LAUNCH)
        stats = _quack_epilogues.label_log_prob_stats(hidden[rows], weight, labels[rows], 1.0 / float(temperature))
        # a row whose label is out of range (ignored) has no label logit written: discard it
        out[rows] = torch.where(labels[rows] != ignore_index, stats["target_logit"] - stats["lse"], 0.0)
    return out


def outputs_apply(hidden: torch.Tensor, weight: torch.Tensor, mode: str) -> bool:
    """Whether :func:`forward_outputs` runs this forward: :func:`forward_applies` and an N tile
    that divides the vocabulary (:func:`stats_tile_n`).

    Example:
        >>> outputs_apply(torch.randn(4, 8), torch.randn(11, 8), "quack")  # CPU tensors
        False
    """
    return forward_applies(hidden, weight, mode) and stats_tile_n(weight.shape[0]) > 0


def stats_tile_n(vocab: int) -> int:
    """The N tile of :func:`forward_outputs` at this vocabulary: the first of :data:`TILE_N_CHOICES`
    that divides it, 0 when none does (the call then runs the cuBLAS + Triton path).

    Example:
        >>> stats_tile_n(152064), stats_tile_n(151936), stats_tile_n(32001)
        (192, 128, 0)
    """
    return next((tile_n for tile_n in TILE_N_CHOICES if vocab % tile_n == 0), 0)


def forward_outputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    idx: Optional[torch.Tensor], inv_t: float, ignore_index: int, for_backward: bool,
                    logp: torch.Tensor, ent: torch.Tensor, lse: torch.Tensor, budget: int) -> None:
    """Fill ``logp``, ``ent`` and ``lse`` (as :func:`logitless.ops.triton.head.head_forward` returns
    them) at the rows ``idx`` (every row when None) from QuACK's GEMM with the statistics epilogue.

    Args:
        hidden (torch.Tensor): ``(N, H)`` bf16, contiguous, on an sm_90 GPU.
        weight (torch.Tensor): ``(V, H)`` bf16, contiguous, ``stats_tile_n(V) > 0``.
        labels (torch.Tensor): ``(N,)`` int64 in ``[0, V)`` or ``ignore_index`` (validated).
        idx (Optional[torch.Tensor]): int64 indices of the rows to compute (the valid ones).
        inv_t (float): ``1 / temperature``.
        ignore_index (int): the ignored label (0 log-prob and entropy; its LSE is still written).
        for_backward (bool): statistics of the bf16-rounded logits that the backward recomputes;
            else of the fp32 accumulator.
        logp, ent (torch.Tensor): ``(N,)`` fp32 outputs; lse: ``(N,)`` float64.
        budget (int): bytes for the per-(row, tile) statistics and the gathered rows of a launch.

    Example:
        >>> forward_outputs(h, w, y, None, 1.0, -100, False, logp, ent, lse, 88 << 20)  # doctest: +SKIP
    """
    from logitless.ops import _quack_epilogues
    from logitless.ops.triton import kernels

    rows = hidden.shape[0] if idx is None else idx.numel()
    vocab, hid = weight.shape
    tile_n = stats_tile_n(vocab)
    n_tiles = vocab // tile_n
    row_bytes = 3 * n_tiles * 4 + 4 + (0 if idx is None else hid * hidden.element_size())
    # Equal launches of whole 128-row tiles, as many rows each as the budget holds.
    launches = -(-rows // max(128, budget // row_bytes // 128 * 128))
    step = min(rows, -(-rows // (launches * 128)) * 128)
    # Each statistic's block starts 16-byte aligned (QuACK's operand rule): rows rounded up to 4.
    stats = torch.empty((3, -(-step // 4) * 4, n_tiles), dtype=torch.float32, device=hidden.device)
    acc_y = torch.empty((step,), dtype=torch.float32, device=hidden.device)
    gathered = None if idx is None else hidden.new_empty((step, hid))
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        m = r1 - r0
        if idx is None:
            h_b, y_b = hidden[r0:r1], labels[r0:r1]
        else:
            h_b = torch.index_select(hidden, 0, idx[r0:r1], out=gathered[:m])
            y_b = labels.index_select(0, idx[r0:r1])
        tile_max, sum_exp, sum_exp_x = stats[0, :m], stats[1, :m], stats[2, :m]
        _quack_epilogues.tile_entropy_stats(
            h_b, weight, y_b, _LOG2E * inv_t, round_logits=for_backward, tile_n=tile_n, tile_max=tile_max,
            sum_exp=sum_exp, sum_exp_x=sum_exp_x, target_acc=acc_y[:m])
        kernels.finalize_tile_stats_kernel[(m,)](
            tile_max, sum_exp, sum_exp_x, acc_y, labels, idx if idx is not None else labels, logp, ent, lse,
            r0, n_tiles, inv_t, ignore_index, HAS_IDX=idx is not None, BLOCK_T=1024, num_warps=4,
        )


def dlogits_apply(hidden: torch.Tensor, weight: torch.Tensor, mode: str) -> bool:
    """Whether the recompute backward's logits GEMMs run on QuACK (:class:`SlabDlogits`):
    :func:`forward_applies`, ``V % 8 == 0`` (the bf16 dlogits slab's rows start 16-byte aligned) and
    ``V >= 1024`` (below, a slab is a few of the GEMM's tiles: nothing to gain).

    Example:
        >>> dlogits_apply(torch.randn(4, 8), torch.randn(1024, 8), "quack")  # CPU tensors
        False
    """
    return forward_applies(hidden, weight, mode) and weight.shape[0] % 8 == 0 and weight.shape[0] >= 1024


class SlabDlogits:
    """The dlogits of (row block, V slab) tiles of the recompute backward, on QuACK's GEMM.

    Args:
        block (int): the most rows of a block.
        device (torch.device): where the per-row buffers live.

    Example:
        >>> slabs = SlabDlogits(block, h.device)  # doctest: +SKIP
        >>> slabs(h_b, w[v0:v1], dl, labels, idx, r0, v0, lse, ent, glp, gent, coef, inv_t, -100)  # doctest: +SKIP
    """

    def __init__(self, block: int, device: torch.device):
        # Each row of the per-row inputs starts 16-byte aligned (QuACK's operand rule).
        self.rows = torch.empty((5, -(-block // 4) * 4), dtype=torch.float32, device=device)
        self.slab_label = torch.empty((block,), dtype=torch.int64, device=device)
        self.label_acc = torch.empty((block,), dtype=torch.float32, device=device)

    def __call__(self, h_b, weight_slab, out, labels, idx, r0, v0, lse, ent, glp, gent, coef, inv_t, ignore_index):
        """Write the dlogits of rows ``r0 ..`` (of ``idx`` when given) and columns ``v0 ..`` into ``out``
        (``(rows, W)`` bf16): ``c_lp (onehot - p) - c_ent p (log p + entropy)``, with the per-row
        coefficients of ``kernels.dlogits_kernel`` (``coef``: cross-entropy's scale; else ``glp``,
        ``gent``: per-row upstreams)."""
        from logitless.ops import _quack_epilogues
        from logitless.ops.triton import kernels

        m, width = out.shape
        rows, slab_label, label_acc = self.rows[:, :m], self.slab_label[:m], self.label_acc[:m]
        dummy = lse
        flags = dict(HAS_GENT=gent is not None, HAS_IDX=idx is not None, BLOCK=256, num_warps=4)
        grid = (-(-m // 256),)
        kernels.slab_row_inputs_kernel[grid](
            labels, idx if idx is not None else labels, r0, lse, ent if ent is not None else dummy,
            glp if glp is not None else dummy, gent if gent is not None else dummy,
            coef if coef is not None else dummy, rows, rows.stride(0), slab_label, m, v0, width, inv_t, ignore_index,
            MODE_CE=coef is not None, HAS_GLP=glp is not None, **flags)
        _quack_epilogues.slab_dlogits(h_b, weight_slab, out, rows, slab_label, label_acc, inv_t)
        kernels.label_dlogits_kernel[grid](
            out, out.stride(0), slab_label, label_acc, rows, rows.stride(0), lse, idx if idx is not None else labels, r0,
            m, inv_t,
            **flags)


def chunk_rows_on_quack(n_rows: int, vocab: int, itemsize: int, budget: int) -> int:
    """Rows per one-pass chunk when :class:`ChunkStats` runs its logits GEMM: the rows whose logits
    fit ``budget`` bytes, in an even number of 128-row tiles.

    The GEMM runs its tiles in (2, 1) clusters, so an odd count leaves half of the last cluster idle
    (the 8B head's 896-row chunks: 7 tiles in 8 slots); and cuBLAS's dh GEMM (``dl @ W``) ran at half
    speed at 704 and 832 rows with H = 896 (0.53 against 0.28 ms at 768 on an H200). The per-tile
    statistics (2-4% of a row's logits at a 152k vocabulary) are held beside the workspace, as the
    per-row outputs are: cross-entropy's at the 7B head 4.6 MiB.

    Args:
        n_rows (int): rows to process. vocab (int): V. itemsize (int): bytes per logit.
        budget (int): bytes of the logits workspace.

    Returns:
        int: rows per chunk, in ``[1, max(n_rows, 1)]``.

    Example:
        >>> chunk_rows_on_quack(8192, 128256, 2, 224 << 20)  # the 8B head: 768, not 896
        768
    """
    rows = max(1, budget // (vocab * itemsize))
    if rows > 256:
        rows -= rows % 64
        tiles = -(-rows // 128)
        rows = (tiles - 1) * 128 if tiles % 2 else rows
    return max(1, min(rows, n_rows))


class ChunkStats:
    """The logits GEMM of a one-pass chunk on QuACK: stores the bf16 logits with their per-tile
    statistics (:meth:`logits`), which :meth:`finalize` folds into the rows' log-probs, entropies
    and float64 log-sum-exps (those of the stored, rounded logits).

    Args:
        chunk (int): the most rows of a chunk.
        vocab (int): V, ``stats_tile_n(vocab) > 0``.
        device (torch.device): where the per-tile statistics live.
        entropy (bool): also the entropies (else ``ent`` is left as it is, and the statistics take
            two fp32 per (row, tile) instead of three).

    Example:
        >>> stats = ChunkStats(n_c, w.shape[0], h.device, entropy=False)  # doctest: +SKIP
        >>> stats.logits(h_c, w, y_c, logits, inv_t=1.0)  # doctest: +SKIP
        >>> stats.finalize(labels, idx, start, h_c.shape[0], logp, ent, lse, 1.0, -100)  # doctest: +SKIP
    """

    def __init__(self, chunk: int, vocab: int, device: torch.device, entropy: bool = True):
        self.tile_n = stats_tile_n(vocab)
        self.n_tiles = vocab // self.tile_n
        self.entropy = entropy
        # Each statistic's block starts 16-byte aligned (QuACK's operand rule): rows rounded up to 4.
        self.stats = torch.empty((3 if entropy else 2, -(-chunk // 4) * 4, self.n_tiles), dtype=torch.float32,
                                 device=device)
        self.acc_y = torch.empty((chunk,), dtype=torch.float32, device=device)

    def logits(self, h_c: torch.Tensor, weight: torch.Tensor, y_c: torch.Tensor, out: torch.Tensor,
               inv_t: float) -> None:
        """``out = h_c @ weight.T`` (``(rows, V)`` bf16, 16-byte aligned rows) and the statistics of
        its rows (labels ``y_c``) at temperature ``1 / inv_t``."""
        from logitless.ops import _quack_epilogues

        m = h_c.shape[0]
        _quack_epilogues.tile_entropy_stats(
            h_c, weight, y_c, _LOG2E * inv_t, round_logits=True, tile_n=self.tile_n, tile_max=self.stats[0, :m],
            sum_exp=self.stats[1, :m], sum_exp_x=self.stats[2, :m] if self.entropy else None,
            target_acc=self.acc_y[:m], logits=out)

    def finalize(self, labels: torch.Tensor, idx: Optional[torch.Tensor], start: int, m: int, logp: torch.Tensor,
                 ent: torch.Tensor, lse: torch.Tensor, inv_t: float, ignore_index: int) -> None:
        """Write the outputs of the last :meth:`logits` chunk, its ``m`` rows ``start ..`` of the valid
        rows ``idx`` (every row when None), into ``logp``, ``ent`` (fp32) and ``lse`` (float64), by
        original row."""
        from logitless.ops.triton import kernels

        kernels.finalize_tile_stats_kernel[(m,)](
            self.stats[0, :m], self.stats[1, :m], self.stats[-1, :m], self.acc_y, labels,
            idx if idx is not None else labels, logp, ent, lse, start, self.n_tiles, inv_t, ignore_index,
            HAS_IDX=idx is not None, BLOCK_T=1024, HAS_ENT=self.entropy, num_warps=4,
        )


def dw_accumulate(dw: torch.Tensor, dl: torch.Tensor, h_c: torch.Tensor, first: bool) -> None:
    """``dw = dl.T @ h_c`` (``first``) or ``dw += dl.T @ h_c`` on QuACK's GEMM, the sum added by its
    store (a reduce-add in L2) instead of an epilogue that reads ``dw``.

    Args:
        dw (torch.Tensor): ``(V, H)`` bf16, contiguous.
        dl (torch.Tensor): ``(rows, V)`` bf16 with 16-byte aligned rows.
        h_c (torch.Tensor): ``(rows, H)`` bf16, contiguous.
        first (bool): overwrite ``dw`` instead of adding to it.

    Example:
        >>> dw_accumulate(dw, dl, h_c, first=False)  # doctest: +SKIP
    """
    from logitless.ops import _quack_epilogues

    _quack_epilogues.dw_accumulate(dw, dl, h_c, first)
