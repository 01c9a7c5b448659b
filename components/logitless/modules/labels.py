"""The ignore-index label shift that replaces slicing the logits."""

from typing import Optional

import torch


def shift_labels(
    labels: torch.Tensor, ignore_index: int = -100, input_pos: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Aligns labels with the positions that predict them: ``out[..., t] = labels[..., t + 1]``.

    The last position gets ``ignore_index`` instead of the logits being sliced, so no ``[B, S-1, V]``
    copy is ever made. In a packed batch (torchtune's ``PackedDataset``), ``input_pos`` restarts at 0
    at each document, and the last token of a document must not be trained to predict the first token
    of the next: those positions get ``ignore_index`` too.

    Args:
        labels (torch.Tensor): ``[..., S]`` integer labels (already masked with ``ignore_index``).
        ignore_index (int): value of a label without loss.
        input_pos (Optional[torch.Tensor]): ``[..., S]`` per-token positions of a packed batch.

    Returns:
        torch.Tensor: the shifted labels, same shape and dtype.

    Example:
        >>> shift_labels(torch.tensor([[5, 6, 7, 8]]), input_pos=torch.tensor([[0, 1, 0, 1]]))
        tensor([[   6, -100,    8, -100]])
    """
    if input_pos is not None and input_pos.shape != labels.shape:
        raise ValueError(
            f"input_pos must have the shape of labels {tuple(labels.shape)}, got {tuple(input_pos.shape)}"
        )
    shifted = torch.full_like(labels, ignore_index)
    nxt = labels[..., 1:]
    if input_pos is not None:
        nxt = torch.where(input_pos[..., 1:] == 0, torch.full_like(nxt, ignore_index), nxt)
    shifted[..., :-1] = nxt
    return shifted
