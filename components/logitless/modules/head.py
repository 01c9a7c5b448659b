"""What the model hands to the loss: logits, logit chunks, or the final hidden states and head weight.

:func:`wrap_output_head` turns any torchtune ``TransformerDecoder`` into one whose output is chosen by
:meth:`set_output_mode`. It swaps the instance's class for a subclass (as FSDP2's ``fully_shard``
does), so parameters, state-dict keys and checkpoints are untouched and torchtune's checkpointers,
sharding and activation checkpointing keep working.
"""

import contextlib
from typing import Iterator, List, NamedTuple, Optional, Union

import torch
from torch import nn
from torchtune.modules import TiedLinear

OUTPUT_MODES = ("logits", "logit_chunks", "hidden")


class HeadInput(NamedTuple):
    """The final normed hidden states and the head weight, for a loss that projects them itself.

    Attributes:
        hidden (torch.Tensor): ``[B, S, H]`` output of the decoder's final norm.
        weight (torch.Tensor): ``[V, H]`` effective head weight (tied, untied or LoRA-merged).
    """

    hidden: torch.Tensor
    weight: torch.Tensor


def head_weight(model: nn.Module) -> torch.Tensor:
    """The ``[V, H]`` weight that the decoder's output projection applies, differentiably.

    Handles ``nn.Linear`` (untied), torchtune's ``TiedLinear`` (Qwen2.5 0.5B-3B, Llama 3.2: the
    embedding's weight) and ``LoRALinear`` heads (``W + alpha / rank * B @ A``; the merge is in the
    weight's dtype, gradients reach ``A`` and ``B`` exactly). A weight that is a sharded ``DTensor``
    (FSDP2, called outside the model's forward) is gathered with a differentiable ``full_tensor``.

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` (wrapped or not).

    Returns:
        torch.Tensor: the head weight.

    Raises:
        ValueError: for a head this cannot express as one weight (bias, DoRA, LoRA dropout in
            training), naming what to change.
    """
    head = model.output
    if isinstance(head, TiedLinear):
        weight = head.tied_module.weight
    elif hasattr(head, "lora_a") and hasattr(head, "lora_b"):
        if hasattr(head, "magnitude"):
            raise ValueError(
                "model.output is a DoRA layer, which has no single merged weight; use "
                "output mode 'logit_chunks' (CEWithChunkedOutputLoss) or apply_lora_to_output=False"
            )
        if getattr(head, "use_bias", False):
            raise ValueError("model.output has a bias; the fused head losses expect a bias-free head")
        weight = head.weight
        if not head.disabled:
            dropout = getattr(head.dropout, "p", 0.0)
            if head.training and dropout > 0:
                raise ValueError(
                    f"model.output is LoRA with dropout={dropout} in training, which a merged weight "
                    "cannot express; set lora_dropout=0.0 or apply_lora_to_output=False"
                )
            delta = head.lora_b.weight @ head.lora_a.weight
            weight = weight + (head.alpha / head.rank) * delta.to(weight.dtype)
    elif isinstance(head, nn.Linear):
        if head.bias is not None:
            raise ValueError("model.output has a bias; the fused head losses expect a bias-free head")
        weight = head.weight
    else:
        raise ValueError(
            f"model.output must be nn.Linear, TiedLinear or LoRALinear, got {type(head).__name__}"
        )
    if hasattr(weight, "full_tensor"):  # DTensor outside FSDP's unshard window
        weight = weight.full_tensor()
    return weight


