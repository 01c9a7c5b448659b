"""Per-token log-probs and entropy of given tokens: the input of RL losses (GRPO, PPO, DPO)."""

from typing import Optional, Tuple

import torch

from logitless.losses._base import HeadLoss, ModelOutput, label_chunks, logit_chunks
from logitless.modules import HeadInput
from logitless.ops import linear_log_probs


class TokenLogProbs(HeadLoss):
    """``log softmax(logits / T)[label]`` and the entropy per token, never keeping the logits.

    Use the sampling temperature as ``temperature`` so that policy, old and reference log-probs match
    the distribution the completions were drawn from. Positions labelled ``ignore_index`` (prompt,
    padding, tokens after EOS) give 0 and no gradient, so the labels select the completion tokens.

    Args:
        temperature (float): divides the logits before the softmax. Default 1.0.
        return_entropy (bool): also return the entropy. Default True.
        impl (str): ``"auto"``, ``"triton"``, ``"chunked"`` or ``"reference"``. Default ``"auto"``.
        ignore_index (int): label of positions to skip. Default -100.
        chunk_size (Optional[int]): rows per chunk for ``impl="chunked"``.
        gemm_backend (Optional[str]): the head's GEMMs under ``impl="triton"`` (``"auto"`` |
            ``"cublas"`` | ``"quack"`` | ``"triton"``); None = ``LOGITLESS_HEAD_GEMM``. YAML:
            ``loss.gemm_backend``.

    Example:
        >>> logprobs_fn = TokenLogProbs(temperature=0.7)
        >>> logprobs_fn.set_model_output(policy)
        >>> logp, ent = logprobs_fn(policy(tokens, mask=mask, input_pos=pos), shift_labels(targets))
    """

    def __init__(
        self,
        temperature: float = 1.0,
        return_entropy: bool = True,
        impl: str = "auto",
        ignore_index: int = -100,
        chunk_size: Optional[int] = None,
        gemm_backend: Optional[str] = None,
    ):
        super().__init__()
        self.set_head_options(impl=impl, temperature=temperature, chunk_size=chunk_size, gemm_backend=gemm_backend)
        self.return_entropy, self.ignore_index = return_entropy, ignore_index

    def forward(
        self, outputs: ModelOutput, labels: torch.Tensor
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """
        Args:
            outputs: a :class:`HeadInput` (or logits / a list of logit chunks).
            labels (torch.Tensor): ``[B, S]`` shifted labels.

        Returns:
            Tuple[torch.Tensor, Optional[torch.Tensor]]: fp32 ``[B, S]`` log-probs and entropy.
        """
        if isinstance(outputs, HeadInput):
            return linear_log_probs(
                outputs.hidden, outputs.weight, labels, ignore_index=self.ignore_index,
                temperature=self.temperature, return_entropy=self.return_entropy,
                impl=self.impl, chunk_size=self.chunk_size, gemm_backend=self.gemm_backend,
            )
        chunks = logit_chunks(outputs)
        logps, ents = [], []
        for logits, target in zip(chunks, label_chunks(labels, chunks)):
            valid = target != self.ignore_index
            logz = (logits.float() / self.temperature).log_softmax(-1)
            lp = logz.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
            logps.append(torch.where(valid, lp, 0.0))
            if self.return_entropy:
                ents.append(torch.where(valid, -(logz.exp() * logz).sum(-1), 0.0))
        logp = self._unchunk(logps, labels)
        ent = self._unchunk(ents, labels) if self.return_entropy else None
        return logp, ent

    @staticmethod
    def _unchunk(pieces, labels: torch.Tensor) -> torch.Tensor:
        if len(pieces) == 1:
            return pieces[0].reshape(labels.shape)
        lead = labels.shape[:-1]
        return torch.cat([p.reshape(*lead, -1) for p in pieces], dim=-1)
