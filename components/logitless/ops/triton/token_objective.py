"""A sum of per-token terms of (log-prob, entropy) on the fused head, gradients in the forward.

When every token's term depends only on that token's log-prob and entropy and on constants known
before the forward (the GRPO policy loss: old/reference log-probs, advantages, normalisers), the
gradient w.r.t. a chunk's logits is known as soon as its statistics are::

    a, b = d obj / d logp, d obj / d ent            (autograd on the chunk's small fp32 tensors)
    dz   = a * onehot(y) - p * (a + b * (log p + H))   (``dlogits_kernel``, in place, / T)

so one pass per row chunk does logits GEMM -> ``row_stats``/``finalize`` -> ``token_objective`` on
the chunk's rows -> ``dlogits`` -> dh and dW GEMMs: three GEMMs, like cross-entropy, instead of a
forward plus a recomputing backward (four). Backward only scales dh and dW by the upstream scalar.

Paths and workspace are those of :func:`logitless.ops.triton.head.ce_fused`: ignored rows are
compacted away first; row chunks of full-V logits fit ``head.WORKSPACE_BYTES``; when the valid
rows need more than ``head.FUSED_MAX_CHUNKS`` chunks (dW would be rounded to the
input dtype once per chunk; and each chunk calls the Python objective; pinned label columns,
``head.PinnedColumns``, make the chunks it does take as accurate as two passes), it falls back to the slab
forward + slab backward (4 GEMMs, dW rounded once per row block of thousands of rows); without
gradients only the forward-only slab pass runs (1 GEMM).

``token_objective`` is a Python callable, so this is a plain ``torch.autograd.Function``, not a
``torch.library`` custom op (whose schema cannot carry a callable): ``torch.compile`` graph-breaks
around it.
"""

from typing import Callable, Optional, Tuple

import torch

from logitless.ops.triton import head

TokenObjective = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]


def _coefficients(token_objective: TokenObjective, logp: torch.Tensor, ent: Optional[torch.Tensor],
                  rows: torch.Tensor, need_grad: bool):
    """Calls the objective on some rows; returns ``(value, a, b)`` (``a``/``b`` None if unused)."""
    lp = logp.detach().requires_grad_(need_grad)
    en = ent.detach().requires_grad_(need_grad) if ent is not None else None
    with torch.set_grad_enabled(need_grad):
        value = token_objective(lp, en, rows)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise ValueError(
            f"token_objective must return a scalar tensor (the summed objective of its rows), got "
            f"{type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}"
        )
    if not (need_grad and value.requires_grad):
        return value.detach().float(), None, None
    leaves = [lp] + ([en] if en is not None else [])
    grads = torch.autograd.grad(value, leaves, allow_unused=True)
    a = grads[0].float() if grads[0] is not None else None
    b = grads[1].float() if len(grads) > 1 and grads[1] is not None else None
    return value.detach().float(), a, b


