"""Prompt prefill in chunks: a long prompt batch runs through the model in forwards of bounded size.

A one-shot prefill of ``B`` left-padded prompts of width ``W`` holds, in one forward, ``B x W``
tokens of activations and MLP intermediate and a ``(B, W, W)`` attention mask (plus SDPA's working
memory over it): at 8k-32k-token prompts that forward runs out of memory, or forces small batches,
while the decode itself would fit. :func:`prefill` runs the prompt columns in consecutive chunks
instead. Each chunk's forward writes its keys and values into the attached KV caches (torchtune's
``KVCache.update`` writes at ``cache_pos`` and advances it, so consecutive chunks fill consecutive
columns of every row) and attends to every earlier column and causally within the chunk, left
padding hidden (a padded query attends to itself only, or SDPA would return NaN for it). Only the
last chunk's last position is projected to logits. Both samplers use it: the eager one on its
``P x G`` rows, the compiled one on the ``P`` distinct prompts (a group's shared prompt is still
prefilled once).

Example:
    >>> from torchtune.modules.common_utils import local_kv_cache
    >>> with local_kv_cache(model, batch_size=2, device=dev, dtype=dt, decoder_max_seq_len=width):
    ...     logits = prefill(model, tokens, input_pos=pos, key_valid=prompt_mask, chunk_tokens=4096)
"""

from typing import Optional

import torch
from torch import nn

from logitless.rl.rollout.trunk import decoder_hidden, last_position_logits

__all__ = ["DEFAULT_PREFILL_CHUNK_TOKENS", "causal_key_mask", "check_prefill_chunk_tokens", "prefill",
           "prefill_chunk_columns"]

#: Tokens (rows x prompt columns) per prefill forward unless set otherwise. At 8192 tokens a
#: forward's GEMMs are compute-bound on a GPU (a 1.5B model's weights are read once per 8192
#: tokens), so chunking costs little time, and the per-forward working memory stays small (7B:
#: about 0.9 GiB of MLP intermediate in bf16, and a mask of 8192 x cache-length bytes) next to
#: the KV cache of a long prompt. Prompt batches up to 8192 tokens, e.g. configs/qwen_grpo.yaml's
#: 8 prompts of at most 512 tokens prefilled once per group, keep their single forward and their
#: numbers.
DEFAULT_PREFILL_CHUNK_TOKENS = 8192


def check_prefill_chunk_tokens(value, name: str = "prefill_chunk_tokens") -> None:
    """Raises ValueError unless ``value`` is None or an int >= 1.

    Args:
        value: the setting.
        name (str): what to call it in the message (an argument or a YAML key).

    Raises:
        ValueError: naming ``name``, the value and what was expected.

    Example:
        >>> check_prefill_chunk_tokens(8192)
    """
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (tokens per prefill forward) or None/null (one forward "
                         f"for the whole prompt batch), got {value!r}")


def prefill_chunk_columns(rows: int, width: int, chunk_tokens: Optional[int]) -> int:
    """Prompt columns per prefill forward: every row, ``chunk_tokens // rows`` columns (at least one).

    All rows go into every forward, so the KV caches are written as torchtune's ``KVCache.update``
    writes them (every row at the shared ``cache_pos``). When ``rows > chunk_tokens`` a forward
    holds one column of every row: as many tokens as each decode step runs anyway.

    Args:
        rows (int): prompts in the batch.
        width (int): their padded width.
        chunk_tokens (Optional[int]): tokens per forward; None = the whole width at once.

    Returns:
        int: columns per forward, in ``[1, width]``.

    Example:
        >>> prefill_chunk_columns(4, 32768, 8192)
        2048
    """
    if chunk_tokens is None:
        return width
    return max(1, min(width, chunk_tokens // rows))


def causal_key_mask(key_valid: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The attention mask of query columns ``start .. stop-1`` over every cache column.

    Query column ``q`` attends to column ``j`` when ``j <= q`` and ``key_valid[:, j]`` (left padding
    and unfilled columns hidden); a query whose own column is hidden (padding) attends to itself
    only, or SDPA would return NaN for it.

    Args:
        key_valid (torch.Tensor): ``(B, L)`` bool, which cache columns hold real tokens.
        start (int): first query column.
        stop (int): one past the last query column.

    Returns:
        torch.Tensor: ``(B, stop - start, L)`` bool, as torchtune's layers take it.

    Example:
        >>> causal_key_mask(torch.tensor([[False, True, True]]), 0, 3).int()
        tensor([[[1, 0, 0],
                 [0, 1, 0],
                 [0, 1, 1]]], dtype=torch.int32)
    """
    columns = torch.arange(key_valid.shape[1], device=key_valid.device)
    queries = torch.arange(start, stop, device=key_valid.device)[:, None]
    return (key_valid[:, None, :] & (columns <= queries)) | (columns == queries)


def prefill(model: nn.Module, tokens: torch.Tensor, *, input_pos: torch.Tensor, key_valid: torch.Tensor,
            chunk_tokens: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS,
            weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Runs left-padded prompts through the model's attached KV caches in chunks of columns.

    Every forward holds all ``B`` rows and ``c = prefill_chunk_columns(B, W, chunk_tokens)``
    columns, so per forward: ``B x c <= max(chunk_tokens, B)`` tokens of activations and MLP
    intermediate, a ``(B, c, L)`` mask (``L``: cache length) and, where SDPA materialises them
    (its math backend), ``(B, heads, c, L)`` attention scores; a one-shot prefill holds ``c = W``.
    What chunking does not change: the caches themselves, and torchtune's attention copying a
    layer's cached K/V once per query head for each forward (``heads / kv_heads`` times that
    layer's cache, freed after the layer).

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` whose attention modules have KV caches
            attached and enabled, written from column 0 (``cache_pos`` starting at 0).
        tokens (torch.Tensor): ``(B, W)`` left-padded prompt ids.
        input_pos (torch.Tensor): ``(B, W)`` their positions.
        key_valid (torch.Tensor): ``(B, L)`` bool, ``L >= W`` the caches' length: the prompt's
            padding mask in columns ``< W`` (later columns are never attended by the prompt).
        chunk_tokens (Optional[int]): at most this many tokens (rows x columns) per forward
            (:data:`DEFAULT_PREFILL_CHUNK_TOKENS`); None = one forward, as a plain prefill.
        weight (Optional[torch.Tensor]): ``(V, H)`` head weight; None = ``logitless.modules.head_weight``.

    Returns:
        torch.Tensor: ``(B, V)`` fp32 logits of the last prompt column.

    Raises:
        ValueError: a bad ``chunk_tokens``, or a ``key_valid`` narrower than the prompts.

    Example:
        >>> logits = prefill(model, tokens, input_pos=pos, key_valid=prompt_mask, chunk_tokens=8192)
    """
    check_prefill_chunk_tokens(chunk_tokens)
    rows, width = tokens.shape
    if key_valid.shape[0] != rows or key_valid.shape[1] < width:
        raise ValueError(f"key_valid: expected ({rows}, >= {width}) for prompts of shape {tuple(tokens.shape)}, "
                         f"got {tuple(key_valid.shape)}")
    step = prefill_chunk_columns(rows, width, chunk_tokens)
    for start in range(0, width - step, step):  # every chunk but the last: caches only, no head
        stop = start + step
        decoder_hidden(model, tokens[:, start:stop], input_pos=input_pos[:, start:stop],
                       mask=causal_key_mask(key_valid, start, stop))
    start = (width - 1) // step * step
    return last_position_logits(model, tokens[:, start:], input_pos=input_pos[:, start:],
                                mask=causal_key_mask(key_valid, start, width), weight=weight)
