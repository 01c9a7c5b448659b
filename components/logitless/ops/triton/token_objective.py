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
the objective; on CUDA a compiled ``torch.func.grad_and_value`` of it, the full chunks' call replayed
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

import collections
import functools
from typing import Callable, Optional, Tuple

import torch

from logitless.first_start import note_compile
from logitless.settings import settings
from logitless.ops.row_objective import RowObjective
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
#: ``(warm signature, with entropy)`` (:func:`_warm_signature`) of objectives whose compiled call has
#: run uncaptured in this process: a later call captures its first full chunk at once.
_WARM = set()


def _upstreams_of(token_objective: TokenObjective, logp: torch.Tensor, ent: Optional[torch.Tensor],
                  rows: torch.Tensor):
    """``(value, a, b)`` of the objective on ``rows`` by ``torch.func`` (traceable by torch.compile).

    ``b`` (the entropy's upstream) is None without ``ent``, zeros where the objective ignores it.
    """
    lp = logp[rows]
    en = ent[rows] if ent is not None else None
    argnums = (0,) if en is None else (0, 1)
    grads, value = torch.func.grad_and_value(lambda x, y: token_objective(x, y, rows), argnums=argnums)(lp, en)
    return value.float(), grads[0].float(), (grads[1].float() if en is not None else None)


@functools.cache
def _compiled():
    """``torch.compile(_upstreams_of)``, made on first use (importing dynamo costs start-up time)."""
    # dynamic from the start: one graph for full and shorter chunks, the same kernels for both
    note_compile("the token objective's gradient in the Triton head (then a CUDA graph per chunk length)")
    return torch.compile(_upstreams_of, dynamic=True)


@functools.cache
def _capture_resources(device: torch.device):
    """The side stream and the memory pool every capture on ``device`` uses.

    One pool for all calls: a capture reuses the blocks the previous call's graph freed instead
    of allocating new ones (a graph is never replayed after its ``linear_token_objective`` call;
    ``_LAST_GRAPH`` keeps the latest alive so that the pool, and its blocks, stay between calls).
    """
    return torch.cuda.Stream(device=device), torch.cuda.graph_pool_handle()


#: The latest captured graph per device (see ``_capture_resources``).
_LAST_GRAPH = {}


def _code_of(token_objective: TokenObjective):
    """The code object that names an objective in the compile / capture bookkeeping (None: unnamed)."""
    if isinstance(token_objective, RowObjective):
        return token_objective.signature[0]
    return getattr(token_objective, "__code__", None)


def _warm_signature(token_objective: TokenObjective):
    """What a compiled call of the objective is warm for: another value recompiles it.

    A compilation inside a CUDA-graph capture fails on cold compile caches, so a call whose
    objective is not warm runs its first chunk uncaptured. A :class:`RowObjective` names what its
    graph depends on (:attr:`RowObjective.signature`: a new ``key``, say another coefficient, is
    another one); for a closure, the Python scalars it closes over stand in for that key.
    """
    if isinstance(token_objective, RowObjective):
        return token_objective.signature
    scalars = []
    for cell in getattr(token_objective, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, (bool, int, float, str)):
            scalars.append(value)
    return _code_of(token_objective), tuple(scalars)


def _replayable(token_objective: TokenObjective, device: torch.device) -> bool:
    return OBJECTIVE_GRAPH and device.type == "cuda" and _code_of(token_objective) not in _UNCAPTURABLE


#: How many :class:`RowObjective` signatures keep their buffers and graphs (least recent dropped).
KEPT_SIGNATURES = 4
#: ``(signature, with entropy, device)`` -> :class:`KeptGraphs`, most recently used last.
_KEPT = collections.OrderedDict()