def token_objective_fused(hidden, weight, labels, token_objective: TokenObjective, ignore_index: int,
                          temperature: float, need_entropy: bool, need_dh: bool, need_dw: bool,
                          n_valid: int = -1):
    """The objective, per-token log-probs / entropy, and the objective's gradients (upstream 1).

    Args:
        hidden, weight, labels, ignore_index, temperature: as in :func:`head.head_forward`
            (contiguous ``(N, H)``, ``(V, H)``, int64 ``(N,)``).
        token_objective (Callable): ``f(logp, ent, rows) -> scalar``, see
            :func:`linear_token_objective`.
        need_entropy (bool): pass the entropy to the objective (and return it).
        need_dh, need_dw (bool): which gradients to compute.
        n_valid (int): non-ignored labels as counted by the caller (-1: count here, a sync).

    Returns:
        Tuple: fp32 scalar objective, fp32 ``(N,)`` logp and ent (0 at ignored rows), ``dh``,
        ``dw`` in the inputs' dtype (empty ``(0,)`` tensors for the ones not needed).
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    need_grad = need_dh or need_dw
    idx = head.valid_rows(labels, ignore_index, n_valid)
    if need_grad:
        hidden = head.rows_for_gradients(hidden, labels, ignore_index, idx, n_valid)
    rows = n if idx is None else idx.numel()
    total = hidden.new_zeros((), dtype=torch.float32)
    n_c = head.one_pass_rows(rows, hidden, weight, head.WORKSPACE_BYTES)
    cached = head.cached_block_rows(rows, n_c, weight.shape[1], need_dw) if need_grad else 0
    # Unlike cross-entropy, a frozen head (no dW) does not switch this to one pass at any chunk
    # count: each chunk calls the Python objective, which made the one pass host-bound at many
    # small chunks (0.5B head, 22 chunks: 6.8 GEMMs against 5.2 for two passes, with dW; H100).
    chunks = head.one_pass_chunks(rows, n_c, cached)
    # Pinned label columns make the one pass as accurate as the two; they do not lengthen it here.
    pin = head.pinned_columns(rows, vocab, chunks, hidden.element_size()) \
        if need_dw and not cached else 0
    if not need_grad or chunks > head.FUSED_MAX_CHUNKS:
        # Forward-only tiles, the objective on every valid row at once, then (with gradients) the
        # recompute backward with per-row upstreams a, b: bounded memory, dW rounded rarely.
        logp, ent, lse = head._forward(hidden, weight, labels, idx, ignore_index, inv_t, need_grad)
        all_rows = torch.arange(n, device=hidden.device) if idx is None else idx
        value, a, b = _coefficients(token_objective, logp[all_rows],
                                    ent[all_rows] if need_entropy else None, all_rows, need_grad)
        dh, dw = head._grad_buffer(hidden, False, False), head._grad_buffer(weight, False, False)
        if need_grad:
            glp = _scatter(a, all_rows, n, hidden.device)
            gent = _scatter(b, all_rows, n, hidden.device) if b is not None else None
            dh, dw = head._slab_backward(hidden, weight, labels, idx, lse, ent if gent is not None else None,
                                         glp, gent, None, inv_t, ignore_index, need_dh, need_dw)
        return value, logp, ent, dh, dw
    logp, ent, lse = head.row_outputs(hidden, n)
    # Per-row upstreams indexed by original row (what dlogits_kernel reads at each chunk row).
    glp = hidden.new_zeros((n,), dtype=torch.float32)
    gent = hidden.new_zeros((n,), dtype=torch.float32) if need_entropy else None
    dh = head._grad_buffer(hidden, need_dh, zero=idx is not None)
    dw = head._grad_buffer(weight, need_dw, zero=rows == 0)
    if cached:  # the first block's logits kept in dW's buffer (head.cached_block_rows)

        def block_upstream(logp_b, ent_b, r):
            value, a, b = _coefficients(token_objective, logp_b, ent_b if need_entropy else None, r, True)
            total.add_(value)
            return None, a, b

        logp, ent, lse = head._cached_block(hidden, weight, labels, idx, cached, ignore_index, inv_t,
                                            dh if need_dh else None, dw, block_upstream)
    ch = head._Chunks(hidden, weight, idx, head.WORKSPACE_BYTES, first=cached, labels=labels, inv_t=inv_t,
                      entropy=need_entropy)
    pinned = head.PinnedColumns(labels, idx, ignore_index, pin, rows, vocab, hidden, ch.n_c) if pin > 0 else None
    for i, (h_c, idx_c, start, logits) in enumerate(ch):
        head._stats(ch, logits, idx_c, start, labels, logp, ent, lse, inv_t, ignore_index)
        r = idx_c if idx_c is not None else torch.arange(start, start + logits.shape[0], device=hidden.device)
        value, a, b = _coefficients(token_objective, logp[r], ent[r] if need_entropy else None, r, True)
        total += value
        if a is not None:
            glp[r] = a
        if b is not None:
            gent[r] = b
        head._dlogits(ch, logits, idx_c, start, labels, lse, ent if b is not None else None,
                      glp, gent if b is not None else None, None, inv_t, ignore_index)
        head._grads(ch, logits, h_c, idx_c, start, dh if need_dh else None, dw if need_dw else None,
                    i == 0 and not cached, pinned)
    if pinned is not None:
        ch = logits = h_c = None  # the logits workspace is free before the pinned rows' GEMM
        pinned.finish(dw, hidden, idx)
    return total, logp, ent, dh, dw


def _scatter(vals, rows, n, device):
    out = torch.zeros((n,), dtype=torch.float32, device=device)
    if vals is not None:
        out[rows] = vals
    return out


class _TritonTokenObjective(torch.autograd.Function):
    """Scalar objective with dh, dW computed in the forward; backward scales them in place."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_objective, ignore_index, temperature, need_entropy,
                n_valid):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        value, logp, ent, dh, dw = token_objective_fused(
            hidden, weight, labels, token_objective, ignore_index, temperature, need_entropy,
            need_dh, need_dw, n_valid,
        )
        ctx.save_for_backward(dh, dw)
        ctx.need, ctx.used = (need_dh, need_dw), False
        ent_out = ent if need_entropy else None
        ctx.mark_non_differentiable(logp, *([ent_out] if ent_out is not None else []))
        ctx.set_materialize_grads(False)
        return value, logp, ent_out

    @staticmethod
    def backward(ctx, g_value, _g_logp, _g_ent):
        if ctx.used:
            raise RuntimeError(
                "logitless triton linear_token_objective: backward ran twice through the same graph; "
                "its gradients are computed in the forward and scaled in place, so retain_graph=True "
                "is not supported (use linear_log_probs, which recomputes)"
            )
        ctx.used = True
        if g_value is None:
            return (None,) * 8
        dh, dw = ctx.saved_tensors
        g = g_value.detach()
        if ctx.need[0]:
            head.scale_(dh, g)
        if ctx.need[1]:
            head.scale_(dw, g)
        return (dh if ctx.need[0] else None), (dw if ctx.need[1] else None), *(None,) * 6


