"""The fused head's entry points: argument checks, then the registered torch.library ops.

Called by :mod:`logitless.ops.dispatch` after validation, with hidden flattened to
``(N, H)`` and labels to ``(N,)``:

* :func:`linear_cross_entropy` -- mean/sum with gradients computed in the forward (3 GEMMs per
  step), ``"none"`` through the recompute path (4 GEMMs);
* :func:`linear_log_probs` -- per-token log-probs and entropy, any upstream gradients;
* :func:`linear_token_objective` -- a sum of per-token terms of (log-prob, entropy), such as the
  GRPO policy loss, with gradients computed in the forward (3 GEMMs; a plain autograd.Function,
  see :mod:`logitless.ops.triton.token_objective`).

See the package docstring (:mod:`logitless.ops.triton`) for an example.
"""

from typing import Optional, Tuple

import torch

from logitless.ops import _validate, quack_head
from logitless.settings import settings
from logitless.ops.triton import ops as _ops  # noqa: F401  (registers the torch.library ops)


@torch.compiler.assume_constant_result
def _head_gemm_setting() -> str:
    # under torch.compile: the value when the graph was traced
    return settings.head_gemm


def resolve_gemm_backend(gemm_backend: Optional[str]) -> str:
    """The GEMM backend of this call (``gemm_backend``, else ``LOGITLESS_HEAD_GEMM``), handed to the
    forward op, whose backward then runs the same GEMMs whenever it runs."""
    mode = _head_gemm_setting() if gemm_backend is None else gemm_backend
    if mode == "quack" and not quack_head.quack_installed():
        where = "LOGITLESS_HEAD_GEMM" if gemm_backend is None else "gemm_backend"
        raise ValueError(
            f"{where}='quack' needs quack-kernels (pip install 'logitless[quack]'), which is "
            f"not installed; use 'cublas' or 'auto'"
        )
    return mode

