"""From sampled groups to the tensors of a training forward (policy, old and reference passes).

Each row is ``[left-padded prompt | completion | right padding]``. The labels are the completion
tokens shifted by one (``logitless.modules.shift_labels``) and ``ignore_index`` everywhere else, so
a head loss computes log-probs exactly at the positions that predict completion tokens and nowhere
else, without slicing any logits.
"""

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from logitless.rl.generation import Rollout


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
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: Optional[torch.Tensor]
    input_pos: Optional[torch.Tensor]
    truncated: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, stop: int) -> "PolicyBatch":
        """Rows ``start:stop`` (a micro-batch)."""
        pick = lambda t: None if t is None else t[start:stop]  # noqa: E731
        return PolicyBatch(pick(self.tokens), pick(self.labels), pick(self.mask), pick(self.input_pos),
                           pick(self.truncated))

    def micro_batches(self, size: int) -> Iterator["PolicyBatch"]:
        """Consecutive micro-batches of ``size`` rows; ``len(self)`` must be divisible by ``size``."""
        if size < 1 or len(self) % size != 0:
            raise ValueError(f"micro-batch size must divide the batch of {len(self)} rows, got {size}")
        for start in range(0, len(self), size):
            yield self.slice(start, start + size)


def policy_batch(rollout: Rollout, ignore_index: int = -100) -> PolicyBatch:
    """Builds the training inputs of a rollout.

    Args:
        rollout (Rollout): from :func:`logitless.rl.generation.generate`.
        ignore_index (int): label of positions without a log-prob.

    Returns:
        PolicyBatch: tokens, shifted labels, mask/positions, truncation flags.

    Example:
        >>> from logitless.rl.generation import Rollout
        >>> r = Rollout(torch.tensor([[0, 5]]), torch.tensor([[False, True]]), torch.tensor([[7, 2]]),
        ...             torch.tensor([[True, True]]), torch.tensor([False]), torch.zeros(1, 2), 1)
        >>> policy_batch(r).labels.tolist()
        [[-100, 7, 2, -100]]
    """
    from logitless.modules import shift_labels

    tokens = torch.cat([rollout.prompt_tokens, rollout.completion_tokens], dim=1)
    n, s = tokens.shape
    p = rollout.prompt_tokens.shape[1]
    targets = torch.full_like(tokens, ignore_index)
    targets[:, p:] = torch.where(rollout.completion_mask, rollout.completion_tokens,
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
    return PolicyBatch(tokens, labels, mask, input_pos, rollout.truncated.clone())


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
    inner = getattr(model, "_orig_mod", model)
    if inner.caches_are_setup():
        raise RuntimeError("the model still has KV caches set up; training forwards need them deleted "
                           "(torchtune.modules.common_utils.delete_kv_caches) to stay causal")
    return model(batch.tokens, mask=batch.mask, input_pos=batch.input_pos)
