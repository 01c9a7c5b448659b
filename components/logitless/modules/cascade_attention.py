"""Cascade attention for packed groups: each completion attends to its prompt's keys and its own.

A packed group ``[prompt | completion 1 | ... | completion G]`` (:func:`logitless.modules.pack_groups`)
computes the prompt once, but a dense ``[S, S]`` mask makes its attention quadratic in the packed
length ``S = P + G T``: every completion's scores against every other completion are computed, then
masked. Cascade attention computes only what the mask keeps, with no ``S x S`` tensor:

- the prompt rows attend causally to the prompt (one causal attention of ``P`` tokens);
- completion ``j``'s rows attend to ``[prompt keys | completion j's keys]``, causal aligned to the
  lower right (query ``t`` sees the whole prompt and its own first ``t + 1`` tokens): a batch of
  ``B G`` attentions of ``T`` queries against ``P + T`` keys, in which the prompt's keys and values
  are broadcast to the G completions, so their gradients sum back into the one copy.

With every prompt of the batch ``P`` tokens long both run FlashAttention's causal kernels (no mask
tensor); shorter prompts (left-padded in the packing) add boolean masks of ``B P^2`` and
``B G T (P + T)`` elements that hide the padding.

torchtune's attention modules pass their ``mask`` argument through to ``_attention_call``:
:func:`enable_cascade_attention` makes that call run :func:`cascade_attention` when the mask is a
:class:`CascadeLayout`, and torchtune's own SDPA / FlexAttention dispatch for anything else.
"""

from typing import List, NamedTuple, Optional

import torch
from torch import nn
from torch.nn import functional as F


class CascadeLayout(NamedTuple):
    """Where the prompt and the completions lie in packed groups; passed as the model's ``mask``.

    Attributes:
        prompt_len (int): P, the longest prompt; prompts are right-aligned in columns ``[0, P)``.
        num_generations (int): G, completions per group, completion ``j`` in ``[P + j T, P + (j+1) T)``.
        completion_len (int): T.
        prompt_mask (Optional[torch.Tensor]): ``[B, 1, P, P]`` bool (causal, left padding hidden, a
            padding row sees itself), None when every prompt is P tokens long.
        completion_mask (Optional[torch.Tensor]): ``[B G, 1, T, P + T]`` bool, None likewise.
        flash (bool): the device runs FlashAttention (CUDA, sm >= 8.0, flash SDPA enabled); decided
            outside ``torch.compile``, which cannot trace torch's own applicability check.
    """

    prompt_len: int
    num_generations: int
    completion_len: int
    prompt_mask: Optional[torch.Tensor] = None
    completion_mask: Optional[torch.Tensor] = None
    flash: bool = False


def cascade_layout(prompt_lengths: List[int], num_generations: int, completion_len: int,
                   device: torch.device) -> CascadeLayout:
    """The :class:`CascadeLayout` of groups packed by :func:`logitless.modules.pack_groups`.

    Args:
        prompt_lengths (List[int]): the B prompts' lengths.
        num_generations (int): G.
        completion_len (int): T, the completions' (padded) length.
        device (torch.device): where the masks live.

    Returns:
        CascadeLayout: with masks only when the prompts' lengths differ.

    Example:
        >>> layout = cascade_layout([12, 12], 8, 64, torch.device("cpu"))
        >>> layout.prompt_len, layout.prompt_mask is None
        (12, True)
    """
    p, g, t = max(prompt_lengths), num_generations, completion_len
    if min(prompt_lengths) == p:
        return CascadeLayout(p, g, t, flash=flash_available(device))
    pad = p - torch.tensor(prompt_lengths, device=device)  # [B] left padding of each prompt
    col = torch.arange(p + t, device=device)
    key_valid = col[None, :] >= pad[:, None]  # [B, P + T]: not left padding
    prompt_rows = col[:p, None]
    prompt_mask = (col[None, :p] <= prompt_rows) & key_valid[:, None, :p]
    prompt_mask = prompt_mask | (col[None, :p] == prompt_rows)  # a padding row attends to itself only
    completion_mask = (col[None, :] <= p + col[:t, None]) & key_valid[:, None, :]  # [B, T, P + T]
    completion_mask = completion_mask.repeat_interleave(g, dim=0)
    return CascadeLayout(p, g, t, prompt_mask[:, None], completion_mask[:, None], flash_available(device))


