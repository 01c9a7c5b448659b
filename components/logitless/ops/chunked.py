"""Chunked PyTorch head ops: bounded memory in forward AND backward, no custom kernels.

The ``(N, V)`` logits never exist at once: rows are processed ``chunk_size`` at a time, each chunk's
logits taken to float32 before its softmax (straight from the GEMM on the CPU; on CUDA kept in the
inputs' half dtype, as plain PyTorch's, and upcast inside the compiled epilogues). Two backward
regimes:

* scalar upstream (cross-entropy with ``reduction="mean"|"sum"``): the gradients ``dh`` and ``dW`` are
  computed during the forward, chunk by chunk, and only scaled by the upstream scalar in backward.
  Three GEMMs per chunk in all, nothing recomputed, nothing of size ``N x V`` kept.
* arbitrary per-token upstream (log-probs and entropy, ``reduction="none"``): the forward keeps only
  the per-row log-sum-exp and entropy (``O(N)``); backward recomputes each chunk's logits.

Saved for backward in either regime: ``hidden``, ``weight`` (which autograd holds anyway) and
``O(N)`` floats, or the gradients themselves -- never ``O(N x V)``.
"""

from typing import Optional, Tuple

import torch

from logitless.ops import _validate
from logitless.ops._chunk_epilogues import epilogues_for
from logitless.ops._rows import has_ignored_rows, zero_ignored_rows

# Bytes of chunk temporaries we allow: about three (rows x V) float32 buffers live at once in the
# eager epilogues; the compiled ones keep only the half logits and the gradient operand.
DEFAULT_CHUNK_BUDGET_BYTES = 1 << 30
_BUFFERS_PER_ROW = 3


def auto_chunk_size(num_rows: int, vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES,
                    bytes_per_logit: int = 4 * _BUFFERS_PER_ROW) -> int:
    """Rows per chunk such that the chunk's temporaries stay within ``budget_bytes``.

    Args:
        num_rows (int): N, the number of tokens.
        vocab_size (int): V.
        budget_bytes (int): memory allowed for the chunk temporaries.
        bytes_per_logit (int): bytes of temporaries per logit of a chunk (three float32 buffers by
            default).

    Returns:
        int: rows per chunk, in ``[1, max(num_rows, 1)]``, a multiple of 64 when above 64.

    Example:
        >>> auto_chunk_size(8192, 152064)
        576
    """
    rows = max(1, budget_bytes // (vocab_size * bytes_per_logit))
    if rows > 64:
        rows -= rows % 64  # GEMM-friendly tiles
    return max(1, min(rows, num_rows))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: Optional[int]) -> int:
    # The compiled epilogues (CUDA) hold no rows x V temporary but the logits and the gradient
    # operand, both in the input dtype: three times the rows of the eager ones in the same budget,
    # so the weight is streamed a third as often.
    if chunk_size:
        return chunk_size
    acc_bytes = 8 if hidden.dtype == torch.float64 else 4
    per_logit = acc_bytes * _BUFFERS_PER_ROW if epilogues_for(hidden).in_place else 2 * hidden.element_size()
    return auto_chunk_size(hidden.shape[0], weight.shape[0], bytes_per_logit=per_logit)


