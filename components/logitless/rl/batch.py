"""From sampled groups to the tensors of a training forward (policy, old and reference passes).

Each row is ``[left-padded prompt | completion | right padding]``. The labels are the completion
tokens shifted by one (``logitless.modules.shift_labels``) and ``ignore_index`` everywhere else, so
a head loss computes log-probs exactly at the positions that predict completion tokens and nowhere
else, without slicing any logits.

Response-only head: :meth:`PolicyBatch.forward` keeps only the hidden rows ``P-1 .. P+T-2`` (those
that predict the T completion tokens), aligned with :attr:`PolicyBatch.head_labels` ``(N, T)``, so
the head never runs on prompt positions. :mod:`logitless.rl.shared_batch` gives the same layout
with each prompt computed once per group.
"""

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from logitless.modules import HeadInput, unwrap_compiled
from logitless.generation.result import Rollout


@dataclass
class PolicyBatch:
    """Inputs of one training forward over completed groups.

    Attributes:
        tokens (torch.Tensor): ``(N, S)`` int64 prompt + completion tokens.
        labels (torch.Tensor): ``(N, S)`` int64 shifted labels: the next completion token at the
            positions that predict one, ``ignore_index`` elsewhere.
        mask (Optional[torch.Tensor]): ``(N, S, S)`` bool attention mask (causal, padding hidden),
            or None when no row has left padding (then the model's own causal path is used).
        input_pos (Optional[torch.Tensor]): ``(N, S)`` position ids (0 at each first real token),
            or None with ``mask``.
        truncated (torch.Tensor): ``(N,)`` bool, completions that hit the length limit.
        prompt_len (Optional[int]): P, the (padded) prompt width; completions fill ``tokens[:, P:]``.
            None: the head runs on every position (labels of the whole sequence).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: Optional[torch.Tensor]
    input_pos: Optional[torch.Tensor]
    truncated: torch.Tensor
    prompt_len: Optional[int] = None

    @property
    def head_span(self) -> slice:
        """Positions whose hidden state goes through the head: those predicting completion tokens."""
        if self.prompt_len is None:
            return slice(0, self.tokens.shape[1])
        return slice(self.prompt_len - 1, self.tokens.shape[1] - 1)

    @property
    def head_labels(self) -> torch.Tensor:
        """``(N, T)`` labels of the response-only head (``(N, S)`` when ``prompt_len`` is None)."""
        return self.labels[:, self.head_span]

    def forward(self, model: nn.Module) -> HeadInput:
        """Response-only forward: the model's hidden states at :attr:`head_span` and its head weight.

        Args:
            model (nn.Module): the policy or reference, output mode ``hidden``.

        Returns:
            HeadInput: ``(N, T, H)`` hidden states aligned with :attr:`head_labels`.

        Example:
            >>> loss_fn.set_model_output(model)
            >>> logp = loss_fn.log_probs(batch.forward(model), batch.head_labels)  # (N, T)
        """
        out = policy_forward(model, self)
        if not isinstance(out, HeadInput):
            raise TypeError(f"the response-only head needs the model in 'hidden' output mode (a HeadInput), "
                            f"got {type(out).__name__}; call loss_fn.set_model_output(model) first")
        return HeadInput(out.hidden[:, self.head_span], out.weight)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, stop: int) -> "PolicyBatch":
        """Rows ``start:stop`` (a micro-batch)."""
        pick = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return PolicyBatch(pick(self.tokens), pick(self.labels), pick(self.mask), pick(self.input_pos),
                           pick(self.truncated), self.prompt_len)

    def micro_batches(self, size: int) -> Iterator["PolicyBatch"]:
        """Consecutive micro-batches of ``size`` rows; ``len(self)`` must be divisible by ``size``."""
        if size < 1 or len(self) % size != 0:
            raise ValueError(f"micro-batch size must divide the batch of {len(self)} rows, got {size}")
        for start in range(0, len(self), size):
            yield self.slice(start, start + size)


def policy_batch(rollout: Rollout, ignore_index: int = -100) -> PolicyBatch:
    """Builds the training inputs of a rollout.

    Args:
        rollout (Rollout): from a sampler (:mod:`logitless.generation`).
        ignore_index (int): label of positions without a log-prob.

    Returns:
        PolicyBatch: tokens, shifted labels, mask/positions, truncation flags, prompt width.

    Example:
        >>> from logitless.modules.head import HeadInput
        >>> r = Rollout(torch.tensor([[0, 5]]), torch.tensor([[False, True]]), torch.tensor([[7, 2]]),
        ...             torch.tensor([[True, True]]), torch.tensor([False]), torch.zeros(1, 2), 1)
        >>> policy_batch(r).labels.tolist()
        [[-100, 7, 2, -100]]
        >>> policy_batch(r).head_labels.tolist()
        [[7, 2]]
    """
    from logitless.modules import shift_labels

    tokens = torch.cat([rollout.prompt_tokens, rollout.completion_tokens], dim=1)
    n, s = tokens.shape
    p = rollout.prompt_tokens.shape[1]
    targets = torch.full_like(tokens, ignore_index)
    # labels only where the policy sampled the token (Rollout.loss_mask): tool and environment tokens
    # are context, attended to but never trained on
    targets[:, p:] = torch.where(rollout.loss_mask, rollout.completion_tokens,
                                 torch.full_like(rollout.completion_tokens, ignore_index))
    labels = shift_labels(targets, ignore_index=ignore_index)
    if bool(rollout.prompt_mask.all()):
        mask = input_pos = None
    else:
        valid = torch.cat([rollout.prompt_mask,
                           torch.ones_like(rollout.completion_mask, dtype=torch.bool)], dim=1)
        input_pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
        mask = causal[None] & valid[:, None, :]
        mask = mask | torch.eye(s, dtype=torch.bool, device=tokens.device)[None]
    return PolicyBatch(tokens, labels, mask, input_pos, rollout.truncated.clone(), p)


def policy_forward(model: nn.Module, batch: PolicyBatch):
    """The model's training forward on a :class:`PolicyBatch` (output as set by the loss).

    Refuses a model with KV caches set up: torchtune 0.6.1 then either decodes through the cache
    or (caches disabled, no mask) attends bidirectionally.

    Args:
        model (nn.Module): the policy (or reference) decoder.
        batch (PolicyBatch): inputs.

    Returns:
        Whatever the model returns in its current output mode (a ``HeadInput`` for GRPOLoss).
    """
    inner = unwrap_compiled(model)
    if inner.caches_are_setup():
        raise RuntimeError("the model still has KV caches set up; training forwards need them deleted "
                           "(torchtune.modules.common_utils.delete_kv_caches) to stay causal")
    return model(batch.tokens, mask=batch.mask, input_pos=batch.input_pos)