def flash_available(device: torch.device) -> bool:
    """Whether SDPA may run FlashAttention on ``device`` (CUDA, sm >= 8.0, not disabled by the user)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
            and torch.backends.cuda.flash_sdp_enabled())


def cascade_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CascadeLayout,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of packed groups as their mask defines it, computing only the scores it keeps.

    Args:
        q, k, v (torch.Tensor): ``[B, H, S, D]`` with ``S = P + G T`` (keys and values already
            repeated to the query heads, as torchtune passes them).
        layout (CascadeLayout): the packing.
        dropout_p (float): attention dropout.

    Returns:
        torch.Tensor: ``[B, H, S, D]``, as SDPA with the packing's dense mask returns.

    Example:
        >>> out = cascade_attention(q, k, v, cascade_layout([16], 4, 32, q.device))  # S = 16 + 4 * 32
    """
    p, g, t = layout.prompt_len, layout.num_generations, layout.completion_len
    b, h, s, d = q.shape
    if s != p + g * t:
        raise ValueError(f"cascade attention: the packed length {s} is not prompt_len + num_generations x "
                         f"completion_len = {p} + {g} x {t}")
    prompt = F.scaled_dot_product_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], attn_mask=layout.prompt_mask,
                                            dropout_p=dropout_p, is_causal=layout.prompt_mask is None)

    def per_completion(x):  # [B, H, G T, D] -> [B G, H, T, D]
        return x[:, :, p:].unflatten(2, (g, t)).transpose(1, 2).reshape(b * g, h, t, d)

    def with_prompt(x):  # [B G, H, P + T, D]: the prompt's keys (values) before each completion's own
        shared = x[:, None, :, :p].expand(b, g, h, p, d)
        own = x[:, :, p:].unflatten(2, (g, t)).transpose(1, 2)
        return torch.cat([shared, own], dim=3).reshape(b * g, h, p + t, d)

    q_c, k_c, v_c = per_completion(q), with_prompt(k), with_prompt(v)
    if layout.completion_mask is not None:
        completions = F.scaled_dot_product_attention(q_c, k_c, v_c, attn_mask=layout.completion_mask,
                                                     dropout_p=dropout_p)
    else:
        completions = lower_right_causal_attention(q_c, k_c, v_c, dropout_p, flash=layout.flash)
    completions = completions.reshape(b, g, h, t, d).transpose(1, 2).reshape(b, h, g * t, d)
    return torch.cat([prompt, completions], dim=2)


def lower_right_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 dropout_p: float = 0.0, flash: bool = False) -> torch.Tensor:
    """Causal attention of the last ``L`` of ``S`` positions: query ``i`` sees keys ``0 .. S - L + i``.

    FlashAttention's causal kernel where it applies: its causal mask is aligned to the lower right
    (what ``torch.nn.attention.bias.causal_lower_right`` dispatches to, called directly because
    constructing that bias inside ``torch.compile`` breaks the graph and its lengths would be guarded
    on). Elsewhere (CPU, fp32, head sizes flash does not take) SDPA with the boolean mask.

    Args:
        q (torch.Tensor): ``[N, H, L, D]``.
        k, v (torch.Tensor): ``[N, H, S, D]``, ``S >= L``.
        dropout_p (float): attention dropout.
        flash (bool): :func:`flash_available` on the tensors' device.

    Returns:
        torch.Tensor: ``[N, H, L, D]``.
    """
    length, keys = q.shape[-2], k.shape[-2]
    if flash and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal=True)[0]
    mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def enable_cascade_attention(model: nn.Module) -> int:
    """Lets every torchtune attention module of ``model`` take a :class:`CascadeLayout` as its mask.

    Idempotent; other masks (None, a tensor, a FlexAttention ``BlockMask``) go to torchtune's own
    attention call unchanged.

    Args:
        model (nn.Module): a torchtune decoder (possibly compiled, FSDP-sharded or LoRA).

    Returns:
        int: the number of attention modules that newly accept it.

    Example:
        >>> enable_cascade_attention(model)
        >>> hidden = model(packed.tokens, mask=cascade_layout(...), input_pos=packed.input_pos)
    """
    from torchtune.modules.attention import MultiHeadAttention

    enabled = 0
    for module in model.modules():
        if isinstance(module, MultiHeadAttention) and not getattr(module, "_cascade_enabled", False):
            module._attention_call = _dispatching(module._attention_call)
            module._cascade_enabled = True
            enabled += 1
    return enabled


def _dispatching(attention_call):
    def call(q, k, v, mask, dropout_p, is_causal):
        if isinstance(mask, CascadeLayout):
            return cascade_attention(q, k, v, mask, dropout_p)
        return attention_call(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)

    return call
