"""The compiled sampler's draw in two small launches: counter-based Gumbel-max and its log-prob.

:func:`logitless.generation.sampling.sample_counter` (no top-k / top-p) draws token
``argmax_v(logits[r, v] / T + Gumbel(u(key[r], t, v)))`` and returns it with its log-probability
under ``log_softmax(logits / T)``. Under ``torch.compile`` that is an int64 hash of every
``(row, token)`` and three reductions over the vocabulary, which inductor runs one program per row:
at 64 rows x 151,936 tokens on an H200 about 130 us a decode step, 5% of a Qwen2.5-1.5B step.
Here the same draw runs as

* ``counter_draw_kernel``, grid ``(B, splits)``: each program hashes its span of the vocabulary in
  32-bit arithmetic (the reference's int64 products masked to 32 bits are exactly uint32 wrap-around
  products), keeps the best perturbed score with its first index, and the running max and sum of
  ``2 ** s`` of the tempered logits in base 2, into an fp32 workspace;
* ``counter_pick_kernel``, grid ``(B,)``: folds a row's spans in order (the first index wins a tie, as
  ``argmax`` picks) and writes the token and ``logits[tok] / T - logsumexp``.

Both the draw and its order are fixed by the inputs: the same token for the same ``(key, step,
logits)`` whatever the batch, its order or the split count. ``temperature == 0`` is greedy: the
argmax, with the log-probability at ``T = 1`` (as the reference). The uniforms are the reference's
bit for bit; the scores are the reference's times ``log2(e)`` less a constant (the same argmax),
computed with fp32 ``log2`` (:func:`_gumbel2`, within 3 ulp of float64) and a product with
``log2(e) / T``, so a perturbed score can differ from PyTorch's in its last bits, and a token with
it only where two tokens' scores tie to within that rounding.

Example:
    >>> logits = torch.randn(64, 151936, device="cuda")
    >>> keys = torch.randint(0, 2**62, (64,), device="cuda")
    >>> tokens, logp = counter_draw(logits, keys, torch.tensor([5], device="cuda"), temperature=1.0)
"""

from typing import Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import libdevice

from logitless._platform import sm_count, triton_interpreting

__all__ = ["counter_draw", "counter_draw_splits"]

#: Columns per inner-loop block and warps per program of the draw, the programs per SM its split
#: count aims at, and at most this many spans per row. In a sweep at 64 rows x 151,936 columns on an
#: H200 (``experiments/results/counter_draw_launch_h200.csv``, the same kernel with both logs
#: approximate: ``log`` 2, ``table`` 0) 2 programs per SM left each program waiting on every block's
#: loads: 31.5 us, against 25.4 us with 8 programs per SM and 4096-column blocks. At 16 rows more
#: than about 16 spans a row only lengthened the pick kernel's fold.
BLOCK_V, NUM_WARPS, PROGRAMS_PER_SM, MAX_SPLITS = 4096, 8, 8, 16
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _mix32(x):
    """:func:`logitless.generation.sampling._mix32` on uint32 values (wrap-around products are the
    reference's int64 products masked to 32 bits)."""
    c = tl.full([1], 0x45D9F3B, tl.uint32)
    x = ((x >> 16) ^ x) * c
    x = ((x >> 16) ^ x) * c
    return (x >> 16) ^ x


@triton.jit
def _gumbel2(u, FAST_LOG: tl.constexpr):
    """``log2(-log2(u))``: minus a Gumbel variate in base 2 (up to a constant), for ``u`` in (0, 1).

    The inner log is the accurate one: near ``u = 1``, where the largest noise (the likely winner)
    comes from, ``lg2.approx.f32`` has an absolute error of about ``2**-22`` against values down to
    about ``1e-7``. The outer log's argument is at least ``2**-24 / ln 2``, where the approximation
    (with ``FAST_LOG``, on NVIDIA GPUs) keeps about 2 ulp relative. Over all ``2**23`` uniforms of
    :func:`~logitless.generation.sampling.uniform_from_bits` that is within 2.8 ulp of float64 on an
    H200; with both logs approximate it was off by up to 1e6 ulp (``experiments/bench_counter_draw.py``,
    ``experiments/results/counter_draw_h200.csv``).
    """
    a = -tl.math.log2(u)
    if FAST_LOG:
        return libdevice.fast_log2f(a)
    else:
        return tl.math.log2(a)