def _mm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` returned in the accumulator dtype, rounded once (not per chunk to bf16)."""
    if a.dtype == acc and b.dtype == acc:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype:
        try:  # half inputs, fp32 output straight from the tensor cores (torch >= 2.9, CUDA)
            return torch.mm(a, b, out_dtype=acc)
        except (RuntimeError, TypeError):
            pass
    return a.to(acc) @ b.to(acc)


def _addmm_acc_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` in the accumulator dtype; one GEMM with beta=1 on CUDA, so the
    fp32 ``(V, H)`` accumulator is not re-read by a separate add for every chunk."""
    if a.is_cuda and a.dtype != out.dtype and a.dtype == b.dtype:
        try:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            return
        except (RuntimeError, TypeError):
            pass
    out.add_(_mm_acc(a, b, out.dtype))


def _gemm_dtype(grad: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    # dlogits as the GEMM operand: the input dtype on CUDA (tensor cores, as autograd does), kept in
    # the accumulator dtype elsewhere, where a half-precision GEMM is no faster.
    return dtype if grad.is_cuda else grad.dtype


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, acc: torch.dtype, in_place: bool) -> torch.Tensor:
    """A chunk's raw logits as its epilogues take them (the temperature divides them there).

    For the in-place epilogues straight into the accumulator dtype (one pass fewer than half logits +
    upcast, and more accurate than plain PyTorch); for the compiled ones in the input dtype, as
    plain PyTorch and torchtune hold them: half the bytes written and read again per logit.
    """
    return _mm_acc(h, weight.T, acc) if in_place else h @ weight.T


class _LinearCrossEntropyGradInForward(torch.autograd.Function):
    """Summed (optionally scaled) cross-entropy whose gradients are computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, temperature, mean, chunk_size, n_valid=None):
        n, _ = hidden.shape
        acc = _acc_dtype(hidden.dtype)
        valid_all = labels != ignore_index
        mask = has_ignored_rows(valid_all, n_valid)
        # "mean" divides by the non-ignored count (clamped so an all-ignored batch gives 0, not NaN).
        count = valid_all.sum().clamp(min=1).to(acc) if mean else torch.ones((), dtype=acc, device=hidden.device)
        scale = 1.0 / count
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # dh and dW stay in the accumulator dtype until the upstream scalar is applied in backward,
        # so they are rounded to the input dtype once, as plain autograd rounds them.
        dh = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
        total = torch.zeros((), dtype=acc, device=hidden.device)
        ep = epilogues_for(hidden)
        for start in range(0, n, chunk_size):
            y, valid = labels[start : start + chunk_size], valid_all[start : start + chunk_size]
            h = zero_ignored_rows(hidden[start : start + chunk_size], valid, mask)
            safe = torch.where(valid, y, 0).long().unsqueeze(1)
            z = _chunk_logits(h, weight, acc, ep.in_place)
            if not (need_dh or need_dw):
                total = total - ep.stats(z, safe, valid, False, temperature=temperature)[0].sum()
                continue
            loss, grad = ep.ce(z, safe, valid, scale / temperature, _gemm_dtype(z, hidden.dtype),
                               temperature=temperature)
            total = total + loss
            if need_dh:
                dh[start : start + chunk_size] = _mm_acc(grad, weight, acc)
            if need_dw:
                _addmm_acc_(dw, grad.T, h)
        ctx.save_for_backward(dh, dw)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        return total / count  # as plain PyTorch's mean rounds it (not total * (1 / count))

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw = ctx.saved_tensors
        grad_hidden = (dh * grad_out.to(dh.dtype)).to(ctx.hidden_dtype) if dh is not None else None
        grad_weight = (dw * grad_out.to(dw.dtype)).to(ctx.weight_dtype) if dw is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


