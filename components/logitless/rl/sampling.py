"""Next-token sampling from one row of logits per sequence: temperature, top-k, top-p, greedy."""

from typing import Optional, Tuple

import torch


def check_sampling_args(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Raises ValueError naming the argument when a sampling setting is out of range.

    Args:
        temperature (float): >= 0 (0 means greedy).
        top_k (Optional[int]): None or >= 1.
        top_p (Optional[float]): None or in (0, 1].
    """
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (0 < float(top_p) <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row and returns it with its log-probability.

    The log-probability is that of the full tempered distribution ``log_softmax(logits / T)``
    (what the training path computes), not of the top-k/top-p truncated one; with
    ``temperature == 0`` the argmax is taken and the log-probability is at ``T = 1``.

    Args:
        logits (torch.Tensor): ``(B, V)`` scores of the next token (any float dtype; upcast here).
        temperature (float): divides the logits; 0 = greedy.
        top_k (Optional[int]): keep the k most likely tokens.
        top_p (Optional[float]): keep the smallest set whose probability reaches ``top_p``.
        generator (Optional[torch.Generator]): random source (on the logits' device).

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: tokens ``(B,)`` int64 and log-probs ``(B,)`` fp32.

    Example:
        >>> tok, lp = sample_next(torch.tensor([[0.0, 5.0, 1.0]]), temperature=0)
        >>> tok.tolist()
        [1]
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = scaled
    if top_k is not None and top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked strictly above it already reach top_p
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(filtered, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
