"""The recipe/loss protocol shared by every loss component.

A recipe calls ``loss_fn.set_model_output(model)`` once, then ``loss_fn(model(tokens), labels)`` each
step, and never branches on the loss class: the loss decides what the model returns.
"""

from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from logitless.modules import HeadInput, unwrap_compiled, wrap_output_head

ModelOutput = Union[HeadInput, torch.Tensor, Sequence[torch.Tensor]]


class HeadLoss(nn.Module):
    """Base class of the loss components: knows which output mode it wants from the model.

    Subclasses set ``output_mode`` (``"hidden"`` or ``"logit_chunks"``) and implement ``forward``.
    """

    output_mode: str = "hidden"
    num_output_chunks: Optional[int] = None

    def set_model_output(self, model: nn.Module) -> nn.Module:
        """Wraps ``model`` (if needed) and sets what its forward returns for this loss.

        Args:
            model (nn.Module): a torchtune ``TransformerDecoder`` (possibly wrapped by torch.compile).

        Returns:
            nn.Module: the same model object.
        """
        inner = wrap_output_head(unwrap_compiled(model))
        inner.set_output_mode(self.output_mode, self.num_output_chunks)
        return model


def as_head_input(outputs: ModelOutput, loss_name: str) -> HeadInput:
    """Checks that the model returned hidden states (output mode ``"hidden"``)."""
    if isinstance(outputs, HeadInput):
        return outputs
    raise ValueError(
        f"{loss_name} needs the model's final hidden states (a logitless.modules.HeadInput), got "
        f"{type(outputs).__name__}; call loss_fn.set_model_output(model) before the forward"
    )


def logit_chunks(outputs: ModelOutput) -> List[torch.Tensor]:
    """Model logits as a list of ``[N_i, V]`` chunks (accepts one tensor or torchtune's list)."""
    chunks = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    return [c.reshape(-1, c.shape[-1]) for c in chunks]


def label_chunks(labels: torch.Tensor, chunks: List[torch.Tensor]) -> List[torch.Tensor]:
    """Splits ``[B, S]`` labels the way torchtune chunks logits (``chunk`` along the sequence)."""
    if len(chunks) == 1:
        return [labels.reshape(-1)]
    pieces = [c.reshape(-1) for c in labels.chunk(len(chunks), dim=-1)]
    if [p.numel() for p in pieces] != [c.shape[0] for c in chunks]:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not match the {len(chunks)} logit chunks of "
            f"{[c.shape[0] for c in chunks]} rows"
        )
    return pieces