class _LinearLogProbs(torch.autograd.Function):
    """Per-token log-probs and entropy; recomputes each chunk's logits in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, temperature, return_entropy, chunk_size,
                n_valid=None):
        n, _ = hidden.shape
        acc = _acc_dtype(hidden.dtype)
        valid = labels != ignore_index
        mask = has_ignored_rows(valid, n_valid)
        logp = torch.zeros(n, dtype=acc, device=hidden.device)
        # Per-row max and log-sum of the softmax: backward recomputes log p exactly as here.
        m_all = torch.zeros(n, dtype=acc, device=hidden.device)
        log_s_all = torch.zeros(n, dtype=acc, device=hidden.device)
        ent = torch.zeros(n, dtype=acc, device=hidden.device) if return_entropy else None
        ep = epilogues_for(hidden)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            y, v = labels[start:stop], valid[start:stop]
            safe = torch.where(v, y, 0).long().unsqueeze(1)
            z = _chunk_logits(zero_ignored_rows(hidden[start:stop], v, mask), weight, acc, ep.in_place)
            lp, en, m_all[start:stop], log_s_all[start:stop] = ep.stats(z, safe, v, return_entropy,
                                                                        temperature=temperature)
            logp[start:stop] = lp
            if return_entropy:
                ent[start:stop] = en
        ctx.save_for_backward(hidden, weight, labels, m_all, log_s_all, ent)
        ctx.ignore_index, ctx.temperature, ctx.chunk_size, ctx.mask = ignore_index, temperature, chunk_size, mask
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, labels, m_all, log_s_all, ent = ctx.saved_tensors
        none = (None,) * 8
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw) or (grad_logp is None and grad_ent is None):
            return none
        n, _ = hidden.shape
        acc, t, rows = m_all.dtype, ctx.temperature, ctx.chunk_size
        valid = labels != ctx.ignore_index
        dh = torch.empty_like(hidden) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
        ep = epilogues_for(hidden)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            v = valid[start:stop]
            safe = torch.where(v, labels[start:stop], 0).long().unsqueeze(1)
            h = zero_ignored_rows(hidden[start:stop], v, ctx.mask)
            z = _chunk_logits(h, weight, acc, ep.in_place)
            g_lp = None if grad_logp is None else grad_logp[start:stop]
            g_ent = None if grad_ent is None or ent is None else grad_ent[start:stop]
            ent_c = None if g_ent is None else ent[start:stop]
            grad = ep.grad(z, m_all[start:stop], log_s_all[start:stop], ent_c, g_lp, g_ent, safe, v, 1.0 / t,
                           _gemm_dtype(z, hidden.dtype), temperature=t)
            if need_dh:
                dh[start:stop] = _mm_acc(grad, weight, acc).to(hidden.dtype)
            if need_dw:
                _addmm_acc_(dw, grad.T, h)
        return (dh, (dw.to(weight.dtype) if dw is not None else None)) + none[2:]


def _check_entry(weight: torch.Tensor, temperature: float) -> None:
    # The module's public entries are callable directly: the sync-free checks that keep bad sizes
    # and temperatures from the chunking (dispatch has already run them, and the label scan).
    _validate.check_head_dims(weight)
    _validate.check_temperature(temperature)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    return_entropy: bool = True,
    chunk_size: Optional[int] = None,
    n_valid: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunked per-token log-probs (and entropy) of ``labels``; 2-D ``hidden`` and 1-D ``labels``.

    Args:
        hidden (torch.Tensor): ``(N, H)``.
        weight (torch.Tensor): ``(V, H)``.
        labels (torch.Tensor): ``(N,)``.
        ignore_index (int): label whose positions get 0 and no gradient.
        temperature (float): divides the logits before the softmax.
        return_entropy (bool): also compute the entropy.
        chunk_size (Optional[int]): rows per chunk; ``None`` picks :func:`auto_chunk_size`.
        n_valid (Optional[int]): the number of non-ignored labels when the caller has counted them
            (see :func:`has_ignored_rows`).

    Returns:
        Tuple[torch.Tensor, Optional[torch.Tensor]]: ``(N,)`` float32 log-probs and entropy
        (float64 for float64 inputs); differentiable for any upstream gradient of both.

    Example:
        >>> logp, ent = linear_log_probs(torch.randn(5, 8), torch.randn(11, 8), torch.arange(5))
    """
    _check_entry(weight, temperature)
    rows = _rows_per_chunk(hidden, weight, chunk_size)
    return _LinearLogProbs.apply(hidden, weight, labels, ignore_index, temperature, return_entropy, rows,
                                 n_valid)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    n_valid: Optional[int] = None,
) -> torch.Tensor:
    """Chunked cross-entropy; 2-D ``hidden`` and 1-D ``labels``.

    ``"mean"``/``"sum"`` compute the gradients in the forward (scalar upstream); ``"none"`` goes through
    :func:`linear_log_probs` and recomputes in backward, since a per-token upstream gradient cannot be
    applied to gradients already summed over tokens.

    Args:
        hidden (torch.Tensor): ``(N, H)``.
        weight (torch.Tensor): ``(V, H)``.
        labels (torch.Tensor): ``(N,)``.
        ignore_index (int): label that contributes no loss.
        reduction (str): ``"mean"`` (over non-ignored tokens; 0.0 when none), ``"sum"`` or ``"none"``.
        temperature (float): divides the logits before the softmax.
        chunk_size (Optional[int]): rows per chunk; ``None`` picks :func:`auto_chunk_size`.
        n_valid (Optional[int]): the number of non-ignored labels when the caller has counted them.

    Returns:
        torch.Tensor: float32 scalar, or ``(N,)`` per-token losses for ``"none"``.

    Example:
        >>> loss = linear_cross_entropy(torch.randn(5, 8), torch.randn(11, 8), torch.arange(5))
    """
    _check_entry(weight, temperature)
    rows = _rows_per_chunk(hidden, weight, chunk_size)
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if reduction == "none" or not needs_grad:
        logp, _ = _LinearLogProbs.apply(hidden, weight, labels, ignore_index, temperature, False, rows, n_valid)
        loss = -logp
        if reduction == "none":
            return loss
        total = loss.sum()
        if reduction == "sum":
            return total
        return total / (labels != ignore_index).sum().clamp(min=1)
    return _LinearCrossEntropyGradInForward.apply(
        hidden, weight, labels, ignore_index, temperature, reduction == "mean", rows, n_valid
    )