class KeptGraphs:
    """A :class:`RowObjective`'s static buffers and its per-chunk CUDA graphs, kept across calls.

    A graph reads and writes fixed addresses. Here they belong to this object, not to a call: each
    call copies its constants into ``constants``, runs its chunks on ``logp`` / ``ent`` / ``glp`` /
    ``gent`` / ``total`` (views of their first ``n`` rows) and returns copies of what it outputs,
    so one graph per chunk length, captured once, serves every later call of the same signature.
    Buffers hold ``capacity`` rows (a power of two): a call with more rows makes new ones. The
    graphs share one private memory pool; they never run concurrently (one stream, in call order),
    and their pool tensors are temporaries of a replay.

    Args:
        objective (RowObjective): gives ``fn``, ``key`` and the constants' names and dtypes.
        capacity (int): rows of every buffer.
        need_entropy (bool): the objective gets the entropy (``gent`` exists).
        device (torch.device): a CUDA device.
    """

    def __init__(self, objective: RowObjective, capacity: int, need_entropy: bool, device: torch.device):
        zeros = functools.partial(torch.zeros, dtype=torch.float32, device=device)
        self.capacity = capacity
        self.logp, self.ent, self.glp = zeros(capacity), zeros(capacity), zeros(capacity)
        self.gent = zeros(capacity) if need_entropy else None
        self.total = zeros(())
        self.constants = {name: torch.zeros(capacity, dtype=value.dtype, device=device)
                          for name, value in objective.constants.items()}
        self.objective = RowObjective(objective.fn, self.constants, objective.key)
        self.graphs = {}  # chunk rows -> (graph, static rows, has_b)
        self.pool = torch.cuda.graph_pool_handle()

    @staticmethod
    def for_call(token_objective: TokenObjective, n: int, need_entropy: bool,
                 device: torch.device) -> Optional["KeptGraphs"]:
        """The kept buffers of this call's objective, loaded with its constants and zeroed outputs.

        Args:
            token_objective (Callable): the call's objective.
            n (int): the call's rows.
            need_entropy (bool): as the call.
            device (torch.device): the call's device.

        Returns:
            Optional[KeptGraphs]: None unless a :class:`RowObjective` whose chunks can be replayed
            (:meth:`ChunkUpstreams.replayable`).
        """
        if not (isinstance(token_objective, RowObjective) and _replayable(token_objective, device)):
            return None
        signature = (token_objective.signature, need_entropy, device)
        kept = _KEPT.pop(signature, None)
        if kept is None or kept.capacity < n:
            kept = KeptGraphs(token_objective, 1 << max(n - 1, 0).bit_length(), need_entropy, device)
        _KEPT[signature] = kept
        while len(_KEPT) > KEPT_SIGNATURES:
            _KEPT.popitem(last=False)
        for name, value in token_objective.constants.items():
            kept.constants[name][:n].copy_(value)
        for buffer in (kept.logp, kept.ent, kept.glp, kept.gent, kept.total):
            if buffer is not None:
                buffer.zero_()
        return kept


