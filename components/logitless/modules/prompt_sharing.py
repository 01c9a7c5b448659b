"""Prompt once per group: pack ``[prompt | completion 1 | ... | completion G]`` in one sequence.

In GRPO a group of G completions shares one prompt, yet the usual batch repeats the prompt G times.
Packed with a mask where every completion sees the whole prompt and its own past only, and with
position ids that restart after the prompt, the prompt's keys and values are computed once, and the
gradients of all G completions flow back into them. The logits that predict completion tokens are
taken only at the rows that predict them (the prompt's last row predicts the first token of every
completion), so the head never runs on prompt positions.
"""

from typing import List, NamedTuple, Optional

import torch

from logitless.modules.head import HeadInput


class SharedPromptBatch(NamedTuple):
    """A batch of groups packed with one copy of each prompt.

    Attributes:
        tokens (torch.Tensor): ``[B, S]`` packed token ids: each prompt right-aligned in the first
            ``max(Lp)`` columns (``pad_id`` before a shorter one), then the G completions, ``Lc`` columns
            each, from the same column in every row (``pad_id`` after the last one).
        input_pos (torch.Tensor): ``[B, S]`` positions: ``0..Lp-1`` on the prompt, ``Lp..`` again on
            every completion (0 on padding).
        mask (Optional[torch.Tensor]): ``[B, S, S]`` bool, True where row i may attend to column j
            (None when built with ``dense_mask=False``).
        predict_rows (torch.Tensor): ``[B, G, Lc]`` row of ``tokens`` whose output predicts each
            completion token.
        targets (torch.Tensor): ``[B, G, Lc]`` completion tokens, ``ignore_index`` at padding.
        segments (torch.Tensor): ``[B, S]`` int64 segment of every position: -1 prompt, ``0..G-1``
            completion j, G padding; the mask is a function of it (:func:`segment_mask`).
    """

    tokens: torch.Tensor
    input_pos: torch.Tensor
    mask: Optional[torch.Tensor]
    predict_rows: torch.Tensor
    targets: torch.Tensor
    segments: Optional[torch.Tensor] = None


def segment_mask(segments: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, num_generations: int,
                 batch=slice(None)) -> torch.Tensor:
    """Whether position ``q_idx`` may attend to ``kv_idx`` in a packed group (broadcasting indices).

    Causal, and a query sees the prompt and its own completion only; padding rows see themselves
    only (no empty softmax row). The dense mask of :func:`pack_groups` and the FlexAttention
    ``mask_mod`` of the flex path are both this function.

    Args:
        segments (torch.Tensor): ``[B, S]`` segment ids (:attr:`SharedPromptBatch.segments`).
        q_idx, kv_idx (torch.Tensor): query and key positions.
        num_generations (int): G (the padding segment's id).
        batch: batch index (or slice) into ``segments``.

    Returns:
        torch.Tensor: bool, the broadcast shape of the indices.
    """
    sq, skv = segments[batch, q_idx], segments[batch, kv_idx]
    sees = (skv == -1) | ((sq == skv) & (sq < num_generations))
    return ((kv_idx <= q_idx) & sees) | ((q_idx == kv_idx) & (sq == num_generations))