class _LinearTokenObjective(torch.autograd.Function):
    """A sum of per-token terms of (log-prob, entropy), with its gradients computed in the forward.

    When every token's term depends only on that token's log-prob and entropy (and on constants known
    before the forward: old/reference log-probs, advantages, normalisers), its gradient w.r.t. the
    logits is known as soon as a chunk's logits are: the policy loss of GRPO costs three GEMMs
    (logits, dh, dW) like cross-entropy, instead of forward + recompute.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, temperature, token_objective, need_entropy, chunk_size):
        n, _ = hidden.shape
        acc = _acc_dtype(hidden.dtype)
        valid_all = labels != ignore_index
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_dh else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
        # The objective sees fp32 log-probs (float64 for float64 inputs, as linear_log_probs returns).
        total = torch.zeros((), dtype=acc, device=hidden.device)
        logp_all = torch.zeros(n, dtype=acc, device=hidden.device)
        ent_all = torch.zeros(n, dtype=acc, device=hidden.device) if need_entropy else None
        # The objective sees non-ignored rows only, named by their row index (as in the Triton head,
        # which compacts ignored rows away); the chunk bounds in that index list cost one host sync.
        idx_all = torch.nonzero(valid_all).squeeze(1)
        starts = torch.arange(0, n + chunk_size, chunk_size, device=hidden.device)
        bounds = torch.searchsorted(idx_all, starts).tolist()
        mask = bounds[-1] != n  # some row is ignored: zero those rows before the GEMMs
        ep = epilogues_for(hidden)
        for ci, start in enumerate(range(0, n, chunk_size)):
            stop = min(start + chunk_size, n)
            rows = idx_all[bounds[ci] : bounds[ci + 1]]
            v = valid_all[start:stop]
            h = zero_ignored_rows(hidden[start:stop], v, mask)
            safe = torch.where(v, labels[start:stop], 0).long().unsqueeze(1)
            z = _chunk_logits(h, weight, acc, ep.in_place)
            logp_acc, ent_acc, m, log_s = ep.stats(z, safe, v, need_entropy, temperature=temperature)
            if ep.in_place:  # z holds log q now
                m = log_s = None
            logp = logp_acc.to(acc)
            ent = ent_acc.to(acc) if need_entropy else None
            local = rows - start
            with torch.enable_grad():
                lp_leaf = logp[local].requires_grad_()
                ent_leaf = ent[local].requires_grad_() if need_entropy else None
                value = token_objective(lp_leaf, ent_leaf, rows)
                leaves = [lp_leaf] + ([ent_leaf] if need_entropy else [])
                grads = torch.autograd.grad(value, leaves, allow_unused=True) if value.requires_grad else [None] * len(leaves)
            # Back onto the chunk's rows (ignored rows get no gradient).
            grads = [None if g is None else torch.zeros_like(logp).index_copy_(0, local, g.to(acc)) for g in grads]
            total = total + value.detach().to(acc)
            logp_all[start:stop] = logp
            if need_entropy:
                ent_all[start:stop] = ent
            if not (need_dh or need_dw):
                continue
            a = grads[0] if grads[0] is not None else torch.zeros_like(logp)
            b = grads[1] if need_entropy and grads[1] is not None else None
            grad = ep.grad(z, m, log_s, ent_acc if b is not None else None, a, b, safe, v, 1.0 / temperature,
                           _gemm_dtype(z, hidden.dtype), temperature=temperature)
            if need_dh:
                dh[start:stop] = _mm_acc(grad, weight, acc)
            if need_dw:
                _addmm_acc_(dw, grad.T, h)
        ctx.save_for_backward(dh, dw)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        ctx.mark_non_differentiable(logp_all, *( [ent_all] if ent_all is not None else []))
        return total, logp_all, ent_all

    @staticmethod
    def backward(ctx, grad_total, _grad_logp, _grad_ent):
        dh, dw = ctx.saved_tensors
        grad_hidden = (dh * grad_total.to(dh.dtype)).to(ctx.hidden_dtype) if dh is not None else None
        grad_weight = (dw * grad_total.to(dw.dtype)).to(ctx.weight_dtype) if dw is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


def linear_token_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_objective,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    need_entropy: bool = False,
    chunk_size: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``sum_t token_objective(logp_t, H_t)`` with gradients computed in the forward (three GEMMs).

    Args:
        hidden (torch.Tensor): ``(N, H)``.
        weight (torch.Tensor): ``(V, H)``.
        labels (torch.Tensor): ``(N,)``; ignored positions get ``logp = H = 0`` and no gradient.
        token_objective (Callable): ``f(logp, ent, rows) -> scalar``: the summed objective of the
            rows ``rows`` (a 1-D int64 tensor of indices into the ``N`` rows: non-ignored rows
            only, each passed exactly once over all calls) given their fp32 (float64 for float64
            inputs) log-probs and entropies of shape ``(len(rows),)`` (``ent`` is None unless
            ``need_entropy``). It must
            be a sum of per-token terms, in differentiable torch code; per-row constants
            (advantages, old/reference log-probs, weights) are gathered by it as ``const[rows]``.
        ignore_index (int): label of rows without a term.
        temperature (float): divides the logits.
        need_entropy (bool): compute the entropy and pass it to ``token_objective``.
        chunk_size (Optional[int]): rows per chunk.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]: the fp32 scalar objective
        (differentiable w.r.t. ``hidden`` and ``weight`` for a scalar upstream), and the detached fp32
        ``(N,)`` log-probs and entropies (for metrics); float64 for float64 inputs.

    Example:
        >>> adv = torch.randn(5)
        >>> obj = lambda lp, ent, rows: -(adv[rows] * lp).sum()
        >>> loss, logp, _ = linear_token_objective(torch.randn(5, 8, requires_grad=True), torch.randn(11, 8), torch.arange(5), obj)
        >>> loss.backward()
    """
    _check_entry(weight, temperature)
    rows = _rows_per_chunk(hidden, weight, chunk_size)
    return _LinearTokenObjective.apply(
        hidden, weight, labels, ignore_index, temperature, token_objective, need_entropy, rows
    )