class ChunkUpstreams:
    """Each chunk's objective: adds its value to ``total`` and writes its per-row upstreams
    ``a = d obj / d logp``, ``b = d obj / d ent`` into ``glp``, ``gent`` at the chunk's rows.

    An eager call of the Python objective and its autograd is about fifty small kernels whose launch
    and Python time (~1.5 ms) exceed a chunk's GEMMs at small H (0.5B head: 1.2 ms). On CUDA:

    * with ``OBJECTIVE_COMPILE``, every chunk runs ``torch.compile(torch.func.grad_and_value)`` of the
      objective (a few fused kernels; compiled once per process, then dynamic shapes). With the
      entropy it always returns ``b`` (zeros where the objective ignores the entropy: the dlogits
      pass then adds a zero term, which costs less than an eager call to find out);
    * with ``OBJECTIVE_GRAPH``, the full chunks' call (compiled or not), the scatter of ``a``, ``b``
      and the add to ``total`` are captured into one CUDA graph on a side stream (no device sync)
      reading the rows from a static index, after one uncaptured run (at the first full chunk where
      the compiled call already ran in this process for the same :func:`_warm_signature`; should
      that capture fail, after a run); every
      later full chunk copies its rows in and replays it: two host calls a chunk.

    Elsewhere (CPU, the knobs off) every chunk runs eagerly. An objective that fails to compile or to
    be captured (a host sync, CPU tensors) falls back to the eager call and is remembered. A plain
    callable's graph is replayed only within this object's ``linear_token_objective`` call (its
    memory pool is shared by every such call on the device, ``_capture_resources``); a
    :class:`RowObjective`'s lives in its :class:`KeptGraphs` and is replayed from the first full
    chunk of every later call of the same signature.

    Args:
        token_objective (Callable): see :func:`token_objective_fused`.
        logp, ent (torch.Tensor): fp32 ``(N,)`` row outputs the chunks' statistics fill (``ent``
            None: the objective gets no entropy).
        glp, gent (torch.Tensor): fp32 ``(N,)`` upstreams to fill (``gent`` None without ``ent``).
        total (torch.Tensor): fp32 scalar the chunks' values are added to.
        chunk_rows (int): rows of a full chunk.
        kept (Optional[KeptGraphs]): the objective's kept buffers, which then replace
            ``token_objective`` and the five tensors above (they are views of them).

    Example:
        >>> upstreams = ChunkUpstreams(objective, logp, ent, glp, gent, total, 768)
        >>> has_b = upstreams(rows)  # after the chunk's statistics are in logp / ent
    """

    def __init__(self, token_objective: TokenObjective, logp: torch.Tensor, ent: Optional[torch.Tensor],
                 glp: torch.Tensor, gent: Optional[torch.Tensor], total: torch.Tensor, chunk_rows: int,
                 kept: Optional[KeptGraphs] = None):
        if kept is not None:  # whole buffers: a graph bakes in the sizes it read
            token_objective, logp, glp, gent, total = kept.objective, kept.logp, kept.glp, kept.gent, kept.total
            ent = kept.ent if ent is not None else None
        self.objective, self.logp, self.ent = token_objective, logp, ent
        self.glp, self.gent, self.total = glp, gent, total
        self.chunk_rows, self.kept = chunk_rows, kept
        self.code = _code_of(token_objective)
        self.compile = (OBJECTIVE_COMPILE and logp.is_cuda and self.code is not None
                        and self.code not in _UNCOMPILABLE)
        self.graph_on = OBJECTIVE_GRAPH and logp.is_cuda
        self.warm_key = (_warm_signature(token_objective), ent is not None)
        self.ran = False  # a full chunk has run uncaptured in this call
        self.graph, self.rows, self.has_b = kept.graphs.get(chunk_rows, (None,) * 3) if kept else (None,) * 3

    @staticmethod
    def replayable(token_objective: TokenObjective, hidden: torch.Tensor) -> bool:
        """Whether a call's full chunks will be replayed from a CUDA graph (as far as known before it).

        Args:
            token_objective (Callable): the call's objective.
            hidden (torch.Tensor): any tensor of the call (its device decides).

        Returns:
            bool: the graph knob is on, the call is on CUDA and this objective's capture never failed.
        """
        return _replayable(token_objective, hidden.device)

    def _upstreams(self, rows: torch.Tensor, capturing: bool = False):
        """``(value, a, b)`` on ``rows``: compiled where possible, else eager autograd."""
        if self.compile:
            try:
                return _compiled()(self.objective, self.logp, self.ent, rows)
            except Exception:  # noqa: BLE001 -- an objective torch.compile cannot take runs eagerly
                if capturing:  # compiled by an uncaptured run before: the capture failed
                    raise
                self.compile = False
                _UNCOMPILABLE.add(self.code)
        return _coefficients(self.objective, self.logp[rows], self.ent[rows] if self.ent is not None else None,
                             rows, True)

    def _apply(self, rows: torch.Tensor, capturing: bool = False) -> bool:
        value, a, b = self._upstreams(rows, capturing)
        self.total.add_(value)
        if a is not None:
            self.glp.index_copy_(0, rows, a)
        if b is not None:
            self.gent.index_copy_(0, rows, b)
        return b is not None

    def __call__(self, rows: torch.Tensor) -> bool:
        """Adds the objective of ``rows`` to ``total``, fills their upstreams.

        Args:
            rows (torch.Tensor): int64 indices of the chunk's rows into the ``N`` rows.

        Returns:
            bool: whether ``gent`` was written (the objective has an entropy upstream).
        """
        if rows.numel() != self.chunk_rows or not self.graph_on:
            return self._apply(rows)
        if self.graph is None:
            # capture once warm: after this call's first run, or at once where the compiled call
            # already ran in this process (the first run compiles / initialises lazily)
            warm = self.ran or (self.compile and self.warm_key in _WARM)
            if not (warm and self._capture(rows)):
                return self._run_uncaptured(rows, capture_failed=warm)
        self.rows.copy_(rows)
        self.graph.replay()
        return self.has_b

    def _run_uncaptured(self, rows: torch.Tensor, capture_failed: bool) -> bool:
        # A capture that failed after a run of this call turns the graph off for good; one that
        # failed before (warm, but this closure may need a recompile) is retried after this run.
        if capture_failed and self.ran:
            self.graph_on = False
            if self.code is not None:
                _UNCAPTURABLE.add(self.code)
        self.ran = True
        has_b = self._apply(rows)
        if self.compile:
            _WARM.add(self.warm_key)
        return has_b

    def _capture(self, rows: torch.Tensor) -> bool:
        self.rows = rows.clone()
        graph, (side, pool) = torch.cuda.CUDAGraph(), _capture_resources(rows.device)
        pool = self.kept.pool if self.kept is not None else pool
        side.wait_stream(torch.cuda.current_stream(rows.device))
        try:
            with torch.cuda.stream(side):
                # thread_local: other threads (NCCL's watchdog, data loading) keep their CUDA calls
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    has_b = self._apply(self.rows, capturing=True)
                finally:
                    graph.capture_end()
        except Exception:  # noqa: BLE001 -- any failure of the capture means: no graph
            return False
        torch.cuda.current_stream(rows.device).wait_stream(side)
        self.graph, self.has_b = graph, has_b
        if self.kept is not None:
            self.kept.graphs[self.chunk_rows] = (graph, self.rows, has_b)
        else:
            _LAST_GRAPH[rows.device] = graph
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
    ch = chunks = None
    if not cached:
        ch, chunks = head.queued_chunks(hidden, weight, idx, labels, inv_t, need_entropy)
    kept = KeptGraphs.for_call(token_objective, n, need_entropy, hidden.device)
    # Row outputs, and the per-row upstreams indexed by original row (what dlogits_kernel reads at
    # each chunk row): new for this call, or views of the kept buffers a replayed graph reads.
    if kept is None:
        logp, ent, lse = head.row_outputs(hidden, n)
        glp = hidden.new_zeros((n,), dtype=torch.float32)
        gent = hidden.new_zeros((n,), dtype=torch.float32) if need_entropy else None
        total = hidden.new_zeros((), dtype=torch.float32)
    else:
        logp, ent, glp, total = kept.logp[:n], kept.ent[:n], kept.glp[:n], kept.total
        gent = kept.gent[:n] if need_entropy else None
        lse = hidden.new_zeros((n,), dtype=torch.float64)
    dh = head._grad_buffer(hidden, need_dh, zero=idx is not None)
    dw = head._grad_buffer(weight, need_dw, zero=rows == 0)
    if cached:  # the first block's logits kept in dW's buffer (head.cached_block_rows)

        def block_upstream(logp_b, ent_b, r):
            value, a, b = _coefficients(token_objective, logp_b, ent_b if need_entropy else None, r, True)
            total.add_(value)
            return None, a, b

        head._cached_block(hidden, weight, labels, idx, cached, ignore_index, inv_t, dh if need_dh else None,
                           dw, block_upstream, outputs=(logp, ent, lse))
        ch, chunks = head.queued_chunks(hidden, weight, idx, labels, inv_t, need_entropy, first=cached)
    pinned = head.PinnedColumns(labels, idx, ignore_index, pin, rows, vocab, hidden, ch.n_c) if pin > 0 else None
    upstreams = ChunkUpstreams(token_objective, logp, ent if need_entropy else None, glp, gent, total, ch.n_c,
                               kept)
    for i, (h_c, idx_c, start, logits) in enumerate(chunks):
        head._stats(ch, logits, idx_c, start, labels, logp, ent, lse, inv_t, ignore_index)
        r = idx_c if idx_c is not None else torch.arange(start, start + logits.shape[0], device=hidden.device)
        has_b = upstreams(r)
        head._dlogits(ch, logits, idx_c, start, labels, lse, ent if has_b else None,
                      glp, gent if has_b else None, None, inv_t, ignore_index)
        head._grads(ch, logits, h_c, idx_c, start, dh if need_dh else None, dw if need_dw else None,
                    i == 0 and not cached, pinned)
    if pinned is not None:
        ch = chunks = logits = h_c = None  # the logits workspace is free before the pinned rows' GEMM
        pinned.finish(dw, hidden, idx)
    if kept is not None:  # the next call overwrites the kept buffers
        total, logp, ent = total.clone(), logp.clone(), ent.clone()
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
