"""Token entropy as a loss term (e.g. an entropy bonus), computed without keeping logits."""

from typing import Optional

import torch

from logitless.losses._base import ModelOutput, TokenMeanLoss, check_num_output_chunks, label_chunks, logit_chunks
from logitless.modules import HeadInput
from logitless.ops import linear_log_probs


class EntropyWithChunkedOutputLoss(TokenMeanLoss):
    """Mean entropy of ``softmax(logits / temperature)`` over non-ignored tokens; differentiable.

    On the hidden-state path (after :meth:`set_model_output`) each chunk is projected, upcast to fp32
    and recomputed in backward; with torchtune's list of logit chunks each chunk is upcast on its own.
    Labels only select the tokens (``ignore_index`` excluded). 0.0 when every token is ignored.
    As the engine's loss (:class:`~logitless.losses._base.StepLoss`) it is a mean over tokens:
    ``normalised_loss(outputs, labels, total)`` is this micro-batch's share of the mean over
    ``total.tokens``.

    Args:
        num_output_chunks (int): chunks of the logit-list input. Default 8.
        ignore_index (int): label of the tokens to skip. Default -100.
        temperature (float): divides the logits. Default 1.0.
        impl (str): head op implementation on the hidden-state path. Default ``"chunked"``.
        chunk_size (Optional[int]): rows per chunk.
        gemm_backend (Optional[str]): the head's GEMMs under ``impl="triton"`` (``"auto"`` |
            ``"cublas"`` | ``"quack"`` | ``"triton"``); None = ``LOGITLESS_HEAD_GEMM``. YAML:
            ``loss.gemm_backend``.

    Example:
        >>> ent_fn = EntropyWithChunkedOutputLoss()
        >>> ent_fn.set_model_output(model)
        >>> bonus = -0.01 * ent_fn(model(tokens), labels)
    """

    def __init__(
        self,
        num_output_chunks: int = 8,
        ignore_index: int = -100,
        temperature: float = 1.0,
        impl: str = "chunked",
        chunk_size: Optional[int] = None,
        gemm_backend: Optional[str] = None,
    ):
        super().__init__()
        check_num_output_chunks(num_output_chunks)
        self.set_head_options(impl=impl, temperature=temperature, chunk_size=chunk_size, gemm_backend=gemm_backend)
        self.num_output_chunks, self.ignore_index = num_output_chunks, ignore_index

    def forward(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """
        Args:
            outputs: a :class:`HeadInput`, a list of logit chunks, or logits.
            labels (torch.Tensor): ``[B, S]``; tokens with ``ignore_index`` are skipped.

        Returns:
            torch.Tensor: fp32 scalar mean entropy.
        """
        return self.token_mean(outputs, labels)

    def token_mean(self, outputs: ModelOutput, labels: torch.Tensor) -> torch.Tensor:
        """The mean entropy over the non-ignored tokens (the public call and the engine's contract)."""
        count = (labels != self.ignore_index).sum().clamp(min=1)
        if isinstance(outputs, HeadInput):
            # Only the mask matters for entropy; give valid rows a harmless in-range label.
            mask_labels = torch.where(labels != self.ignore_index, 0, self.ignore_index)
            _, ent = linear_log_probs(
                outputs.hidden, outputs.weight, mask_labels, ignore_index=self.ignore_index,
                temperature=self.temperature, impl=self.impl, chunk_size=self.chunk_size,
                gemm_backend=self.gemm_backend,
            )
            return ent.sum() / count
        chunks = logit_chunks(outputs)
        total = 0.0
        for logits, target in zip(chunks, label_chunks(labels, chunks)):
            logz = (logits.float() / self.temperature).log_softmax(-1)
            ent = -(logz.exp() * logz).sum(-1)
            total = total + torch.where(target != self.ignore_index, ent, 0.0).sum()
        return total / count