def pack_groups(
    prompts: List[torch.Tensor],
    completions: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    pad_id: int = 0,
    ignore_index: int = -100,
    seq_len: Optional[int] = None,
    dense_mask: bool = True,
) -> SharedPromptBatch:
    """Packs each group's prompt once, followed by its G completions.

    Args:
        prompts (List[torch.Tensor]): B unpadded 1-D prompts (each at least one token).
        completions (torch.Tensor): ``[B, G, Lc]`` completion tokens, right-padded.
        completion_mask (torch.Tensor): ``[B, G, Lc]`` bool, True on the completion tokens that get a
            target (the rest, padding or context tokens, get ``ignore_index``; attention covers every column).
        pad_id (int): token id written at padding positions.
        ignore_index (int): target value at padded completion positions.
        seq_len (Optional[int]): packed length; default ``max(Lp) + G * Lc``.
        dense_mask (bool): build the ``[B, S, S]`` mask (SDPA); False leaves it None, for the flex
            path, which builds its block mask from ``segments`` without any ``S x S`` tensor.

    Returns:
        SharedPromptBatch: tokens, positions, attention mask and the rows that predict each token.

    Example:
        >>> batch = pack_groups([prompt], completions, completion_mask)
        >>> out = model(batch.tokens, mask=batch.mask, input_pos=batch.input_pos)  # HeadInput
        >>> head = gather_predicting_rows(out, batch)
        >>> logp, ent = logitless.linear_log_probs(head.hidden, head.weight, batch.targets)
    """
    if completions.dim() != 3 or completion_mask.shape != completions.shape:
        raise ValueError(
            f"completions and completion_mask must both be [B, G, Lc], got {tuple(completions.shape)} "
            f"and {tuple(completion_mask.shape)}"
        )
    b, g, lc = completions.shape
    if len(prompts) != b:
        raise ValueError(f"prompts must hold one prompt per group ({b}), got {len(prompts)}")
    if any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("prompts must be non-empty 1-D token tensors")
    width = max(p.numel() for p in prompts)  # prompts end here, so completions share their columns
    need = width + g * lc
    seq_len = seq_len or need
    if seq_len < need:
        raise ValueError(f"seq_len must be >= longest prompt + G * Lc = {need}, got {seq_len}")
    device = completions.device
    tokens = torch.full((b, seq_len), pad_id, dtype=completions.dtype, device=device)
    input_pos = torch.zeros((b, seq_len), dtype=torch.long, device=device)
    # segment id of every column: -1 prompt, 0..G-1 completions, G padding
    segment = torch.full((b, seq_len), g, dtype=torch.long, device=device)
    predict_rows = torch.zeros((b, g, lc), dtype=torch.long, device=device)
    ar = torch.arange(lc, device=device)
    for i, prompt in enumerate(prompts):
        lp = prompt.numel()
        tokens[i, width - lp : width] = prompt.to(device)
        input_pos[i, width - lp : width] = torch.arange(lp, device=device)
        segment[i, width - lp : width] = -1
        for j in range(g):
            start = width + j * lc
            tokens[i, start : start + lc] = completions[i, j]
            input_pos[i, start : start + lc] = lp + ar
            segment[i, start : start + lc] = j
            # token k of completion j is predicted by the row before it; k = 0 by the prompt's last row
            predict_rows[i, j] = torch.where(ar == 0, width - 1, start + ar - 1)
    mask = None
    if dense_mask:
        pos = torch.arange(seq_len, device=device)
        mask = segment_mask(segment, pos[None, :, None], pos[None, None, :], g,
                            batch=torch.arange(b, device=device)[:, None, None])
    targets = torch.where(completion_mask, completions, torch.full_like(completions, ignore_index))
    return SharedPromptBatch(tokens, input_pos, mask, predict_rows, targets, segment)


def gather_predicting_rows(head: HeadInput, batch: SharedPromptBatch) -> HeadInput:
    """Keeps only the hidden rows that predict completion tokens: ``[B, G, Lc, H]``.

    The prompt's last row appears G times; autograd sums the G gradients into it.

    Args:
        head (HeadInput): the model's ``[B, S, H]`` hidden states and head weight.
        batch (SharedPromptBatch): what :func:`pack_groups` returned.

    Returns:
        HeadInput: hidden states aligned with ``batch.targets``.
    """
    b, g, lc = batch.predict_rows.shape
    index = batch.predict_rows.reshape(b, g * lc, 1).expand(-1, -1, head.hidden.shape[-1])
    hidden = head.hidden.gather(1, index).reshape(b, g, lc, -1)
    return HeadInput(hidden, head.weight)


def completion_rows(head: HeadInput, labels: torch.Tensor, ignore_index: int = -100):
    """Response-only head for an ordinary batch: the hidden rows whose label is not ignored.

    Args:
        head (HeadInput): ``[B, S, H]`` hidden states and head weight.
        labels (torch.Tensor): ``[B, S]`` shifted labels (``ignore_index`` on prompt and padding).
        ignore_index (int): label of rows to drop.

    Returns:
        Tuple[HeadInput, torch.Tensor, torch.Tensor]: ``[N, H]`` rows, their ``[N]`` labels and the
        boolean ``[B, S]`` selection, to scatter per-token results back with ``out[sel] = values``.
    """
    selected = labels != ignore_index
    return HeadInput(head.hidden[selected], head.weight), labels[selected], selected
