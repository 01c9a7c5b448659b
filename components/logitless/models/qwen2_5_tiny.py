"""A tiny Qwen2.5-architecture decoder built with torchtune's own Qwen2 component builders.

Same blocks as Qwen2.5-0.5B (GQA with q/k/v biases, RoPE, SwiGLU MLP, RMSNorm, tied head as
``TiedLinear``) at a size that trains on a CPU in seconds. Its vocabulary matches the bundled
byte-level BPE tokenizer (``logitless.datasets.tiny_qwen2_5_tokenizer``: 2026 BPE tokens + 22 special).
"""

from __future__ import annotations

from typing import List

from torchtune.models.qwen2._component_builders import lora_qwen2, qwen2
from torchtune.modules import TransformerDecoder

# Architecture of the bundled checkpoint (components/logitless/datasets/assets/qwen2_5_tiny/).
TINY_QWEN2_5_CONFIG = dict(
    vocab_size=2048,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=128,
    intermediate_dim=512,
    max_seq_len=1024,
    norm_eps=1e-6,
    rope_base=10_000.0,
)


def qwen2_5_tiny(
    vocab_size: int = TINY_QWEN2_5_CONFIG["vocab_size"],
    num_layers: int = TINY_QWEN2_5_CONFIG["num_layers"],
    num_heads: int = TINY_QWEN2_5_CONFIG["num_heads"],
    num_kv_heads: int = TINY_QWEN2_5_CONFIG["num_kv_heads"],
    embed_dim: int = TINY_QWEN2_5_CONFIG["embed_dim"],
    intermediate_dim: int = TINY_QWEN2_5_CONFIG["intermediate_dim"],
    max_seq_len: int = TINY_QWEN2_5_CONFIG["max_seq_len"],
    norm_eps: float = TINY_QWEN2_5_CONFIG["norm_eps"],
    rope_base: float = TINY_QWEN2_5_CONFIG["rope_base"],
    tie_word_embeddings: bool = True,
) -> TransformerDecoder:
    """Builds the tiny Qwen2.5 decoder (a real ``torchtune.modules.TransformerDecoder``).

    Args:
        vocab_size (int): vocabulary size; 2048 matches the bundled tokenizer.
        num_layers (int): transformer layers.
        num_heads (int): query heads.
        num_kv_heads (int): key/value heads (grouped-query attention).
        embed_dim (int): model width; must be divisible by ``num_heads``.
        intermediate_dim (int): SwiGLU hidden width.
        max_seq_len (int): RoPE cache length.
        norm_eps (float): RMSNorm epsilon.
        rope_base (float): RoPE base.
        tie_word_embeddings (bool): True (default, as Qwen2.5 0.5B-3B): the head is a
            ``torchtune.modules.TiedLinear`` sharing ``tok_embeddings.weight``; False: ``nn.Linear``.

    Returns:
        TransformerDecoder: the model, in fp32 on the current default device.

    Example:
        >>> model = qwen2_5_tiny()
        >>> model(torch.randint(0, 2048, (2, 16))).shape
        torch.Size([2, 16, 2048])
    """
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"qwen2_5_tiny: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"qwen2_5_tiny: num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )
    return qwen2(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        attn_dropout=0.0,
        norm_eps=norm_eps,
        rope_base=rope_base,
        tie_word_embeddings=tie_word_embeddings,
    )


def qwen2_5_tiny_untied(**kwargs) -> TransformerDecoder:
    """``qwen2_5_tiny`` with an untied ``nn.Linear`` head (like Qwen2.5-7B).

    Args:
        **kwargs: any argument of :func:`qwen2_5_tiny` except ``tie_word_embeddings``.

    Returns:
        TransformerDecoder: the model with ``model.output`` an ``nn.Linear``.

    Example:
        >>> isinstance(qwen2_5_tiny_untied().output, torch.nn.Linear)
        True
    """
    if "tie_word_embeddings" in kwargs:
        raise TypeError("qwen2_5_tiny_untied: tie_word_embeddings is fixed to False; use qwen2_5_tiny")
    return qwen2_5_tiny(tie_word_embeddings=False, **kwargs)


def lora_qwen2_5_tiny(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    tie_word_embeddings: bool = True,
    **kwargs,
) -> TransformerDecoder:
    """The tiny Qwen2.5 with LoRA adapters (torchtune's ``lora_qwen2``).

    Args:
        lora_attn_modules (List[str]): attention projections to adapt, from
            ``q_proj``, ``k_proj``, ``v_proj``, ``output_proj``.
        apply_lora_to_mlp (bool): adapt the MLP projections too.
        apply_lora_to_output (bool): adapt the head (only possible when untied).
        lora_rank (int): adapter rank.
        lora_alpha (float): adapter scaling numerator.
        lora_dropout (float): dropout on the adapter input.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): NF4 base weights (QLoRA).
        tie_word_embeddings (bool): tied head (default, as the bundled checkpoint).
        **kwargs: architecture overrides accepted by :func:`qwen2_5_tiny`.

    Returns:
        TransformerDecoder: the model; adapter parameters are named ``lora_a`` / ``lora_b``.

    Example:
        >>> model = lora_qwen2_5_tiny(["q_proj", "v_proj"], lora_rank=4, lora_alpha=8)
    """
    if apply_lora_to_output and tie_word_embeddings:
        raise ValueError(
            "lora_qwen2_5_tiny: apply_lora_to_output=True needs tie_word_embeddings=False "
            "(a tied head shares the embedding weight)"
        )
    arch = dict(TINY_QWEN2_5_CONFIG)
    unknown = set(kwargs) - set(arch)
    if unknown:
        raise TypeError(f"lora_qwen2_5_tiny: unknown argument(s) {sorted(unknown)}; expected {sorted(arch)}")
    arch.update(kwargs)
    return lora_qwen2(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        attn_dropout=0.0,
        tie_word_embeddings=tie_word_embeddings,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **arch,
    )


def tiny_hf_config(**overrides) -> dict:
    """The Hugging Face ``config.json`` content (``Qwen2ForCausalLM``) of the tiny model.

    Args:
        **overrides: keys of :data:`TINY_QWEN2_5_CONFIG` to change.

    Returns:
        dict: a config that ``FullModelHFCheckpointer`` (model_type QWEN2) and HF transformers read.

    Example:
        >>> tiny_hf_config()["hidden_size"]
        128
    """
    c = dict(TINY_QWEN2_5_CONFIG, **overrides)
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": c["embed_dim"],
        "intermediate_size": c["intermediate_dim"],
        "num_attention_heads": c["num_heads"],
        "num_key_value_heads": c["num_kv_heads"],
        "num_hidden_layers": c["num_layers"],
        "vocab_size": c["vocab_size"],
        "max_position_embeddings": c["max_seq_len"],
        "max_window_layers": c["num_layers"],
        "rope_theta": c["rope_base"],
        "rms_norm_eps": c["norm_eps"],
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": c["max_seq_len"],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": 2026,  # <|endoftext|> in the bundled tokenizer
        "eos_token_id": 2028,  # <|im_end|>
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
