"""Self-attention that normalises each query and key head BEFORE the rotary embedding (Qwen3).

torchtune 0.6.1's ``MultiHeadAttention`` takes ``q_norm`` / ``k_norm`` but applies them after the
rotary embedding. Qwen3 (like Hugging Face's ``Qwen3Attention``) applies its per-head RMSNorm first:
``rope(norm(q))``. The two agree only when the norm's scale is equal on both elements of every
rotated pair, which trained Qwen3 weights are not (a rotation keeps the RMS but moves elements
across differently scaled dimensions), so a Qwen3 checkpoint run through torchtune's order gives
wrong logits. :class:`QKNormAttention` is ``MultiHeadAttention`` with the order changed and nothing
else: same parameters, state-dict keys, KV cache, masks and ``_attention_call`` (so cascade
attention, FSDP2, activation checkpointing and LoRA projections apply unchanged).
"""

from __future__ import annotations

from typing import Optional

import torch
from torchtune.modules import MultiHeadAttention

__all__ = ["QKNormAttention"]


class QKNormAttention(MultiHeadAttention):
    """``MultiHeadAttention`` whose ``q_norm`` / ``k_norm`` (required) run before ``pos_embeddings``.

    Args:
        **kwargs: ``MultiHeadAttention``'s arguments; ``q_norm`` and ``k_norm`` are modules over
            ``head_dim`` (torchtune's ``RMSNorm(head_dim)``).

    Raises:
        ValueError: when ``q_norm`` or ``k_norm`` is missing.

    Example:
        >>> attn = QKNormAttention(embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=32,
        ...                        q_proj=nn.Linear(64, 128, bias=False), k_proj=nn.Linear(64, 64, bias=False),
        ...                        v_proj=nn.Linear(64, 64, bias=False), output_proj=nn.Linear(128, 64, bias=False),
        ...                        pos_embeddings=Qwen2RotaryPositionalEmbeddings(32), q_norm=RMSNorm(32),
        ...                        k_norm=RMSNorm(32))
        >>> attn(torch.randn(2, 5, 64), torch.randn(2, 5, 64)).shape
        torch.Size([2, 5, 64])
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.q_norm is None or self.k_norm is None:
            raise ValueError("QKNormAttention: q_norm and k_norm are required (per-head norms before the rotary "
                             "embedding); use torchtune's MultiHeadAttention without them")

    def forward(self, x: torch.Tensor, y: Optional[torch.Tensor] = None, *, mask=None,
                input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Same inputs and output as ``MultiHeadAttention.forward`` (self-attention: ``y`` is ``x``,
        or None to read the KV cache only)."""
        b, s_x, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim))
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)
        q = q.transpose(1, 2)
        if y is None:
            if self.kv_cache is None or not self.cache_enabled:
                raise ValueError("Must provide y input or use kv_cache to enable streaming decoding")
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
        else:
            s_y = y.shape[1]
            k = self.k_norm(self.k_proj(y).view(b, s_y, -1, self.head_dim))
            v = self.v_proj(y).view(b, s_y, -1, self.head_dim)
            if self.pos_embeddings is not None:
                k = self.pos_embeddings(k, input_pos=input_pos)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if self.kv_cache is not None and self.cache_enabled:
                k, v = self.kv_cache.update(k, v)
        if self.num_heads != self.num_kv_heads:  # each K/V head serves num_heads // num_kv_heads query heads
            group = (b, self.num_kv_heads, self.num_heads // self.num_kv_heads, -1, self.head_dim)
            k = k.unsqueeze(2).expand(group).flatten(1, 2)
            v = v.unsqueeze(2).expand(group).flatten(1, 2)
        out = self._attention_call(q, k, v, mask=mask, dropout_p=self.attn_dropout if self.training else 0.0,
                                   is_causal=self.kv_cache is None and mask is None and self.is_causal)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s_x, -1))
