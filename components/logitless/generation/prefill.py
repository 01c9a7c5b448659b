"""Prompt prefill in chunks: a long prompt batch runs through the model in forwards of bounded size.

A one-shot prefill of ``B`` left-padded prompts of width ``W`` holds, in one forward, ``B x W``
tokens of activations and MLP intermediate and a ``(B, W, W)`` attention mask (plus SDPA's working
memory over it): at 8k-32k-token prompts that forward runs out of memory, or forces small batches,
while the decode itself would fit. :func:`prefill` runs the prompt columns in consecutive chunks
instead. Each chunk's forward writes its keys and values at its own columns of the attached
torchtune ``KVCache`` of every layer (all rows at once) and attends to the filled columns only:
every earlier column and causally within the chunk, left padding hidden (a padded query attends to
itself only, or SDPA would return NaN for it). Afterwards the caches write next at column ``W``,
as after torchtune's own ``KVCache.update`` of the whole prompt. Only the last chunk's last
position is projected to logits. Both samplers use it: the eager one on its
``P x G`` rows, the compiled one on the ``P`` distinct prompts (a group's shared prompt is still
prefilled once).

Example:
    >>> from torchtune.modules.common_utils import local_kv_cache
    >>> with local_kv_cache(model, batch_size=2, device=dev, dtype=dt, decoder_max_seq_len=width):
    ...     logits = prefill(model, tokens, input_pos=pos, prompt_mask=prompt_mask, chunk_tokens=4096)
"""

import contextlib
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from logitless.generation.trunk import decoder_hidden, last_position_logits

__all__ = ["DEFAULT_PREFILL_CHUNK_TOKENS", "causal_key_mask", "check_prefill_chunk_tokens", "prefill",
           "prefill_chunk_columns"]

#: Tokens (rows x prompt columns) per prefill forward unless set otherwise. At 8192 tokens a
#: forward's GEMMs are compute-bound on a GPU (a 1.5B model's weights are read once per 8192
#: tokens), so chunking costs little time, and the per-forward working memory stays small (7B:
#: about 0.9 GiB of MLP intermediate in bf16, and a mask of 8192 x prompt-width bytes) next to
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


class _ChunkCache(nn.Module):
    """Stands in for a layer's torchtune ``KVCache`` during one prefill chunk: ``update`` writes the
    chunk's keys and values at columns ``start .. stop-1`` of that cache and returns its first
    ``stop`` columns, so the chunk attends to the filled columns only, not to the whole cache."""

    def __init__(self, cache: nn.Module, start: int, stop: int) -> None:
        super().__init__()
        self.k_cache, self.v_cache, self.start, self.stop = cache.k_cache, cache.v_cache, start, stop

    def update(self, k_val: torch.Tensor, v_val: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self.k_cache[:, :, self.start:self.stop].copy_(k_val)
        self.v_cache[:, :, self.start:self.stop].copy_(v_val)
        return self.k_cache[:, :, :self.stop], self.v_cache[:, :, :self.stop]


@contextlib.contextmanager
def _chunk_caches(attns: List[nn.Module], start: int, stop: int) -> Iterator[None]:
    """Points every attention module at its cache's chunk ``start .. stop-1`` for one forward."""
    caches = [attn.kv_cache for attn in attns]
    try:
        for attn, cache in zip(attns, caches):
            attn.kv_cache = _ChunkCache(cache, start, stop)
        yield
    finally:
        for attn, cache in zip(attns, caches):
            attn.kv_cache = cache


def prefill(model: nn.Module, tokens: torch.Tensor, *, input_pos: torch.Tensor, prompt_mask: torch.Tensor,
            chunk_tokens: Optional[int] = DEFAULT_PREFILL_CHUNK_TOKENS,
            weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Runs left-padded prompts into the model's attached KV caches in chunks of columns.

    Every forward holds all ``B`` rows and ``c = prefill_chunk_columns(B, W, chunk_tokens)``
    columns, and attends to the filled columns ``0 .. stop-1`` of the cache only. Per forward:
    ``B x c <= max(chunk_tokens, B)`` tokens of activations and MLP intermediate, a
    ``(B, c, stop)`` mask and, where SDPA materialises them (its math backend), ``(B, heads, c,
    stop)`` attention scores; a one-shot prefill holds ``c = stop = W``. Causal attention over the
    filled columns also does half the one-shot prefill's attention work (which scores every
    query against every column, masked or not). What chunking does not change: the caches
    themselves, and torchtune's attention copying the filled K/V once per query head in each
    forward (at most ``heads / kv_heads`` times one layer's prompt cache, freed after the layer).

    Args:
        model (nn.Module): a torchtune ``TransformerDecoder`` whose attention modules have KV caches
            (torchtune ``KVCache``, at least ``W`` columns) attached, enabled and empty
            (``cache_pos`` at 0); on return they hold the prompt in columns ``0 .. W-1`` and write
            next at column ``W``.
        tokens (torch.Tensor): ``(B, W)`` left-padded prompt ids.
        input_pos (torch.Tensor): ``(B, W)`` their positions.
        prompt_mask (torch.Tensor): ``(B, W)`` bool, False at left padding.
        chunk_tokens (Optional[int]): at most this many tokens (rows x columns) per forward
            (:data:`DEFAULT_PREFILL_CHUNK_TOKENS`); None = one forward, as a plain prefill.
        weight (Optional[torch.Tensor]): ``(V, H)`` head weight; None = ``logitless.modules.head_weight``.

    Returns:
        torch.Tensor: ``(B, V)`` fp32 logits of the last prompt column.

    Raises:
        ValueError: a bad ``chunk_tokens``, a ``prompt_mask`` of another shape than ``tokens``, or a
            model without KV caches attached.

    Example:
        >>> logits = prefill(model, tokens, input_pos=pos, prompt_mask=prompt_mask, chunk_tokens=8192)
    """
    from torchtune.modules import MultiHeadAttention

    check_prefill_chunk_tokens(chunk_tokens)
    rows, width = tokens.shape
    if prompt_mask.shape != tokens.shape:
        raise ValueError(f"prompt_mask: expected the shape of tokens {tuple(tokens.shape)}, "
                         f"got {tuple(prompt_mask.shape)}")
    attns = [m for m in model.modules() if isinstance(m, MultiHeadAttention) and m.kv_cache is not None
             and m.cache_enabled]
    if not attns:
        raise ValueError("model: no KV caches attached and enabled; prefill writes the prompt into them "
                         "(set them up first, e.g. with torchtune.modules.common_utils.local_kv_cache)")
    step = prefill_chunk_columns(rows, width, chunk_tokens)
    last = (width - 1) // step * step
    for start in range(0, width, step):
        stop = min(start + step, width)
        mask = causal_key_mask(prompt_mask[:, :stop], start, stop)
        with _chunk_caches(attns, start, stop):
            if start < last:  # caches only: no norm, no head
                decoder_hidden(model, tokens[:, start:stop], input_pos=input_pos[:, start:stop], mask=mask)
            else:
                logits = last_position_logits(model, tokens[:, start:], input_pos=input_pos[:, start:], mask=mask,
                                              weight=weight)
    for attn in attns:
        attn.kv_cache.cache_pos.add_(width)  # where torchtune's KVCache.update writes next: column W
    return logits
