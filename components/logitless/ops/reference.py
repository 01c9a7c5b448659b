"""Plain-PyTorch head ops: the test oracle and the ``impl="reference"`` fallback.

They materialise the full ``(N, V)`` logits, exactly as a user's own code would: ``hidden @ weight.T``
in the inputs' dtype, then upcast to float32 (or kept in float64 for float64 inputs) before the
softmax. Called with float64 tensors they are the float64 reference every other implementation is
compared against.
"""

from typing import Optional, Tuple

import torch

from logitless.ops._rows import has_ignored_rows, zero_ignored_rows


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = hidden @ weight.T
    # Upcast before the reduction: a bf16 log-softmax over 152k classes is off by ~1e-2 nats.
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    return logits / temperature if temperature != 1.0 else logits


def log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    temperature: float = 1.0,
    return_entropy: bool = True,
    n_valid: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probability of ``labels`` and entropy under ``softmax(hidden @ weight.T / T)``.

    Args:
        hidden (torch.Tensor): ``(..., H)``.
        weight (torch.Tensor): ``(V, H)``.
        labels (torch.Tensor): ``hidden.shape[:-1]`` integer labels.
        ignore_index (int): label whose positions get 0 log-prob and 0 entropy.
        temperature (float): divides the logits before the softmax.
        return_entropy (bool): also return the entropy (else ``None``).
        n_valid (Optional[int]): the number of non-ignored labels when the caller has counted them
            (else counted here when needed).

    Returns:
        Tuple[torch.Tensor, Optional[torch.Tensor]]: log-probs and entropy of ``labels.shape``,
        float32 (float64 for float64 inputs).

    Example:
        >>> h, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
        >>> logp, ent = log_probs(h, w, torch.tensor([1, 2, -100, 3]))
    """
    valid = labels != ignore_index
    if has_ignored_rows(valid.reshape(-1), n_valid):
        # An ignored row's hidden state never reaches the GEMMs: its NaN or inf would become NaN
        # in dW through 0 * NaN, and (through the softmax backward) in its own dh row.
        hidden = zero_ignored_rows(hidden, valid)
    logits = _logits(hidden, weight, temperature)
    logz = logits.log_softmax(dim=-1)
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    logp = logz.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp, None
    ent = -(logz.exp() * logz).sum(-1)
    ent = torch.where(valid, ent, torch.zeros_like(ent))
    return logp, ent


def cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    temperature: float = 1.0,
    n_valid: Optional[int] = None,
) -> torch.Tensor:
    """Cross-entropy of ``softmax(hidden @ weight.T / T)`` against ``labels``.

    Args:
        hidden (torch.Tensor): ``(..., H)``.
        weight (torch.Tensor): ``(V, H)``.
        labels (torch.Tensor): ``hidden.shape[:-1]`` integer labels.
        ignore_index (int): label that contributes no loss.
        reduction (str): ``"mean"`` over non-ignored tokens (0.0 when there are none),
            ``"sum"``, or ``"none"`` (per token, 0 at ignored tokens).
        temperature (float): divides the logits before the softmax.
        n_valid (Optional[int]): as in :func:`log_probs`.

    Returns:
        torch.Tensor: scalar for ``"mean"``/``"sum"``, else ``labels.shape``.

    Example:
        >>> h, w = torch.randn(4, 8), torch.randn(11, 8)
        >>> loss = cross_entropy(h, w, torch.tensor([1, 2, -100, 3]))
    """
    logp, _ = log_probs(
        hidden, weight, labels, ignore_index=ignore_index, temperature=temperature,
        return_entropy=False, n_valid=n_valid,
    )
    loss = -logp
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    count = (labels != ignore_index).sum()
    return total / count.clamp(min=1)
