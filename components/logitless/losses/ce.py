"""Cross-entropy losses: torchtune's chunked CE done right, and the fused-head alternative.

Both follow the engine's loss contract (:class:`~logitless.losses._base.StepLoss`, a mean over
tokens): ``loss_fn(outputs, labels)`` is the loss of those labels (``reduction`` "mean" or "sum"),
``loss_fn.normalised_loss(outputs, labels, total)`` this micro-batch's share of the mean over the
``total.tokens`` tokens of the whole step, whatever ``reduction`` says.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from logitless.losses._base import (ModelOutput, TokenMeanLoss, as_head_input, check_num_output_chunks, label_chunks,
                                     logit_chunks)
from logitless.modules import HeadInput
from logitless.ops import _validate, linear_cross_entropy


def _reduce(total: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return total
    # Clamp: a batch whose labels are all ignored gives 0 (and zero gradients), not 0/0 = NaN.
    return total / (labels != ignore_index).sum().clamp(min=1)


class CEWithChunkedOutputLoss(TokenMeanLoss):
    """Drop-in for torchtune's ``CEWithChunkedOutputLoss`` that never keeps logits for backward.

    Given torchtune's list of logit chunks it behaves like torchtune's loss (each chunk upcast to fp32
    before its softmax) except that an all-ignored batch gives 0.0 instead of NaN. Paired with our
    wrapper through :meth:`set_model_output`, the model returns its final hidden states and this loss
    projects them chunk by chunk with :func:`logitless.linear_cross_entropy` (``impl="chunked"``),
    computing the gradients during the forward: no chunk of logits survives to the backward.

    Args:
        num_output_chunks (int): chunks of torchtune's list input. Default 8.
        ignore_index (int): label without loss. Default -100.
        reduction (str): ``"mean"`` over non-ignored tokens or ``"sum"``. Default ``"mean"``.
        chunk_size (Optional[int]): rows per chunk on the hidden-state path (default: 1 GiB budget).

    Example:
        >>> loss_fn = CEWithChunkedOutputLoss()
        >>> loss_fn.set_model_output(model)
        >>> loss = loss_fn(model(tokens), shift_labels(labels))
    """

    def __init__(
        self,
        num_output_chunks: int = 8,
        ignore_index: int = -100,
        reduction: str = "mean",
        chunk_size: Optional[int] = None,
    ):
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        check_num_output_chunks(num_output_chunks)
        _validate.check_chunk_size(chunk_size)
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.chunk_size = chunk_size

    def compute_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed CE of one ``[N, V]`` logit chunk, upcast to fp32 (torchtune's method name)."""
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")

    def forward(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """
        Args:
            outputs: a :class:`HeadInput`, torchtune's list of ``[B, S_i, V]`` logit chunks, or logits.
            labels (torch.Tensor): ``[B, S]`` labels, already shifted.

        Returns:
            torch.Tensor: fp32 scalar loss.
        """
        return self._loss(outputs, labels, self.reduction)

    def token_mean(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """The mean over the non-ignored tokens (the engine's contract, any ``reduction``)."""
        return self._loss(outputs, labels, "mean")

    def _loss(self, outputs: ModelOutput, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        if isinstance(outputs, HeadInput):
            return linear_cross_entropy(
                outputs.hidden, outputs.weight, labels, ignore_index=self.ignore_index,
                reduction=reduction, impl="chunked", chunk_size=self.chunk_size,
            )
        chunks = logit_chunks(outputs)
        total = sum(
            self.compute_cross_entropy(logits, target)
            for logits, target in zip(chunks, label_chunks(labels, chunks))
        )
        return _reduce(total, labels, self.ignore_index, reduction)


class LinearCrossEntropyLoss(TokenMeanLoss):
    """Cross-entropy fused with the output projection (``loss._component_`` for the fused head).

    Args:
        impl (str): ``"auto"`` (Triton on CUDA, chunked on CPU), ``"triton"``, ``"chunked"``, ``"reference"``.
        ignore_index (int): label without loss. Default -100.
        reduction (str): ``"mean"`` over non-ignored tokens or ``"sum"``. Default ``"mean"``.
        temperature (float): divides the logits. Default 1.0.
        chunk_size (Optional[int]): rows per chunk for ``impl="chunked"``.
        gemm_backend (Optional[str]): the head's GEMMs under ``impl="triton"`` (``"auto"`` |
            ``"cublas"`` | ``"quack"`` | ``"triton"``); None = ``LOGITLESS_HEAD_GEMM``. YAML:
            ``loss.gemm_backend``.
        num_output_chunks (Optional[int]): accepted and ignored, so that a config written for
            ``CEWithChunkedOutputLoss`` switches to this loss with the single override
            ``loss._component_=logitless.losses.LinearCrossEntropyLoss``; the fused head sizes its
            own chunks from a memory budget.

    Example:
        >>> loss_fn = LinearCrossEntropyLoss(impl="triton")
        >>> loss_fn.set_model_output(model)
        >>> loss = loss_fn(model(tokens), labels)
    """

    def __init__(
        self,
        impl: str = "auto",
        ignore_index: int = -100,
        reduction: str = "mean",
        temperature: float = 1.0,
        chunk_size: Optional[int] = None,
        gemm_backend: Optional[str] = None,
        num_output_chunks: Optional[int] = None,
    ):
        super().__init__()
        del num_output_chunks  # see the docstring: config compatibility only
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.set_head_options(impl=impl, temperature=temperature, chunk_size=chunk_size, gemm_backend=gemm_backend)
        self.ignore_index, self.reduction = ignore_index, reduction

    def forward(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """
        Args:
            outputs (HeadInput): the model's final hidden states and head weight.
            labels (torch.Tensor): ``[B, S]`` labels, already shifted.

        Returns:
            torch.Tensor: fp32 scalar loss.
        """
        return self._loss(outputs, labels, self.reduction)

    def token_mean(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """The mean over the non-ignored tokens (the engine's contract, any ``reduction``)."""
        return self._loss(outputs, labels, "mean")

    def _loss(self, outputs: ModelOutput, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        head = as_head_input(outputs, type(self).__name__)
        return linear_cross_entropy(
            head.hidden, head.weight, labels, ignore_index=self.ignore_index,
            reduction=reduction, temperature=self.temperature, impl=self.impl,
            chunk_size=self.chunk_size, gemm_backend=self.gemm_backend,
        )
