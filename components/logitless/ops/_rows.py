"""Ignored rows never reach arithmetic: the zeroing every head implementation applies.

A NaN or inf in the hidden state of a row whose label is ignored must not change anything, but
``0 * NaN = NaN``: a zero gradient row times that hidden row inside the dW GEMM poisons all of dW,
and the softmax backward turns the row's own NaN logits into a NaN dh row even under a zero
upstream. Multiplying by a mask cannot help; the rows are zeroed (``torch.where``) before the GEMMs,
or, in the fused head, compacted away.
"""

from typing import Optional

import torch


def has_ignored_rows(valid: torch.Tensor, n_valid: Optional[int] = None) -> bool:
    """Whether some rows are ignored, so that their hidden states must be zeroed before any GEMM.

    Args:
        valid (torch.Tensor): bool, the non-ignored rows (any shape).
        n_valid (Optional[int]): their count when the caller has read it (validation's host sync);
            None: read here (one host sync), or assumed "some are ignored" while ``torch.compile``
            traces (no sync in a graph).

    Returns:
        bool: True unless every row is known to be valid (then nothing is copied).

    Example:
        >>> has_ignored_rows(torch.tensor([True, False]))
        True
    """
    if n_valid is not None:
        return n_valid != valid.numel()
    if torch.compiler.is_compiling():
        return True
    return not bool(valid.all())


def zero_ignored_rows(hidden: torch.Tensor, valid: torch.Tensor, mask: bool = True) -> torch.Tensor:
    """``hidden`` with the rows where ``valid`` is False set to 0 (a copy), or ``hidden`` itself.

    Args:
        hidden (torch.Tensor): ``(..., H)``.
        valid (torch.Tensor): ``hidden.shape[:-1]`` bool.
        mask (bool): False returns ``hidden`` untouched (no row ignored: the fast path).

    Returns:
        torch.Tensor: same shape and dtype as ``hidden``.

    Example:
        >>> zero_ignored_rows(torch.full((2, 3), float("nan")), torch.tensor([True, False]))[1]
        tensor([0., 0., 0.])
    """
    return torch.where(valid.unsqueeze(-1), hidden, 0.0) if mask else hidden
