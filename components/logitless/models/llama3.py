"""Llama 3.x decoders of any size with the rotary embedding their ``config.json`` describes.

torchtune 0.6.1's ``llama3_1`` / ``llama3_2`` component builders take only the RoPE scale factor
(``Llama3ScaledRoPE`` with the Llama 3.1 low/high-frequency factors and original context of 8192),
and its ``llama3`` builder has no tied head. :func:`llama3_decoder` builds through torchtune's
``llama3_2`` builder (tied or untied head) and gives the layers the rotary module of the
checkpoint's ``rope_scaling``: ``None`` (Llama 3.0: plain RoPE) or ``rope_type: llama3`` with its
``factor``, ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``.
torchtune's Llama RoPE pairs elements ``(2i, 2i + 1)`` of q/k rows that the LLAMA3 checkpointer
conversion permutes from Hugging Face's layout, so the model equals Hugging Face's ``LlamaForCausalLM``.

Example:
    >>> model = llama3_decoder(vocab_size=128256, num_layers=16, num_heads=32, num_kv_heads=8, embed_dim=2048,
    ...                        intermediate_dim=8192, max_seq_len=131072, rope_base=500000.0,
    ...                        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
    ...                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ...                        tie_word_embeddings=True)                  # Llama-3.2-1B
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional

from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
from torchtune.modules import RotaryPositionalEmbeddings, TransformerDecoder
from torchtune.modules.peft import LORA_ATTN_MODULES

__all__ = ["llama3_decoder", "llama3_rope", "lora_llama3_decoder"]

#: The ``rope_scaling`` fields of ``rope_type: llama3`` and the ``Llama3ScaledRoPE`` argument each sets.
_LLAMA3_SCALING = {"factor": "scale_factor", "low_freq_factor": "low_freq_factor",
                   "high_freq_factor": "high_freq_factor", "original_max_position_embeddings": "old_context_len"}


def llama3_rope(head_dim: int, max_seq_len: int, rope_base: float,
                rope_scaling: Optional[Mapping[str, Any]]) -> nn.Module:
    """The rotary module of a Llama config: plain RoPE without ``rope_scaling``, ``Llama3ScaledRoPE``
    with ``rope_type: llama3``.

    Args:
        head_dim (int): per-head width.
        max_seq_len (int): positions of the table.
        rope_base (float): ``rope_theta``.
        rope_scaling (Optional[Mapping]): the config's ``rope_scaling`` (None, or ``rope_type`` ``llama3``
            with ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).

    Returns:
        nn.Module: torchtune's ``RotaryPositionalEmbeddings`` or ``Llama3ScaledRoPE``.

    Raises:
        ValueError: naming the ``rope_scaling`` field that is missing or of another RoPE type.
    """
    if rope_scaling is None:
        return RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"rope_scaling.rope_type: {kind!r} is not supported for Llama; expected 'llama3' "
                         f"(Llama 3.1-3.3) or no rope_scaling (Llama 3.0)")
    missing = [k for k in _LLAMA3_SCALING if k not in rope_scaling]
    if missing:
        raise ValueError(f"rope_scaling.{missing[0]}: required with rope_type 'llama3' but missing")
    return Llama3ScaledRoPE(dim=head_dim, max_seq_len=max_seq_len, base=rope_base,
                            **{arg: rope_scaling[field] for field, arg in _LLAMA3_SCALING.items()})


def _with_rope(model: TransformerDecoder, rope: nn.Module) -> TransformerDecoder:
    """Gives every layer ``rope`` (shared, as torchtune's Llama builders share theirs)."""
    for layer in model.layers:
        layer.attn.pos_embeddings = rope
    return model


def llama3_decoder(vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int, embed_dim: int,
                   intermediate_dim: int, max_seq_len: int, rope_base: float = 500_000.0, norm_eps: float = 1e-5,
                   rope_scaling: Optional[Mapping[str, Any]] = None, tie_word_embeddings: bool = False,
                   attn_dropout: float = 0.0) -> TransformerDecoder:
    """A Llama 3.x decoder from its Hugging Face hyper-parameters.

    Args:
        vocab_size (int): ``vocab_size``.
        num_layers (int): ``num_hidden_layers``.
        num_heads (int): ``num_attention_heads`` (head width ``embed_dim // num_heads``).
        num_kv_heads (int): ``num_key_value_heads``.
        embed_dim (int): ``hidden_size``.
        intermediate_dim (int): ``intermediate_size``.
        max_seq_len (int): ``max_position_embeddings`` (the RoPE table).
        rope_base (float): ``rope_theta``.
        norm_eps (float): ``rms_norm_eps``.
        rope_scaling (Optional[Mapping]): ``rope_scaling`` (see :func:`llama3_rope`).
        tie_word_embeddings (bool): ``tie_word_embeddings`` (Llama 3.2 1B/3B).
        attn_dropout (float): attention dropout.

    Returns:
        TransformerDecoder: the model.
    """
    model = llama3_2(vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     embed_dim=embed_dim, max_seq_len=max_seq_len, attn_dropout=attn_dropout, rope_base=rope_base,
                     intermediate_dim=intermediate_dim, norm_eps=norm_eps, tie_word_embeddings=tie_word_embeddings)
    return _with_rope(model, llama3_rope(embed_dim // num_heads, max_seq_len, rope_base, rope_scaling))


def lora_llama3_decoder(lora_attn_modules: List[LORA_ATTN_MODULES], apply_lora_to_mlp: bool = False,
                        apply_lora_to_output: bool = False, *, vocab_size: int, num_layers: int, num_heads: int,
                        num_kv_heads: int, embed_dim: int, intermediate_dim: int, max_seq_len: int,
                        rope_base: float = 500_000.0, norm_eps: float = 1e-5,
                        rope_scaling: Optional[Mapping[str, Any]] = None, tie_word_embeddings: bool = False,
                        attn_dropout: float = 0.0, lora_rank: int, lora_alpha: float, lora_dropout: float = 0.0,
                        use_dora: bool = False, quantize_base: bool = False) -> TransformerDecoder:
    """:func:`llama3_decoder` with LoRA / DoRA adapters (torchtune's ``lora_llama3_2``).

    Args:
        lora_attn_modules (List[str]): ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``.
        apply_lora_to_mlp (bool): adapt the MLP.
        apply_lora_to_output (bool): adapt the head (untied only).
        lora_rank, lora_alpha, lora_dropout, use_dora, quantize_base: the adapters.
        **arch: :func:`llama3_decoder`'s arguments.

    Returns:
        TransformerDecoder: the model with adapters.
    """
    model = lora_llama3_2(lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, vocab_size=vocab_size,
                          num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          embed_dim=embed_dim, max_seq_len=max_seq_len, intermediate_dim=intermediate_dim,
                          attn_dropout=attn_dropout, norm_eps=norm_eps, rope_base=rope_base, lora_rank=lora_rank,
                          lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_dora=use_dora,
                          quantize_base=quantize_base, tie_word_embeddings=tie_word_embeddings)
    return _with_rope(model, llama3_rope(embed_dim // num_heads, max_seq_len, rope_base, rope_scaling))
