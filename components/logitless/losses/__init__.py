"""Loss components named in YAML (``loss._component_``); all follow the recipe/loss protocol:
``loss_fn.set_model_output(model)`` once, then ``loss_fn(model(tokens), labels)``."""

from logitless.losses._base import HeadLoss
from logitless.losses.ce import CEWithChunkedOutputLoss, LinearCrossEntropyLoss
from logitless.losses.entropy import EntropyWithChunkedOutputLoss
from logitless.losses.grpo import GRPOLoss
from logitless.losses.log_probs import TokenLogProbs

__all__ = [
    "HeadLoss",
    "CEWithChunkedOutputLoss",
    "LinearCrossEntropyLoss",
    "EntropyWithChunkedOutputLoss",
    "GRPOLoss",
    "TokenLogProbs",
]