@triton.jit
def counter_draw_kernel(logits_ptr, keys_ptr, step_ptr, best_ptr, index_ptr, max_ptr, sum_ptr, V, stride_lb,
                        stride_step, inv_temperature, SPAN: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
                        FAST_LOG: tl.constexpr):
    """Grid ``(B, splits)``: the best perturbed score (and its first column), the max and the sum of
    ``2 ** (s - max)`` of the tempered logits in base 2, ``s = logits / T * log2(e)``, over columns
    ``[split * SPAN, +SPAN)`` of a row. Sampled, the score is ``s - log2(-log2(u))``: the Gumbel-max
    score ``logits / T - log(-log(u))`` times ``log2(e)`` less a constant, so the same argmax."""
    r = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    key = tl.load(keys_ptr + r + tl.zeros([1], tl.int64))  # (1,): the hash runs on uint32 tensors
    step = tl.load(step_ptr + r * stride_step + tl.zeros([1], tl.int64))  # stride 0: one step for every row
    # truncation to 32 bits keeps the low word, as the reference's mask does
    lo = key.to(tl.uint32)
    hi = (key >> 32).to(tl.uint32)
    row = _mix32(lo ^ _mix32(hi ^ _mix32(step.to(tl.uint32))))
    best = tl.full([1], float("-inf"), tl.float32)
    index = tl.full([1], 0, tl.int32) + split * SPAN
    m = tl.full([1], float("-inf"), tl.float32)
    acc = tl.zeros([1], tl.float32)
    cols0 = tl.arange(0, BLOCK)
    for c in range(split * SPAN, tl.minimum(split * SPAN + SPAN, V), BLOCK):
        cols = c + cols0
        inside = cols < V
        x = tl.load(logits_ptr + r * stride_lb + cols, mask=inside, other=float("-inf")).to(tl.float32)
        s = x * (inv_temperature * LOG2E)
        if GREEDY:
            score = x  # the argmax of the logits themselves: scaling could merge two fp32 values
        else:
            token = _mix32(cols.to(tl.uint32) * tl.full([1], 0x61C88647, tl.uint32))
            bits = _mix32(_mix32(row ^ token) ^ row)
            u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # uniform_from_bits
            score = tl.where(inside, s - _gumbel2(u, FAST_LOG), float("-inf"))
        blk_best, blk_index = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
        better = blk_best > best  # strict: an earlier column keeps a tie
        index = tl.where(better, c + blk_index, index)
        best = tl.where(better, blk_best, best)
        m_new = tl.maximum(m, tl.max(s, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.math.exp2(m - ref) + tl.sum(tl.math.exp2(s - ref), 0)
        m = m_new
    at = r * splits + split + tl.arange(0, 1)
    tl.store(best_ptr + at, best)
    tl.store(index_ptr + at, index)
    tl.store(max_ptr + at, m)
    tl.store(sum_ptr + at, acc)


@triton.jit
def counter_pick_kernel(logits_ptr, best_ptr, index_ptr, max_ptr, sum_ptr, tokens_ptr, logp_ptr, stride_lb,
                        inv_temperature, SPLITS: tl.constexpr):
    """Grid ``(B,)``: the row's token (the best span's column, the first span on a tie) and its
    log-probability ``(s[tok] - log2(sum 2 ** s)) * ln(2)``, spans folded in order."""
    r = tl.program_id(0).to(tl.int64)
    one = tl.arange(0, 1)
    best = tl.full([1], float("-inf"), tl.float32)
    index = tl.load(index_ptr + r * SPLITS + one)
    m = tl.full([1], float("-inf"), tl.float32)
    acc = tl.zeros([1], tl.float32)
    for i in range(SPLITS):
        at = r * SPLITS + i + one
        b = tl.load(best_ptr + at)
        better = b > best
        index = tl.where(better, tl.load(index_ptr + at), index)
        best = tl.where(better, b, best)
        mi = tl.load(max_ptr + at)
        m_new = tl.maximum(m, mi)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.math.exp2(m - ref) + tl.load(sum_ptr + at) * tl.math.exp2(mi - ref)
        m = m_new
    s = tl.load(logits_ptr + r * stride_lb + index).to(tl.float32) * (inv_temperature * LOG2E)
    tl.store(tokens_ptr + r + one, index.to(tl.int64))
    tl.store(logp_ptr + r + one, (s - m - tl.math.log2(acc)) * LN2)


def counter_draw_splits(rows: int, vocab: int, num_sms: int = 132) -> int:
    """Spans per row: about ``PROGRAMS_PER_SM`` programs per SM, at least one ``BLOCK_V`` block each
    and at most ``MAX_SPLITS``.

    Example:
        >>> counter_draw_splits(64, 151936), counter_draw_splits(8, 151936), counter_draw_splits(4, 100)
        (16, 16, 1)
    """
    return max(1, min(triton.cdiv(vocab, BLOCK_V), triton.cdiv(PROGRAMS_PER_SM * num_sms, rows), MAX_SPLITS))


@torch.library.custom_op("logitless::counter_draw", mutates_args=())
def _counter_draw_op(logits: Tensor, keys: Tensor, step: Tensor, temperature: float) -> Tuple[Tensor, Tensor]:
    """``(tokens int64, logp fp32)``, each ``(B,)``; see :func:`counter_draw`."""
    b, v = logits.shape
    splits = counter_draw_splits(b, v, sm_count(logits.device))
    span = triton.cdiv(triton.cdiv(v, splits), BLOCK_V) * BLOCK_V
    splits = triton.cdiv(v, span)
    best = torch.empty(b, splits, dtype=torch.float32, device=logits.device)
    index = torch.empty(b, splits, dtype=torch.int32, device=logits.device)
    top, total = torch.empty_like(best), torch.empty_like(best)
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logp = torch.empty(b, dtype=torch.float32, device=logits.device)
    greedy = temperature == 0
    inv = 1.0 if greedy else 1.0 / temperature
    if b:
        # lg2.approx for the outer log on NVIDIA GPUs (libdevice's): the accurate one costs 8 us a draw
        fast_log = logits.is_cuda and torch.version.cuda is not None
        counter_draw_kernel[(b, splits)](logits, keys, step, best, index, top, total, v, logits.stride(0),
                                         0 if step.numel() == 1 else 1, inv,
                                         SPAN=span, BLOCK=BLOCK_V, GREEDY=greedy, FAST_LOG=fast_log,
                                         num_warps=NUM_WARPS)
        counter_pick_kernel[(b,)](logits, best, index, top, total, tokens, logp, logits.stride(0), inv,
                                  SPLITS=splits, num_warps=1)
    return tokens, logp


@_counter_draw_op.register_fake
def _(logits, keys, step, temperature):
    b = logits.shape[0]
    return logits.new_empty(b, dtype=torch.int64), logits.new_empty(b, dtype=torch.float32)


def counter_draw(logits: Tensor, keys: Tensor, step: Tensor, *, temperature: float = 1.0) -> Tuple[Tensor, Tensor]:
    """:func:`~logitless.generation.sampling.sample_counter` without top-k / top-p, in two launches.

    Args:
        logits (Tensor): ``(B, V)`` scores of the next token (fp32, bf16 or fp16; rows contiguous).
        keys (Tensor): ``(B,)`` int64 row keys.
        step (Tensor): ``(1,)`` int64 step counter, or ``(B,)``: one per row (a multi-turn rollout's
            rows are at different completion positions).
        temperature (float): divides the logits; 0 = greedy (argmax, log-prob at ``T = 1``).

    Returns:
        Tuple[Tensor, Tensor]: tokens ``(B,)`` int64 and log-probs ``(B,)`` fp32.

    Raises:
        ValueError: on shapes, dtypes or devices the kernels do not take, or a negative temperature.
    """
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.bfloat16,
                                                                          torch.float16):
        raise ValueError(f"logits: expected a (B, V) float tensor with contiguous rows, got shape "
                         f"{tuple(logits.shape)}, strides {logits.stride()}, dtype {logits.dtype}")
    if keys.shape != (logits.shape[0],) or keys.dtype != torch.int64:
        raise ValueError(f"keys: expected ({logits.shape[0]},) int64, got {tuple(keys.shape)} {keys.dtype}")
    if step.dim() != 1 or step.numel() not in (1, logits.shape[0]) or step.dtype != torch.int64 or (
            step.numel() > 1 and step.stride(0) != 1):
        raise ValueError(f"step: expected a (1,) or contiguous ({logits.shape[0]},) int64 tensor, got "
                         f"{tuple(step.shape)} {step.dtype}")
    if not (logits.is_cuda or triton_interpreting()) or keys.device != logits.device or step.device != logits.device:
        raise ValueError(f"logits, keys and step must be on one CUDA device (or CPU under TRITON_INTERPRET=1), "
                         f"got {logits.device}, {keys.device}, {step.device}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    return _counter_draw_op(logits, keys, step, float(temperature))
