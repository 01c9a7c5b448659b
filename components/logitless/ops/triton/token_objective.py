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
compacted away first; row chunks of full-V logits fit ``head.WORKSPACE_BYTES``. Each chunk calls
the objective; on CUDA its full chunks run a compiled ``torch.func.grad_and_value`` of it, replayed
from a CUDA graph (:class:`ChunkUpstreams`), so the one pass runs where cross-entropy's does
(``head.one_pass_pins``: a frozen head at any chunk count; with dW up to ``head.FUSED_MAX_CHUNKS``
chunks, or up to ``head.PINNED_MAX_CHUNKS`` with pinned label columns, ``head.PinnedColumns``,
which keep dW as accurate as two passes). Where the calls run eagerly (CPU, the knobs off, an
objective that could not be captured before) it stops at ``head.FUSED_MAX_CHUNKS``, since each
eager call costs ~1.5 ms of host time. Past that it falls back to the slab forward + slab
backward (4 GEMMs, dW rounded once per row block of thousands of rows); without gradients only
the forward-only slab pass runs (1 GEMM).

``token_objective`` is a Python callable, so this is a plain ``torch.autograd.Function``, not a
``torch.library`` custom op (whose schema cannot carry a callable): ``torch.compile`` graph-breaks
around it.
"""

import functools
from typing import Callable, Optional, Tuple

import torch

from logitless.settings import settings
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


#: Compute each full chunk's objective gradient with a compiled ``torch.func.grad_and_value``.
OBJECTIVE_COMPILE = settings.triton_objective_compile
#: Replay the one pass's per-chunk objective call from a CUDA graph (``ChunkUpstreams``).
OBJECTIVE_GRAPH = settings.triton_objective_graph
#: Code objects of objectives that failed to compile: they run eagerly from then on.
_UNCOMPILABLE = set()
#: Code objects of objectives that failed to be captured: their calls keep the eager chunk rule.
_UNCAPTURABLE = set()


def _upstreams_of(token_objective: TokenObjective, logp: torch.Tensor, ent: Optional[torch.Tensor],
                  rows: torch.Tensor, argnums: Tuple[int, ...]):
    """``(value, a, b)`` of the objective on ``rows`` by ``torch.func`` (traceable by torch.compile)."""
    lp = logp[rows]
    en = ent[rows] if ent is not None else None
    grads, value = torch.func.grad_and_value(lambda x, y: token_objective(x, y, rows), argnums=argnums)(lp, en)
    return value.float(), grads[0].float(), (grads[1].float() if len(argnums) > 1 else None)


@functools.cache
def _compiled():
    """``torch.compile(_upstreams_of)``, made on first use (importing dynamo costs start-up time)."""
    return torch.compile(_upstreams_of)


class ChunkUpstreams:
    """The objective's value and per-row upstreams ``(a, b)`` of each chunk of the one pass.

    Each chunk calls the Python objective and its autograd: about fifty small kernels whose launch
    and Python time (~1.5 ms a chunk) exceed a chunk's GEMMs at small H (0.5B head: 1.2 ms), and
    whose GPU time adds ~0.1 ms a chunk. On CUDA:

    * the first full chunk runs eagerly (autograd): it checks the objective and shows which of
      ``a``, ``b`` it has (an unused entropy gets no ``b``);
    * with ``OBJECTIVE_COMPILE``, later full chunks run ``torch.compile(torch.func.grad_and_value)``
      of the objective (a few fused kernels; compiled once per process, then dynamic shapes);
    * with ``OBJECTIVE_GRAPH``, that call (compiled or not) is captured into a CUDA graph on a side
      stream (no device sync) reading its rows from a static index, after one uncaptured run; every
      later full chunk copies its rows in and replays it.

    A shorter chunk (the last) runs eagerly. An objective that fails to compile or to be captured (a
    host sync, CPU tensors) falls back to the eager call. The graph and its memory pool live as long
    as this object: one ``linear_token_objective`` call.

    Args:
        token_objective (Callable): see :func:`token_objective_fused`.
        logp, ent (torch.Tensor): fp32 ``(N,)`` row outputs the chunks' statistics fill.
        need_entropy (bool): pass the entropy to the objective.
        chunk_rows (int): rows of a full chunk.

    Example:
        >>> upstreams = ChunkUpstreams(objective, logp, ent, True, 768)
        >>> value, a, b = upstreams(rows)  # after the chunk's statistics are in logp / ent
    """

    def __init__(self, token_objective: TokenObjective, logp: torch.Tensor, ent: torch.Tensor,
                 need_entropy: bool, chunk_rows: int):
        self.objective, self.logp = token_objective, logp
        self.ent = ent if need_entropy else None
        self.chunk_rows = chunk_rows
        self.code = getattr(token_objective, "__code__", None)
        self.compile = (OBJECTIVE_COMPILE and logp.is_cuda and self.code is not None
                        and self.code not in _UNCOMPILABLE)
        self.graph_on = OBJECTIVE_GRAPH and logp.is_cuda
        self.argnums = None  # (0,) or (0, 1): which upstreams the objective has; None until seen
        self.calls = 0
        self.graph = self.rows = self.out = None

    @staticmethod
    def replayable(token_objective: TokenObjective, hidden: torch.Tensor) -> bool:
        """Whether a call's full chunks will be replayed from a CUDA graph (as far as known before it).

        Args:
            token_objective (Callable): the call's objective.
            hidden (torch.Tensor): any tensor of the call (its device decides).

        Returns:
            bool: the graph knob is on, the call is on CUDA and this objective's capture never failed.
        """
        return (OBJECTIVE_GRAPH and hidden.is_cuda
                and getattr(token_objective, "__code__", None) not in _UNCAPTURABLE)

    def eager(self, rows: torch.Tensor):
        """The objective and its autograd on ``rows``: ``(value, a, b)``."""
        return _coefficients(self.objective, self.logp[rows], self.ent[rows] if self.ent is not None else None,
                             rows, True)

    def _call(self, rows: torch.Tensor, capturing: bool = False):
        if self.compile:
            try:
                return _compiled()(self.objective, self.logp, self.ent, rows, self.argnums)
            except Exception:  # noqa: BLE001 -- an objective torch.compile cannot take runs eagerly
                if capturing:  # compiled by the uncaptured run before: the capture failed
                    raise
                self.compile = False
                _UNCOMPILABLE.add(self.code)
        return self.eager(rows)

    def __call__(self, rows: torch.Tensor):
        if self.argnums is None or rows.numel() != self.chunk_rows:
            out = self.eager(rows)
            if self.argnums is None and rows.numel() == self.chunk_rows:
                if out[1] is None:  # no gradient at all: nothing to compile or replay
                    self.compile = self.graph_on = False
                self.argnums = (0, 1) if out[2] is not None else (0,)
            return out
        self.calls += 1
        if not self.graph_on or self.calls == 1:  # the first run compiles / initialises lazily
            return self._call(rows)
        if self.graph is None and not self._capture(rows):
            self.graph_on = False
            if self.code is not None:
                _UNCAPTURABLE.add(self.code)
            return self._call(rows)
        self.rows.copy_(rows)
        self.graph.replay()
        return self.out

    def _capture(self, rows: torch.Tensor) -> bool:
        self.rows = rows.clone()
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device=rows.device)
        side.wait_stream(torch.cuda.current_stream(rows.device))
        try:
            with torch.cuda.stream(side):
                # thread_local: other threads (NCCL's watchdog, data loading) keep their CUDA calls
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = self._call(self.rows, capturing=True)
                finally:
                    graph.capture_end()
        except Exception:  # noqa: BLE001 -- any failure of the capture means: no graph
            return False
        torch.cuda.current_stream(rows.device).wait_stream(side)
        self.graph, self.out = graph, out
        return True


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
    if ChunkUpstreams.replayable(token_objective, hidden):
        # Cross-entropy's chunk rule: pinned label columns keep dW as accurate as the two passes
        # up to PINNED_MAX_CHUNKS chunks; a frozen head (no dW) takes one pass at any count.
        pin = head.one_pass_pins(rows, n_c, cached, vocab, need_dw, hidden.element_size())
    else:
        # Each chunk's objective call runs eagerly: ~1.5 ms of host time a chunk, more than a
        # chunk's GEMMs at small H (0.5B head, 20 chunks: 8.1 GEMMs against 4.1 for two passes).
        chunks = head.one_pass_chunks(rows, n_c, cached)
        pin = head.pinned_columns(rows, vocab, chunks, hidden.element_size()) if need_dw and not cached else 0
        pin = pin if chunks <= head.FUSED_MAX_CHUNKS else -1
    if not need_grad or pin < 0:
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
    upstreams = ChunkUpstreams(token_objective, logp, ent, need_entropy, ch.n_c)
    for i, (h_c, idx_c, start, logits) in enumerate(ch):
        head._stats(ch, logits, idx_c, start, labels, logp, ent, lse, inv_t, ignore_index)
        r = idx_c if idx_c is not None else torch.arange(start, start + logits.shape[0], device=hidden.device)
        value, a, b = upstreams(r)
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
