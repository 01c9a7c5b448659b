"""The SFT objective: forward, label shift that respects packing, and the loss contract."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict

import torch
from torch import nn

from logitless.losses._base import LossOutput, LossUnits, StepLoss
from logitless.training.step import StepObjective


class SFTObjective(StepObjective):
    """Next-token loss of a micro-batch for :class:`~logitless.training.TrainStep`.

    Calls the loss only through its contract (:class:`~logitless.losses.StepLoss`):
    ``loss_fn.set_model_output(model)`` once (done here), then per micro-batch
    ``loss_fn.loss_units(labels)`` and ``loss_fn.normalised_loss(model_outputs, labels, total)``.
    Labels are shifted with ``logitless.modules.shift_labels(labels, ignore_index,
    input_pos=batch.get("input_pos"))`` so a packed batch never predicts across a document boundary.
    The step's loss is the mean over every non-ignored label of the step, whatever the loss's
    ``reduction`` (which only affects its public call).

    Args:
        model (nn.Module): the decoder (wrapped by the loss if needed).
        loss_fn (StepLoss): a logitless loss component (``logitless.losses``).
        ignore_index (int): label value that is ignored (defaults to ``loss_fn.ignore_index`` or -100).
        activations (ContextManager): entered around the model's forward only, not the loss: torchtune's
            activation offloading (``training.get_act_offloading_ctx_manager``), as its recipes use it.

    Raises:
        TypeError: ``loss_fn`` is not a :class:`~logitless.losses.StepLoss`.

    Example:
        >>> obj = SFTObjective(model, LinearCrossEntropyLoss())
        >>> step([mb1, mb2], obj)
    """

    def __init__(self, model: nn.Module, loss_fn: StepLoss, ignore_index: int | None = None,
                 activations: ContextManager = contextlib.nullcontext()):
        if not isinstance(loss_fn, StepLoss):
            raise TypeError(
                f"loss: {type(loss_fn).__module__}.{type(loss_fn).__qualname__} does not follow the logitless "
                "loss protocol: expected a logitless.losses.StepLoss (set_model_output, loss_units, "
                "normalised_loss), such as logitless.losses.LinearCrossEntropyLoss"
            )
        self.model, self.loss_fn, self.activations = model, loss_fn, activations
        self.ignore_index = ignore_index if ignore_index is not None else getattr(loss_fn, "ignore_index", -100)
        reduction = getattr(loss_fn, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"loss.reduction: expected 'mean' or 'sum', got {reduction!r}")
        loss_fn.set_model_output(model)

    def labels(self, batch: Dict[str, Any]) -> torch.Tensor:
        from logitless.modules import shift_labels

        return shift_labels(batch["labels"], self.ignore_index, input_pos=batch.get("input_pos"))

    def units(self, batch: Dict[str, Any]) -> LossUnits:
        """The micro-batch's counts (its non-ignored shifted labels, rows, 1)."""
        return self.loss_fn.loss_units(self.labels(batch))

    def __call__(self, batch: Dict[str, Any], total: LossUnits) -> LossOutput:
        """Forward and the micro-batch's share of the mean over the ``total.tokens`` labels of the step."""
        labels = self.labels(batch)
        kwargs = {k: batch[k] for k in ("mask", "input_pos") if batch.get(k) is not None}
        with self.activations:
            outputs = self.model(batch["tokens"], **kwargs)
        return self.loss_fn.normalised_loss(outputs, labels, total)
