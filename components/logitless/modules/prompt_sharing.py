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
        tokens (torch.Tensor): ``[B, S]`` packed token ids (``pad_id`` after the last completion).
        input_pos (torch.Tensor): ``[B, S]`` positions: ``0..Lp-1`` on the prompt, ``Lp..`` again on
            every completion.
        mask (torch.Tensor): ``[B, S, S]`` bool, True where row i may attend to column j.
        predict_rows (torch.Tensor): ``[B, G, Lc]`` row of ``tokens`` whose output predicts each
            completion token.
        targets (torch.Tensor): ``[B, G, Lc]`` completion tokens, ``ignore_index`` at padding.
    """

    tokens: torch.Tensor
    input_pos: torch.Tensor
    mask: torch.Tensor
    predict_rows: torch.Tensor
    targets: torch.Tensor


def pack_groups(
    prompts: List[torch.Tensor],
    completions: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    pad_id: int = 0,
    ignore_index: int = -100,
    seq_len: Optional[int] = None,
) -> SharedPromptBatch:
    """Packs each group's prompt once, followed by its G completions.

    Args:
        prompts (List[torch.Tensor]): B unpadded 1-D prompts (each at least one token).
        completions (torch.Tensor): ``[B, G, Lc]`` completion tokens, right-padded.
        completion_mask (torch.Tensor): ``[B, G, Lc]`` bool, True on real completion tokens (a prefix
            of each row).
        pad_id (int): token id written at padding positions.
        ignore_index (int): target value at padded completion positions.
        seq_len (Optional[int]): packed length; default ``max(Lp) + G * Lc``.

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
    need = max(p.numel() for p in prompts) + g * lc
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
        tokens[i, :lp] = prompt.to(device)
        input_pos[i, :lp] = torch.arange(lp, device=device)
        segment[i, :lp] = -1
        for j in range(g):
            start = lp + j * lc
            tokens[i, start : start + lc] = completions[i, j]
            input_pos[i, start : start + lc] = lp + ar
            segment[i, start : start + lc] = j
            # token k of completion j is predicted by the row before it; k = 0 by the prompt's last row
            predict_rows[i, j] = torch.where(ar == 0, lp - 1, start + ar - 1)
    row_seg, col_seg = segment.unsqueeze(2), segment.unsqueeze(1)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    sees = (col_seg == -1) | ((row_seg == col_seg) & (row_seg < g))
    mask = causal & sees
    # Padding rows attend to themselves only, so that no softmax row is empty (NaN).
    mask |= torch.eye(seq_len, dtype=torch.bool, device=device) & (row_seg == g)
    targets = torch.where(completion_mask, completions, torch.full_like(completions, ignore_index))
    return SharedPromptBatch(tokens, input_pos, mask, predict_rows, targets)


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