def linear_token_objective(hidden2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor,
                           token_objective: TokenObjective, *, ignore_index: int, temperature: float,
                           need_entropy: bool, n_valid: Optional[int] = None,
                           ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``sum over rows of token_objective`` on the fused head, with its gradients in the forward.

    Same contract as :func:`logitless.ops.chunked.linear_token_objective`. The objective is called
    once per row chunk on that chunk's non-ignored rows (or once on all of them in the forward-only
    and fallback paths): it must be a sum of per-token terms.

    Args:
        hidden2d (torch.Tensor): ``(N, H)`` bf16/fp16/fp32.
        weight (torch.Tensor): ``(V, H)``, same dtype and device.
        labels1d (torch.Tensor): ``(N,)`` int64 in ``[0, V)`` or ``ignore_index``.
        token_objective (Callable): ``f(logp, ent, rows) -> scalar`` where ``rows`` is a 1-D int64
            tensor of (non-ignored) row indices into the ``N`` rows, and ``logp``/``ent`` their fp32
            log-probs / entropies (``ent`` None unless ``need_entropy``); per-row constants are
            gathered by the callable as ``const[rows]``.
        ignore_index (int): rows with this label have no term (never passed to the objective).
        temperature (float): > 0, divides the logits.
        need_entropy (bool): compute the entropy and pass it to the objective.
        n_valid (Optional[int]): the number of non-ignored labels when the caller has read it
            (validation does); None: counted here (a second host sync).

    Returns:
        Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]: the fp32 scalar objective
        (differentiable w.r.t. ``hidden2d`` and ``weight`` for a scalar upstream, backward once),
        and the detached fp32 ``(N,)`` log-probs and entropies (0 at ignored rows).

    Example:
        >>> adv = torch.randn(64, device="cuda")
        >>> obj = lambda lp, ent, rows: -(adv[rows] * lp).sum()
        >>> loss, logp, _ = linear_token_objective(h, w, y, obj, ignore_index=-100, temperature=1.0,
        ...                                        need_entropy=False)
        >>> loss.backward()
    """
    from logitless.ops.triton.functional import _check, _prep

    _check(hidden2d, weight, labels1d, temperature)
    h, w, y = _prep(hidden2d, weight, labels1d)
    return _TritonTokenObjective.apply(h, w, y, token_objective, ignore_index, float(temperature),
                                       bool(need_entropy), -1 if n_valid is None else int(n_valid))
