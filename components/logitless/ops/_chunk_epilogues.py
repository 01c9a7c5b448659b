"""The per-chunk softmax work of the chunked head: statistics, losses and d(objective)/d(logits).

Each function takes one chunk's raw logits ``z`` (rows x V) and the ``temperature`` that divides
them, and exists twice:

* ``*_eager``: in place on ``z`` where it can be (CPU, and CUDA with ``LOGITLESS_CHUNKED_COMPILE=0``):
  the fewest rows x V temporaries, the chunk budget of :mod:`logitless.ops.chunked` assumes three;
  ``z`` in the accumulator dtype (float32 logits straight from the GEMM, float64 for float64);
* ``*_fusible``: the same math without in-place ops or scatters, so that inductor compiles it into
  a few reductions and one pointwise kernel (the chunk is read two or three times instead of about
  ten eager passes); :func:`epilogues_for` returns these compiled on CUDA, where ``z`` stays in the
  inputs' half dtype (bf16 / fp16 logits, as plain PyTorch and torchtune hold them) and is upcast
  to float32 inside each fused pass: half the logits' bytes of a float32 chunk, for the rounding
  of plain PyTorch's logits.

All of them round like ``torch.log_softmax``: ``log q = (z - max) - log(sum exp(z - max))``. The
form ``z - lse`` would round ``lse`` at the logits' magnitude first, an error that a shared offset
of the logits (a bias-like hidden feature) turns into up to 20x plain PyTorch's on dh.
"""

from types import SimpleNamespace
from typing import Optional, Tuple

import torch

from logitless.first_start import note_compile
from logitless.settings import settings

Tensor = torch.Tensor


def _scaled(z: Tensor, temperature: float) -> Tensor:
    """``z / temperature`` in the accumulator dtype (half logits upcast first, as plain PyTorch does)."""
    z = z.float() if z.dtype in (torch.bfloat16, torch.float16) else z
    return z / temperature if temperature != 1.0 else z


def ce_eager(z: Tensor, safe: Tensor, valid: Tensor, coef, out_dtype: torch.dtype,
             temperature: float = 1.0) -> Tuple[Tensor, Tensor]:
    """Summed cross-entropy of a chunk and ``dloss/dz = (softmax - onehot) * coef``, in place on ``z``.

    Args:
        z (Tensor): ``(rows, V)`` raw logits (overwritten). safe (Tensor): ``(rows, 1)`` int64 labels,
            0 at ignored rows. valid (Tensor): ``(rows,)`` bool.
        coef (Tensor or float): the loss scale (1 / valid count for a mean), times 1 / temperature.
        out_dtype (torch.dtype): dtype of the returned gradient (the GEMM operand's).
        temperature (float): divides ``z`` first.

    Returns:
        Tuple[Tensor, Tensor]: the scalar summed loss of the valid rows and the ``(rows, V)`` gradient.

    Example:
        >>> loss, grad = ce_eager(torch.randn(3, 5), torch.tensor([[1], [0], [4]]),
        ...                       torch.tensor([True, False, True]), 0.5, torch.float32)
    """
    if temperature != 1.0:
        z.div_(temperature)
    z.sub_(z.amax(dim=-1, keepdim=True))
    log_s = torch.exp(z).sum(-1, keepdim=True).log_()
    loss = torch.where(valid, log_s.squeeze(1) - z.gather(1, safe).squeeze(1), 0.0).sum()
    grad = z.sub_(log_s).exp_()
    grad.scatter_add_(1, safe, -torch.ones_like(safe, dtype=z.dtype))
    grad.mul_((valid.to(z.dtype) * coef).unsqueeze(1))
    return loss, grad.to(out_dtype)


def ce_fusible(z: Tensor, safe: Tensor, valid: Tensor, coef, out_dtype: torch.dtype,
               temperature: float = 1.0) -> Tuple[Tensor, Tensor]:
    """:func:`ce_eager` without in-place ops (``z`` is left unchanged; half logits upcast)."""
    z = _scaled(z, temperature)
    m = z.amax(dim=-1, keepdim=True)
    log_s = torch.exp(z - m).sum(-1, keepdim=True).log()
    loss = torch.where(valid, (log_s - (z.gather(1, safe) - m)).squeeze(1), 0.0).sum()
    onehot = torch.arange(z.shape[1], device=z.device) == safe
    grad = (torch.exp((z - m) - log_s) - onehot.to(z.dtype)) * (valid.to(z.dtype) * coef).unsqueeze(1)
    return loss, grad.to(out_dtype)


