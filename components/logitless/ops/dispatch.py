"""The public head ops: validate once, pick an implementation, flatten, call it, reshape back."""

from typing import Callable, Optional, Tuple

import torch

from logitless._platform import triton_interpreting
from logitless.ops import _validate, chunked, reference
from logitless.ops.row_objective import RowObjective
from logitless.settings import settings


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Maps ``impl`` to the implementation that runs on ``device``.

    ``"auto"`` picks the fused Triton kernels on CUDA (float64 reference inputs excepted) and the
    chunked PyTorch path elsewhere;
    ``"triton"`` on a CPU tensor is an error unless ``TRITON_INTERPRET=1`` (how CI runs the kernels).

    Args:
        impl (str): ``"auto" | "triton" | "chunked" | "reference"``.
        device (torch.device): where the inputs live.
        dtype (torch.dtype): the inputs' dtype.

    Returns:
        str: ``"triton" | "chunked" | "reference"``.

    Raises:
        ValueError: an unknown ``impl``, or ``"triton"`` on tensors it cannot run on.

    Example:
        >>> resolve_impl("auto", torch.device("cpu"))
        'chunked'
    """
    _validate.check_impl(impl)
    if impl == "auto":
        return "triton" if device.type == "cuda" and dtype != torch.float64 else "chunked"
    if impl == "triton" and device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter), "
            f"got tensors on {device}; use impl='chunked' or 'auto' on the CPU"
        )
    return impl


def _triton():
    # Imported lazily: triton is an optional, Linux-only dependency.
    from logitless.ops import triton as triton_ops

    return triton_ops


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    temperature: float = 1.0,
    impl: str = "auto",
    chunk_size: Optional[int] = None,
    gemm_backend: Optional[str] = None,
) -> torch.Tensor:
    """Cross-entropy of ``softmax(hidden @ weight.T / temperature)`` without materialising the logits.

    Args:
        hidden (torch.Tensor): ``(..., H)`` bf16, fp16, fp32 (or fp64 for references).
        weight (torch.Tensor): ``(V, H)``, as ``nn.Linear`` stores it; same dtype and device.
        labels (torch.Tensor): ``hidden.shape[:-1]`` int64, in ``[0, V)`` or ``ignore_index``.
        ignore_index (int): label that contributes no loss. Default -100.
        reduction (str): ``"mean"`` over non-ignored tokens (0.0 with zero gradients when there are
            none), ``"sum"``, or ``"none"`` (fp32 per-token loss of ``labels.shape``, 0 at ignored).
        temperature (float): divides the logits before the softmax. Default 1.0.
        impl (str): ``"auto"`` (triton on CUDA, else chunked), ``"triton"``, ``"chunked"``, ``"reference"``.
        chunk_size (Optional[int]): rows per chunk for ``"chunked"`` (default: a 1 GiB budget).
        gemm_backend (Optional[str]): the GEMMs of ``impl="triton"``: ``"auto"`` (QuACK where it
            applies and is installed, else cuBLAS), ``"cublas"``, ``"quack"`` or ``"triton"`` (opt-in
            Triton GEMMs with the softmax work in their epilogues); None = ``LOGITLESS_HEAD_GEMM``
            (default ``"auto"``). The other implementations run their own GEMMs.

    Returns:
        torch.Tensor: fp32 scalar, or fp32 ``labels.shape`` for ``reduction="none"``.

    Raises:
        ValueError: on a bad argument, before any computation.

    Example:
        >>> hidden = torch.randn(2, 16, 64, requires_grad=True)
        >>> weight = torch.randn(1000, 64, requires_grad=True)
        >>> labels = torch.randint(0, 1000, (2, 16))
        >>> linear_cross_entropy(hidden, weight, labels).backward()
    """
    _validate.check_reduction(reduction)
    _validate.check_temperature(temperature)
    _validate.check_chunk_size(chunk_size)
    _validate.check_gemm_backend(gemm_backend)
    n_valid = _validate.check_head_inputs(hidden, weight, labels, ignore_index=ignore_index)
    impl = resolve_impl(impl, hidden.device, hidden.dtype)
    if impl == "reference":
        return reference.cross_entropy(
            hidden, weight, labels, ignore_index=ignore_index, reduction=reduction,
            temperature=temperature, n_valid=n_valid,
        )
    h2d, y1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if impl == "triton":
        loss = _triton().linear_cross_entropy(
            h2d, weight, y1d, ignore_index=ignore_index, reduction=reduction, temperature=temperature,
            n_valid=n_valid, gemm_backend=gemm_backend,
        )
    else:
        loss = chunked.linear_cross_entropy(
            h2d, weight, y1d, ignore_index=ignore_index, reduction=reduction,
            temperature=temperature, chunk_size=chunk_size, n_valid=n_valid,
        )
    return loss.reshape(labels.shape) if reduction == "none" else loss


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    return_entropy: bool = True,
    impl: str = "auto",
    chunk_size: Optional[int] = None,
    gemm_backend: Optional[str] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token ``log softmax(hidden @ weight.T / temperature)[label]`` and the entropy.

    Differentiable w.r.t. ``hidden`` and ``weight`` for any upstream gradient of both outputs
    (recomputed per chunk in backward, so memory never grows with ``N x V``).

    Args:
        hidden (torch.Tensor): ``(..., H)``.
        weight (torch.Tensor): ``(V, H)``; same dtype and device as ``hidden``.
        labels (torch.Tensor): ``hidden.shape[:-1]`` int64, in ``[0, V)`` or ``ignore_index``.
        ignore_index (int): positions with this label get 0 and no gradient. Default -100.
        temperature (float): divides the logits (use the sampling temperature in RL). Default 1.0.
        return_entropy (bool): also return the entropy; ``None`` otherwise. Default True.
        impl (str): ``"auto"``, ``"triton"``, ``"chunked"`` or ``"reference"``.
        chunk_size (Optional[int]): rows per chunk for ``"chunked"``.
        gemm_backend (Optional[str]): as in :func:`linear_cross_entropy`.

    Returns:
        Tuple[torch.Tensor, Optional[torch.Tensor]]: fp32 log-probs and entropy of ``labels.shape``.

    Example:
        >>> hidden = torch.randn(2, 16, 64, requires_grad=True)
        >>> weight = torch.randn(1000, 64)
        >>> logp, ent = linear_log_probs(hidden, weight, torch.randint(0, 1000, (2, 16)), temperature=0.7)
    """
    _validate.check_temperature(temperature)
    _validate.check_chunk_size(chunk_size)
    _validate.check_gemm_backend(gemm_backend)
    n_valid = _validate.check_head_inputs(hidden, weight, labels, ignore_index=ignore_index)
    impl = resolve_impl(impl, hidden.device, hidden.dtype)
    if impl == "reference":
        return reference.log_probs(
            hidden, weight, labels, ignore_index=ignore_index, temperature=temperature,
            return_entropy=return_entropy, n_valid=n_valid,
        )
    h2d, y1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if impl == "triton":
        logp, ent = _triton().linear_log_probs(
            h2d, weight, y1d, ignore_index=ignore_index, temperature=temperature,
            return_entropy=return_entropy, n_valid=n_valid, gemm_backend=gemm_backend,
        )
    else:
        logp, ent = chunked.linear_log_probs(
            h2d, weight, y1d, ignore_index=ignore_index, temperature=temperature,
            return_entropy=return_entropy, chunk_size=chunk_size, n_valid=n_valid,
        )
    return logp.reshape(labels.shape), (ent.reshape(labels.shape) if ent is not None else None)


