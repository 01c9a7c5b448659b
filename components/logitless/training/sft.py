"""The SFT objective: forward, label shift that respects packing, and the loss protocol."""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn


class SFTObjective:
    """``batch -> mean next-token loss`` for :class:`~logitless.training.TrainStep`.

    Uses only the loss protocol of the design: ``loss_fn.set_model_output(model)`` once (done
    here), then ``loss_fn(model_outputs, shifted_labels)``. Labels are shifted with
    ``logitless.modules.shift_labels(labels, ignore_index, input_pos=batch.get("input_pos"))`` so a
    packed batch never predicts across a document boundary.

    Args:
        model (nn.Module): the decoder (wrapped by the loss if needed).
        loss_fn (nn.Module): a logitless loss component; its ``reduction`` ("mean" or "sum") is honoured.
        ignore_index (int): label value that is ignored (defaults to ``loss_fn.ignore_index`` or -100).

    Example:
        >>> obj = SFTObjective(model, LinearCrossEntropyLoss())
        >>> step([mb1, mb2], loss_fn=obj, count_fn=obj.count)
    """

    def __init__(self, model: nn.Module, loss_fn: nn.Module, ignore_index: int | None = None):
        if not hasattr(loss_fn, "set_model_output"):
            raise TypeError(
                f"loss: {type(loss_fn).__module__}.{type(loss_fn).__qualname__} does not follow the logitless "
                "loss protocol (no set_model_output); use a logitless.losses component"
            )
        self.model, self.loss_fn = model, loss_fn
        self.ignore_index = ignore_index if ignore_index is not None else getattr(loss_fn, "ignore_index", -100)
        self.reduction = getattr(loss_fn, "reduction", "mean")
        if self.reduction not in ("mean", "sum"):
            raise ValueError(f"loss.reduction: expected 'mean' or 'sum', got {self.reduction!r}")
        loss_fn.set_model_output(model)

    def labels(self, batch: Dict[str, Any]) -> torch.Tensor:
        from logitless.modules import shift_labels

        return shift_labels(batch["labels"], self.ignore_index, input_pos=batch.get("input_pos"))

    def count(self, batch: Dict[str, Any]) -> torch.Tensor:
        """Number of non-ignored (shifted) labels in ``batch``."""
        return (self.labels(batch) != self.ignore_index).sum()

    def __call__(self, batch: Dict[str, Any]) -> torch.Tensor:
        labels = self.labels(batch)
        kwargs = {k: batch[k] for k in ("mask", "input_pos") if batch.get(k) is not None}
        outputs = self.model(batch["tokens"], **kwargs)
        loss = self.loss_fn(outputs, labels)
        if self.reduction == "sum":
            loss = loss / (labels != self.ignore_index).sum().clamp(min=1)
        return loss
