"""Loss components named in YAML (``loss._component_``); all follow the recipe/loss protocol:
``loss_fn.set_model_output(model)`` once, then ``loss_fn(model(tokens), labels)``. The training
engine calls the losses through their contract, :class:`StepLoss` (``loss_units`` and
``normalised_loss`` -> :class:`LossOutput`, normalised by the step's global :class:`LossUnits`)."""

from logitless.losses._base import HeadLoss, LossOutput, LossUnits, StepLoss, TokenMeanLoss
from logitless.losses.ce import CEWithChunkedOutputLoss, LinearCrossEntropyLoss
from logitless.losses.entropy import EntropyWithChunkedOutputLoss
from logitless.losses.grpo import GRPOLoss
from logitless.losses.log_probs import TokenLogProbs

__all__ = [
    "HeadLoss",
    "LossOutput",
    "LossUnits",
    "StepLoss",
    "TokenMeanLoss",
    "CEWithChunkedOutputLoss",
    "LinearCrossEntropyLoss",
    "EntropyWithChunkedOutputLoss",
    "GRPOLoss",
    "TokenLogProbs",
]