def linear_token_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_objective: Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor],
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    need_entropy: bool = False,
    impl: str = "auto",
    chunk_size: Optional[int] = None,
    gemm_backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A sum of per-token terms of (log-prob, entropy), with its gradients computed in the forward.

    When each token's term depends only on that token's log-prob and entropy (and on constants
    known before the forward: old/reference log-probs, advantages, normalisers -- the GRPO policy
    loss), the gradient w.r.t. each chunk's logits is known as soon as they are, so ``"chunked"``
    and ``"triton"`` cost three GEMMs like cross-entropy, instead of forward + recompute (four).
    The result takes a scalar upstream only (it is a scalar) and supports one backward.

    The objective is called on the non-ignored rows only, possibly several times over disjoint
    sets of rows (one per row chunk), so it must be a sum of per-token terms; ``rows`` names the
    rows so the callable can gather its per-row constants.

    Args:
        hidden (torch.Tensor): ``(..., H)``.
        weight (torch.Tensor): ``(V, H)``; same dtype and device as ``hidden``.
        labels (torch.Tensor): ``hidden.shape[:-1]`` int64, in ``[0, V)`` or ``ignore_index``.
        token_objective (Callable): ``f(logp, ent, rows) -> scalar tensor``: ``rows`` a 1-D int64
            tensor of indices into the flattened ``labels`` (``labels.reshape(-1)``), non-ignored
            rows only, each row in exactly one call; ``logp``/``ent`` their log-probs and
            entropies, shape ``(len(rows),)``, fp32 (float64 for the ``"reference"`` and
            ``"chunked"`` impls on float64 inputs; ``ent`` is None unless ``need_entropy``). Written in differentiable torch ops;
            constants are gathered as ``const.reshape(-1)[rows]``. A
            :class:`~logitless.ops.RowObjective` names its constants instead, which lets the
            ``"triton"`` head on CUDA replay one captured graph of it across calls.
        ignore_index (int): rows with this label have no term. Default -100.
        temperature (float): divides the logits. Default 1.0.
        need_entropy (bool): compute the entropy and pass it to the objective. Default False.
        impl (str): ``"auto"``, ``"triton"``, ``"chunked"`` or ``"reference"`` (reference log-probs and
            the objective through plain autograd).
        chunk_size (Optional[int]): rows per chunk for ``"chunked"``.
        gemm_backend (Optional[str]): as in :func:`linear_cross_entropy`.

    Returns:
        Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]: the scalar objective
        (differentiable w.r.t. ``hidden`` and ``weight``), and the detached per-token log-probs and
        entropies of ``labels.shape`` (0 at ignored positions; entropy None unless
        ``need_entropy``), for metrics.

    Raises:
        ValueError: on a bad argument, before any computation.

    Example:
        >>> hidden = torch.randn(2, 16, 64, requires_grad=True)
        >>> weight = torch.randn(1000, 64, requires_grad=True)
        >>> labels = torch.randint(0, 1000, (2, 16))
        >>> adv = torch.randn(2, 16).reshape(-1)
        >>> obj = lambda lp, ent, rows: -(adv[rows] * lp).sum() / rows.numel()
        >>> loss, logp, _ = linear_token_objective(hidden, weight, labels, obj, impl="chunked")
        >>> loss.backward()
    """
    _validate.check_token_objective(token_objective, need_entropy)
    _validate.check_temperature(temperature)
    _validate.check_chunk_size(chunk_size)
    _validate.check_gemm_backend(gemm_backend)
    n_valid = _validate.check_head_inputs(hidden, weight, labels, ignore_index=ignore_index)
    if isinstance(token_objective, RowObjective):
        token_objective.check_rows(labels.numel(), hidden.device)
    impl = resolve_impl(impl, hidden.device, hidden.dtype)
    if impl == "reference":
        logp, ent = reference.log_probs(
            hidden, weight, labels, ignore_index=ignore_index, temperature=temperature,
            return_entropy=need_entropy, n_valid=n_valid,
        )
        rows = torch.nonzero(labels.reshape(-1) != ignore_index).squeeze(1)
        value = token_objective(logp.reshape(-1)[rows],
                                ent.reshape(-1)[rows] if need_entropy else None, rows)
        return value, logp.detach(), (ent.detach() if need_entropy else None)
    h2d, y1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if impl == "triton":
        triton_ops = _triton()
        # the objective's gradients are computed in its forward: the backend set for the call covers them
        with settings.override(head_gemm=triton_ops.functional.resolve_gemm_backend(gemm_backend)):
            value, logp, ent = triton_ops.linear_token_objective(
                h2d, weight, y1d, token_objective, ignore_index=ignore_index, temperature=temperature,
                need_entropy=need_entropy, n_valid=n_valid,
            )
    else:
        value, logp, ent = chunked.linear_token_objective(
            h2d, weight, y1d, token_objective, ignore_index=ignore_index, temperature=temperature,
            need_entropy=need_entropy, chunk_size=chunk_size,
        )
    return value, logp.reshape(labels.shape), (ent.reshape(labels.shape) if ent is not None else None)