__all__ = ["linear_cross_entropy", "linear_log_probs", "resolve_gemm_backend"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    # Cheap metadata checks only (no sync); value checks of labels are dispatch's job.
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"triton head: expected hidden (N, H), weight (V, H), labels (N,), got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if hidden.dtype not in _DTYPES:
        raise ValueError(f"triton head: hidden.dtype must be bf16, fp16 or fp32, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"triton head: weight.dtype must equal hidden.dtype ({hidden.dtype}), got {weight.dtype}"
        )
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(
            f"triton head: hidden, weight and labels must be on one device, got {hidden.device}, "
            f"{weight.device}, {labels.device}"
        )
    if hidden.shape[1] != weight.shape[1] or labels.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"triton head: shapes do not match: hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    _validate.check_head_dims(weight)
    _validate.check_temperature(temperature)


def _prep(hidden, weight, labels):
    # Non-contiguous inputs are made contiguous once (a copy); labels as int64.
    return hidden.contiguous(), weight.contiguous(), labels.to(torch.int64).contiguous()


def linear_cross_entropy(hidden2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor, *,
                         ignore_index: int, reduction: str, temperature: float,
                         n_valid: Optional[int] = None, gemm_backend: Optional[str] = None) -> torch.Tensor:
    """Cross-entropy of ``softmax(hidden2d @ weight.T / temperature)``, fused.

    Args:
        hidden2d (torch.Tensor): ``(N, H)`` bf16/fp16/fp32.
        weight (torch.Tensor): ``(V, H)``, same dtype and device.
        labels1d (torch.Tensor): ``(N,)`` int64 in ``[0, V)`` or ``ignore_index``.
        ignore_index (int): ignored label.
        reduction (str): ``"mean"`` (over non-ignored; 0 when none), ``"sum"`` or ``"none"``.
        temperature (float): > 0, divides the logits.
        n_valid (Optional[int]): the number of non-ignored labels when the caller has read it
            (validation does, in its one host sync); None: counted here (a second sync).
        gemm_backend (Optional[str]): the head's GEMMs (``"auto" | "cublas" | "quack" | "triton"``);
            None = ``LOGITLESS_HEAD_GEMM``.

    Returns:
        torch.Tensor: fp32 scalar, or fp32 ``(N,)`` for ``"none"`` (0 at ignored rows).

    Example:
        >>> loss = linear_cross_entropy(h, w, y, ignore_index=-100, reduction="sum", temperature=1.0)
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"triton head: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    _check(hidden2d, weight, labels1d, temperature)
    h, w, y = _prep(hidden2d, weight, labels1d)
    t = float(temperature)
    nv = -1 if n_valid is None else int(n_valid)
    need_dh = hidden2d.requires_grad and torch.is_grad_enabled()
    need_dw = weight.requires_grad and torch.is_grad_enabled()
    mode = resolve_gemm_backend(gemm_backend)
    if not (need_dh or need_dw) and quack_head.forward_applies(h, w, mode):
        nll = -quack_head.log_probs(h, w, y, ignore_index=ignore_index, temperature=t)
        if reduction == "none":
            return nll
        return nll.sum() if reduction == "sum" else nll.sum() / (y != ignore_index).sum().clamp(min=1)
    if reduction == "none":
        logp = torch.ops.logitless.triton_head_fwd(h, w, y, ignore_index, t, need_dh or need_dw, nv, mode)[0]
        return -logp
    if need_dh or need_dw:
        return torch.ops.logitless.triton_ce_fused(h, w, y, ignore_index, t, reduction == "mean",
                                                   need_dh, need_dw, nv, mode)[0]
    total = -torch.ops.logitless.triton_head_fwd(h, w, y, ignore_index, t, False, nv, mode)[0].sum()
    if reduction == "sum":
        return total
    return total / (y != ignore_index).sum().clamp(min=1)


def linear_log_probs(hidden2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor, *,
                     ignore_index: int, temperature: float, return_entropy: bool,
                     n_valid: Optional[int] = None,
                     gemm_backend: Optional[str] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs (and entropy) of ``softmax(hidden2d @ weight.T / temperature)``, fused.

    Differentiable w.r.t. ``hidden2d`` and ``weight`` for any upstream gradients (the backward
    recomputes the logits chunk by chunk).

    Args:
        hidden2d (torch.Tensor): ``(N, H)`` bf16/fp16/fp32.
        weight (torch.Tensor): ``(V, H)``, same dtype and device.
        labels1d (torch.Tensor): ``(N,)`` int64 in ``[0, V)`` or ``ignore_index``.
        ignore_index (int): positions with this label get 0 and no gradient.
        temperature (float): > 0, divides the logits.
        return_entropy (bool): also return the entropy (else ``None``).
        n_valid (Optional[int]): as in :func:`linear_cross_entropy`.
        gemm_backend (Optional[str]): as in :func:`linear_cross_entropy`.

    Returns:
        Tuple[torch.Tensor, Optional[torch.Tensor]]: fp32 ``(N,)`` log-probs and entropy.

    Example:
        >>> logp, ent = linear_log_probs(h, w, y, ignore_index=-100, temperature=0.7, return_entropy=True)
    """
    _check(hidden2d, weight, labels1d, temperature)
    h, w, y = _prep(hidden2d, weight, labels1d)
    for_backward = torch.is_grad_enabled() and (hidden2d.requires_grad or weight.requires_grad)
    mode = resolve_gemm_backend(gemm_backend)
    if not (for_backward or return_entropy) and quack_head.forward_applies(h, w, mode):
        return quack_head.log_probs(h, w, y, ignore_index=ignore_index, temperature=temperature), None
    logp, ent, _ = torch.ops.logitless.triton_head_fwd(
        h, w, y, ignore_index, float(temperature), for_backward, -1 if n_valid is None else int(n_valid), mode)
    return logp, (ent if return_entropy else None)