class _OutputHeadMixin:
    """Output-mode behaviour mixed into a decoder's class by :func:`wrap_output_head`."""

    _logitless_mode: str = "logits"
    _logitless_chunks: int = 8

    def set_output_mode(self, mode: str, num_chunks: Optional[int] = None) -> None:
        """Chooses what ``forward`` returns.

        Args:
            mode (str): ``"logits"`` (fp32 ``[B, S, V]``, torchtune's default; used by generation),
                ``"logit_chunks"`` (list of ``num_chunks`` logit chunks split on the hidden states
                before the projection, torchtune's chunked output) or ``"hidden"`` (a
                :class:`HeadInput` for a loss that projects it itself).
            num_chunks (Optional[int]): chunks for ``"logit_chunks"``; keeps the current value if None.
        """
        if mode not in OUTPUT_MODES:
            raise ValueError(f"mode must be one of {OUTPUT_MODES}, got {mode!r}")
        if num_chunks is not None:
            if not isinstance(num_chunks, int) or num_chunks < 1:
                raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
            self._logitless_chunks = num_chunks
        self._logitless_mode = mode

    @property
    def output_mode_name(self) -> str:
        return self._logitless_mode

    @contextlib.contextmanager
    def output_mode(self, mode: str, num_chunks: Optional[int] = None) -> Iterator[None]:
        """Temporarily switches the output mode, e.g. ``with model.output_mode("logits"): generate()``."""
        previous = (self._logitless_mode, self._logitless_chunks)
        self.set_output_mode(mode, num_chunks)
        try:
            yield
        finally:
            self._logitless_mode, self._logitless_chunks = previous

    def set_num_output_chunks(self, num_output_chunks: int) -> None:
        # torchtune recipes call this for CEWithChunkedOutputLoss; map it onto our modes.
        if num_output_chunks > 0:
            self.set_output_mode("logit_chunks", num_output_chunks)
        else:
            self.set_output_mode("logits")

    @property
    def head_weight(self) -> torch.Tensor:
        return head_weight(self)

    def unembed(self, h: torch.Tensor) -> Union[torch.Tensor, List[torch.Tensor], HeadInput]:
        h = self.norm(h)
        # Decoding with KV caches always needs logits, whatever the training mode is.
        mode = "logits" if self.caches_are_enabled() else self._logitless_mode
        if mode == "hidden":
            return HeadInput(h, head_weight(self))
        if mode == "logit_chunks":
            return [self.output(chunk) for chunk in h.chunk(self._logitless_chunks, dim=1)]
        return self.output(h).float()


_WRAPPED_CLASSES = {}


def wrap_output_head(model: nn.Module) -> nn.Module:
    """Makes a torchtune ``TransformerDecoder`` return logits, logit chunks or :class:`HeadInput`.

    The model object is changed in place (its class becomes a subclass with an output mode) and
    returned; parameters and state-dict keys do not change. Wrapping twice is a no-op. Apply it before
    ``fully_shard``/``torch.compile``, as those also specialise the class.

    Args:
        model (nn.Module): a ``torchtune.modules.TransformerDecoder`` (any head: tied, untied, LoRA).

    Returns:
        nn.Module: the same object, now with ``set_output_mode``, ``output_mode`` and ``head_weight``.

    Example:
        >>> model = wrap_output_head(qwen2_5_0_5b())
        >>> model.set_output_mode("hidden")
        >>> hidden, weight = model(tokens)
    """
    if isinstance(model, _OutputHeadMixin):
        return model
    if not (hasattr(model, "unembed") and hasattr(model, "norm") and hasattr(model, "output")):
        raise ValueError(
            f"model must be a torchtune TransformerDecoder (with norm, output and unembed), "
            f"got {type(model).__name__}"
        )
    cls = type(model)
    if cls not in _WRAPPED_CLASSES:
        _WRAPPED_CLASSES[cls] = type(f"Logitless{cls.__name__}", (_OutputHeadMixin, cls), {})
    model.__class__ = _WRAPPED_CLASSES[cls]
    model._logitless_mode = "logits"
    model._logitless_chunks = max(getattr(model, "num_output_chunks", 0), 0) or 8
    if getattr(model, "num_output_chunks", 0) > 0:
        model._logitless_mode = "logit_chunks"
    return model
