"""What a sampler returns (:class:`Rollout`) and how prompts are batched for it (:func:`left_pad`)."""

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class Rollout:
    """The sampled completions of a batch of groups.

    Attributes:
        prompt_tokens (torch.Tensor): ``(N, P)`` int64, left-padded with ``pad_id``; N = prompts * G,
            each prompt repeated for its G generations (contiguous groups).
        prompt_mask (torch.Tensor): ``(N, P)`` bool, True at real prompt tokens.
        completion_tokens (torch.Tensor): ``(N, T)`` int64, right-padded with ``pad_id``; T is the
            longest completion (<= max_new_tokens).
        completion_mask (torch.Tensor): ``(N, T)`` bool, True up to and including the first stop token.
        truncated (torch.Tensor): ``(N,)`` bool, True where no stop token was produced.
        sampler_log_probs (torch.Tensor): ``(N, T)`` fp32 log-probs of the sampled tokens under the
            full tempered distribution of the sampler's logits, before top-k / top-p (0 where
            masked): the quantity the training path recomputes as old log-probs, so their ratio is
            the sampler-trainer mismatch alone (``GRPOLoss``'s ``sampler_correction``).
        num_generations (int): G.
        sampled_mask (Optional[torch.Tensor]): ``(N, T)`` bool, True at the tokens the policy sampled;
            False at tokens a multi-turn rollout appended (tool answers, environment messages, chat
            headers), which are context only. None: every completion token was sampled (one turn).
        trajectories (Optional[list]): per row, the conversation, environment info and counters of a
            multi-turn rollout (:class:`~logitless.generation.tools.session.Trajectory`); None for one turn.
    """

    prompt_tokens: torch.Tensor
    prompt_mask: torch.Tensor
    completion_tokens: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    sampler_log_probs: torch.Tensor
    num_generations: int
    sampled_mask: Optional[torch.Tensor] = None
    trajectories: Optional[list] = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """``(N, T)`` bool: the completion tokens the policy sampled, the only ones the loss, its
        entropy, KL and importance-weight statistics count. ``completion_mask`` itself for a
        one-turn rollout; ``completion_mask & sampled_mask`` when turns appended context tokens.

        Example:
            >>> r = Rollout(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
            ...             torch.zeros(1, 3, dtype=torch.long), torch.tensor([[True, True, True]]),
            ...             torch.tensor([False]), torch.zeros(1, 3), 1, sampled_mask=torch.tensor([[True, False, True]]))
            >>> r.loss_mask.tolist()
            [[True, False, True]]
        """
        if self.sampled_mask is None:
            return self.completion_mask
        return self.completion_mask & self.sampled_mask

    @property
    def completion_lengths(self) -> torch.Tensor:
        """``(N,)`` int64 number of completion tokens (stop token included)."""
        return self.completion_mask.sum(dim=1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device=None):
    """Left-pads token lists into a batch.

    Args:
        prompts (Sequence[Sequence[int]]): token ids, each non-empty.
        pad_id (int): filler id.
        device: where to put the tensors.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: tokens ``(B, P)`` int64 and mask ``(B, P)`` bool.

    Example:
        >>> left_pad([[5, 6], [7]], pad_id=0)[0].tolist()
        [[5, 6], [0, 7]]
    """
    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt, got an empty list")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = True
    return tokens.to(device), mask.to(device)