def stats_eager(z: Tensor, safe: Tensor, valid: Tensor, need_entropy: bool, temperature: float = 1.0
                ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """Log-probs of the labels, entropy, row max and log-sum of a chunk; ``z`` becomes ``log q``.

    Args:
        z (Tensor): ``(rows, V)`` raw logits (overwritten by the log-softmax). safe, valid: as in
            :func:`ce_eager`. need_entropy (bool): compute the entropy (else ``None``).
        temperature (float): divides ``z`` first.

    Returns:
        Tuple: ``(logp, ent, m, log_s)``, each ``(rows,)``; ``logp`` and ``ent`` are 0 at ignored
        rows; ``m`` and ``log_s`` give back ``log q = (z - m) - log_s`` (:func:`grad_eager`).

    Example:
        >>> logp, ent, m, log_s = stats_eager(torch.randn(3, 5), torch.tensor([[1], [0], [4]]),
        ...                                   torch.tensor([True, False, True]), True)
    """
    if temperature != 1.0:
        z.div_(temperature)
    m = z.amax(dim=-1)
    z.sub_(m.unsqueeze(1))
    log_s = torch.exp(z).sum(-1).log_()
    logq = z.sub_(log_s.unsqueeze(1))
    logp = torch.where(valid, logq.gather(1, safe).squeeze(1), 0.0)
    # H = -sum_j p_j log p_j: a sum of non-negative terms. The algebraically equal lse - sum_j p_j z_j
    # subtracts two numbers of the logits' size and cancels in fp32.
    ent = torch.where(valid, -torch.exp(logq).mul_(logq).sum(-1), 0.0) if need_entropy else None
    return logp, ent, m, log_s


def stats_fusible(z: Tensor, safe: Tensor, valid: Tensor, need_entropy: bool, temperature: float = 1.0
                  ) -> Tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """:func:`stats_eager` without in-place ops (``z`` is left unchanged; half logits upcast)."""
    z = _scaled(z, temperature)
    m = z.amax(dim=-1, keepdim=True)
    shifted = z - m
    e = torch.exp(shifted)
    s = e.sum(-1, keepdim=True)
    log_s = s.log()
    logp = torch.where(valid, ((z.gather(1, safe) - m) - log_s).squeeze(1), 0.0)
    ent = None
    if need_entropy:
        # H = log s - t / s with t = sum e (z - m) <= 0: two non-negative terms (no cancellation),
        # and t a sum over the same pass as s, so inductor reads the chunk once for both.
        t = (e * shifted).sum(-1, keepdim=True)
        ent = torch.where(valid, (log_s - t / s).squeeze(1), 0.0)
    return logp, ent, m.squeeze(1), log_s.squeeze(1)


def grad_eager(z: Tensor, m: Optional[Tensor], log_s: Optional[Tensor], ent: Optional[Tensor],
               g_logp: Optional[Tensor], g_ent: Optional[Tensor], safe: Tensor, valid: Tensor,
               inv_t: float, out_dtype: torch.dtype, temperature: float = 1.0) -> Tensor:
    """``d/dz sum(g_logp * logp + g_ent * ent)``, in place on ``z``.

    ``dz = (a * onehot - p * (a + b * (log p + H))) / T`` with ``(a, b) = (g_logp, g_ent)`` at valid
    rows, 0 at ignored ones (their upstreams never enter).

    Args:
        z (Tensor): ``(rows, V)`` raw logits, or ``log q`` itself when ``m`` is None (overwritten).
        m, log_s (Optional[Tensor]): ``(rows,)`` from :func:`stats_eager`.
        ent (Optional[Tensor]): ``(rows,)`` entropies (needed with ``g_ent``).
        g_logp, g_ent (Optional[Tensor]): ``(rows,)`` upstream gradients (None: zero); at least one.
        safe, valid: as in :func:`ce_eager`. inv_t (float): 1 / temperature.
        out_dtype (torch.dtype): dtype of the returned gradient.
        temperature (float): divides ``z`` first (with ``m``; ``log q`` is already divided).

    Returns:
        Tensor: the ``(rows, V)`` gradient w.r.t. the raw logits.

    Example:
        >>> z = torch.randn(3, 5); valid = torch.ones(3, dtype=torch.bool); safe = torch.zeros(3, 1).long()
        >>> logp, ent, m, log_s = stats_eager(z.clone(), safe, valid, True)
        >>> dz = grad_eager(z, m, log_s, ent, torch.ones(3), None, safe, valid, 1.0, torch.float32)
    """
    if m is not None and temperature != 1.0:
        z.div_(temperature)
    logq = z if m is None else z.sub_(m.unsqueeze(1)).sub_(log_s.unsqueeze(1))
    p = logq.exp()
    a = None if g_logp is None else torch.where(valid, g_logp.to(z.dtype), 0.0).unsqueeze(1)
    if g_ent is not None:
        b = torch.where(valid, g_ent.to(z.dtype), 0.0).unsqueeze(1)
        grad = logq.add_(ent.to(z.dtype).unsqueeze(1)).mul_(b)
        if a is not None:
            grad.add_(a)
        grad.mul_(p)
    else:
        grad = p.mul_(a)
    grad.neg_()
    if a is not None:
        grad.scatter_add_(1, safe, a)
    if inv_t != 1.0:
        grad.mul_(inv_t)
    return grad.to(out_dtype)


def grad_fusible(z: Tensor, m: Tensor, log_s: Tensor, ent: Optional[Tensor], g_logp: Optional[Tensor],
                 g_ent: Optional[Tensor], safe: Tensor, valid: Tensor, inv_t: float,
                 out_dtype: torch.dtype, temperature: float = 1.0) -> Tensor:
    """:func:`grad_eager` without in-place ops (``z`` is left unchanged, half logits upcast; ``m`` is
    required)."""
    z = _scaled(z, temperature)
    logq = (z - m.unsqueeze(1)) - log_s.unsqueeze(1)
    p = torch.exp(logq)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    a = zero if g_logp is None else torch.where(valid, g_logp.to(z.dtype), 0.0).unsqueeze(1)
    inner = a
    if g_ent is not None:
        b = torch.where(valid, g_ent.to(z.dtype), 0.0).unsqueeze(1)
        inner = a + b * (logq + ent.to(z.dtype).unsqueeze(1))
    onehot = torch.arange(z.shape[1], device=z.device) == safe
    grad = torch.where(onehot, a, zero) - p * inner
    return (grad * inv_t).to(out_dtype)


_EAGER = SimpleNamespace(ce=ce_eager, stats=stats_eager, grad=grad_eager, in_place=True)
_COMPILED = None


def epilogues_for(z_like: Tensor) -> SimpleNamespace:
    """The chunk epilogues for inputs like ``z_like``: ``ce``, ``stats``, ``grad`` and ``in_place``.

    Compiled fusible versions for bf16/fp16 inputs on CUDA (``LOGITLESS_CHUNKED_COMPILE=0`` turns
    them off), which take the logits in the inputs' dtype, the in-place eager ones elsewhere, which
    take them in the accumulator dtype (float32 logits: more accurate than plain PyTorch's bf16). fp32 and fp64 inputs stay eager: compiled, the
    fp32 entropy at (150, 16, 1001) reached 1.5x plain PyTorch's error on an H200 where the eager
    epilogue stayed within it; under bf16's rounding the difference does not show. With ``in_place`` the
    ``stats`` call has turned ``z`` into ``log q``.

    Args:
        z_like (Tensor): the head's hidden states (their device and dtype decide).

    Returns:
        SimpleNamespace: ``ce``, ``stats``, ``grad`` (the signatures of the ``*_eager`` functions)
        and ``in_place`` (bool).

    Example:
        >>> ep = epilogues_for(torch.zeros(1))
        >>> ep.in_place
        True
    """
    global _COMPILED
    if not z_like.is_cuda or not settings.chunked_compile or z_like.dtype not in (torch.bfloat16, torch.float16):
        return _EAGER
    if _COMPILED is None:
        # Row counts vary (a tail chunk, another batch). The two with rows x V outputs (ce, grad)
        # compile with automatic dynamic shapes: rows turn dynamic at their first change, the
        # vocabulary stays static. On an H200 that took up to 11% off a CE or log-probs step (0.5B
        # head; -1% to +1% at 8B), while the statistics alone ran 5-13% faster fully dynamic
        # (head_chunked_static_vocab_h200.csv against head_chunked_half_logits_fused_entropy_h200.csv).
        note_compile("the chunked head's softmax epilogues (impl='chunked' on CUDA)")
        _COMPILED = SimpleNamespace(
            ce=torch.compile(ce_fusible), stats=torch.compile(stats_fusible, dynamic=True),
            grad=torch.compile(grad_fusible), in_place=False)
    return _COMPILED
