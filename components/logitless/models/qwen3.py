"""Qwen3 dense decoders (0.6B-32B) and their LoRA / DoRA variants, from torchtune 0.6.1 modules.

Qwen3 is Qwen2.5's block with three changes: a per-head RMSNorm of the queries and keys applied
BEFORE the rotary embedding (:class:`logitless.modules.QKNormAttention`; torchtune's own
``MultiHeadAttention`` applies ``q_norm`` / ``k_norm`` after it), no q/k/v biases, and an explicit
``head_dim`` that need not be ``embed_dim // num_heads`` (0.6B: 16 heads of 128 on a width of 1024).
The rotary embedding is Qwen2's (halves rotated, as Hugging Face's), with base ``rope_theta`` = 1e6.

Model builders carry the hyper-parameters of the Hugging Face checkpoints (``Qwen/Qwen3-*``,
``config.json``): vocabulary 151936, ``rms_norm_eps`` 1e-6, 40960 positions (the ``-Base``
checkpoints say 32768; the RoPE table is the only difference: pass ``max_seq_len``), and tied
embeddings for 0.6B, 1.7B and 4B (``TiedLinear``), an untied head for 8B, 14B and 32B.

Example:
    >>> model = qwen3_1_7b()
    >>> lora = lora_qwen3_8b(["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=16, lora_alpha=32)
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional

from torch import nn
from torchtune.models.qwen2._component_builders import lora_qwen2_mlp, qwen2_mlp
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import RMSNorm, TiedLinear, TransformerDecoder, TransformerSelfAttentionLayer
from torchtune.modules.common_utils import reparametrize_as_dtype_state_dict_post_hook
from torchtune.modules.peft import LORA_ATTN_MODULES, DoRALinear, LoRALinear

from logitless.modules.attention import QKNormAttention

__all__ = ["QWEN3_ARCHS", "lora_qwen3", "lora_qwen3_0_6b", "lora_qwen3_14b", "lora_qwen3_1_7b", "lora_qwen3_32b",
           "lora_qwen3_4b", "lora_qwen3_8b", "qwen3", "qwen3_0_6b", "qwen3_14b", "qwen3_1_7b", "qwen3_32b",
           "qwen3_4b", "qwen3_8b"]

_COMMON = dict(vocab_size=151936, head_dim=128, num_kv_heads=8, max_seq_len=40960, norm_eps=1e-6,
               rope_base=1_000_000.0)
#: ``qwen3`` arguments of each released dense size (Hugging Face ``Qwen/Qwen3-<size>/config.json``).
QWEN3_ARCHS: Dict[str, dict] = {
    "0.6b": dict(_COMMON, num_layers=28, num_heads=16, embed_dim=1024, intermediate_dim=3072, tie_word_embeddings=True),
    "1.7b": dict(_COMMON, num_layers=28, num_heads=16, embed_dim=2048, intermediate_dim=6144, tie_word_embeddings=True),
    "4b": dict(_COMMON, num_layers=36, num_heads=32, embed_dim=2560, intermediate_dim=9728, tie_word_embeddings=True),
    "8b": dict(_COMMON, num_layers=36, num_heads=32, embed_dim=4096, intermediate_dim=12288,
               tie_word_embeddings=False),
    "14b": dict(_COMMON, num_layers=40, num_heads=40, embed_dim=5120, intermediate_dim=17408,
                tie_word_embeddings=False),
    "32b": dict(_COMMON, num_layers=64, num_heads=64, embed_dim=5120, intermediate_dim=25600,
                tie_word_embeddings=False),
}


def _projection(in_dim: int, out_dim: int, adapter: Optional[dict]) -> nn.Module:
    """A bias-free projection: ``nn.Linear``, or with ``adapter`` (LoRA arguments) a LoRA / DoRA layer."""
    if adapter is None:
        return nn.Linear(in_dim, out_dim, bias=False)
    kw = dict(adapter)
    cls = DoRALinear if kw.pop("use_dora") else LoRALinear
    return cls(in_dim, out_dim, use_bias=False, **kw)


def _decoder(*, vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int, embed_dim: int,
             intermediate_dim: int, max_seq_len: int, head_dim: int, attn_dropout: float, norm_eps: float,
             rope_base: float, tie_word_embeddings: bool, lora_modules: List[str] = (), lora_mlp: bool = False,
             lora_output: bool = False, adapter: Optional[dict] = None) -> TransformerDecoder:
    """The Qwen3 decoder; projections named in ``lora_modules`` (and the MLP / head when asked) get
    ``adapter``'s LoRA arguments."""
    if num_heads % num_kv_heads:
        raise ValueError(f"qwen3: num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    if tie_word_embeddings and lora_output:
        raise ValueError("qwen3: apply_lora_to_output=True needs tie_word_embeddings=False "
                         "(a tied head is the embedding weight)")

    def proj(name: str, in_dim: int, out_dim: int) -> nn.Module:
        return _projection(in_dim, out_dim, adapter if name in lora_modules else None)

    layers = nn.ModuleList()
    for _ in range(num_layers):
        # one rotary module per layer, as torchtune's Qwen2 builders make them
        rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
        attn = QKNormAttention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            q_proj=proj("q_proj", embed_dim, num_heads * head_dim),
            k_proj=proj("k_proj", embed_dim, num_kv_heads * head_dim),
            v_proj=proj("v_proj", embed_dim, num_kv_heads * head_dim),
            output_proj=proj("output_proj", num_heads * head_dim, embed_dim),
            pos_embeddings=rope, q_norm=RMSNorm(head_dim, eps=norm_eps), k_norm=RMSNorm(head_dim, eps=norm_eps),
            max_seq_len=max_seq_len, attn_dropout=attn_dropout)
        if lora_mlp:
            a = adapter
            mlp = lora_qwen2_mlp(dim=embed_dim, hidden_dim=intermediate_dim, lora_rank=a["rank"], lora_alpha=a["alpha"],
                                 lora_dropout=a["dropout"], use_dora=a["use_dora"], quantize_base=a["quantize_base"])
        else:
            mlp = qwen2_mlp(dim=embed_dim, hidden_dim=intermediate_dim)
        layers.append(TransformerSelfAttentionLayer(attn=attn, mlp=mlp, sa_norm=RMSNorm(embed_dim, eps=norm_eps),
                                                    mlp_norm=RMSNorm(embed_dim, eps=norm_eps)))
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    if tie_word_embeddings:
        output = TiedLinear(tok_embeddings)
    elif lora_output:
        output = _projection(embed_dim, vocab_size, dict(adapter, quantize_base=False))
    else:
        output = nn.Linear(embed_dim, vocab_size, bias=False)
    model = TransformerDecoder(tok_embeddings=tok_embeddings, layers=layers, max_seq_len=max_seq_len,
                               num_heads=num_heads, head_dim=head_dim, norm=RMSNorm(embed_dim, eps=norm_eps),
                               output=output)
    if adapter is not None and adapter["quantize_base"]:
        # QLoRA: NF4 base weights are saved at the model's precision (torchtune's lora builders do the same)
        model._register_state_dict_hook(partial(reparametrize_as_dtype_state_dict_post_hook,
                                                dtype=tok_embeddings.weight.dtype, offload_to_cpu=True))
    return model


def qwen3(vocab_size: int, num_layers: int, num_heads: int, num_kv_heads: int, embed_dim: int,
          intermediate_dim: int, max_seq_len: int, head_dim: int, attn_dropout: float = 0.0,
          norm_eps: float = 1e-6, rope_base: float = 1_000_000.0, tie_word_embeddings: bool = False
          ) -> TransformerDecoder:
    """A Qwen3 dense decoder (a torchtune ``TransformerDecoder``) of any size.

    Args:
        vocab_size (int): embedding rows (HF ``vocab_size``).
        num_layers (int): transformer layers (``num_hidden_layers``).
        num_heads (int): query heads (``num_attention_heads``).
        num_kv_heads (int): key/value heads (``num_key_value_heads``).
        embed_dim (int): model width (``hidden_size``).
        intermediate_dim (int): SwiGLU width (``intermediate_size``).
        max_seq_len (int): positions of the RoPE table (``max_position_embeddings``).
        head_dim (int): per-head width (``head_dim``; need not be ``embed_dim // num_heads``).
        attn_dropout (float): attention dropout.
        norm_eps (float): RMSNorm epsilon (``rms_norm_eps``), also of the q/k norms.
        rope_base (float): RoPE base (``rope_theta``).
        tie_word_embeddings (bool): the head is the embedding (``TiedLinear``), else an ``nn.Linear``.

    Returns:
        TransformerDecoder: the model (``layers[i].attn`` is a :class:`QKNormAttention`).

    Example:
        >>> qwen3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
        ...       intermediate_dim=64, max_seq_len=128, head_dim=16)(torch.randint(0, 64, (1, 8))).shape
        torch.Size([1, 8, 64])
    """
    return _decoder(vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    embed_dim=embed_dim, intermediate_dim=intermediate_dim, max_seq_len=max_seq_len,
                    head_dim=head_dim, attn_dropout=attn_dropout, norm_eps=norm_eps, rope_base=rope_base,
                    tie_word_embeddings=tie_word_embeddings)


def lora_qwen3(lora_attn_modules: List[LORA_ATTN_MODULES], apply_lora_to_mlp: bool = False,
               apply_lora_to_output: bool = False, *, vocab_size: int, num_layers: int, num_heads: int,
               num_kv_heads: int, embed_dim: int, intermediate_dim: int, max_seq_len: int, head_dim: int,
               attn_dropout: float = 0.0, norm_eps: float = 1e-6, rope_base: float = 1_000_000.0,
               tie_word_embeddings: bool = False, lora_rank: int, lora_alpha: float, lora_dropout: float = 0.0,
               use_dora: bool = False, quantize_base: bool = False) -> TransformerDecoder:
    """:func:`qwen3` with LoRA (or DoRA) adapters on the named projections, as torchtune's ``lora_*`` builders.

    Args:
        lora_attn_modules (List[str]): attention projections to adapt: ``q_proj``, ``k_proj``,
            ``v_proj``, ``output_proj``.
        apply_lora_to_mlp (bool): adapt the MLP's three projections.
        apply_lora_to_output (bool): adapt the head (untied models only).
        lora_rank (int): adapter rank.
        lora_alpha (float): adapter scale numerator (the update is ``alpha / rank * B A``).
        lora_dropout (float): dropout on the adapter input.
        use_dora (bool): DoRA instead of LoRA.
        quantize_base (bool): NF4 base weights of the adapted projections (QLoRA).
        **arch: :func:`qwen3`'s arguments.

    Returns:
        TransformerDecoder: the model; adapter parameters are ``lora_a`` / ``lora_b`` (and ``magnitude``).

    Raises:
        ValueError: an unknown projection name, or ``apply_lora_to_output`` with a tied head.

    Example:
        >>> lora_qwen3(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16, **QWEN3_ARCHS["0.6b"])
    """
    unknown = [m for m in lora_attn_modules if m not in ("q_proj", "k_proj", "v_proj", "output_proj")]
    if unknown or not lora_attn_modules:
        raise ValueError(f"lora_qwen3: lora_attn_modules must name one or more of q_proj, k_proj, v_proj, "
                         f"output_proj; got {list(lora_attn_modules)}")
    adapter = dict(rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout, use_dora=use_dora,
                   quantize_base=quantize_base)
    return _decoder(vocab_size=vocab_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    embed_dim=embed_dim, intermediate_dim=intermediate_dim, max_seq_len=max_seq_len,
                    head_dim=head_dim, attn_dropout=attn_dropout, norm_eps=norm_eps, rope_base=rope_base,
                    tie_word_embeddings=tie_word_embeddings, lora_modules=list(lora_attn_modules),
                    lora_mlp=apply_lora_to_mlp, lora_output=apply_lora_to_output, adapter=adapter)


def _sized(size: str, max_seq_len: Optional[int]) -> dict:
    arch = dict(QWEN3_ARCHS[size])
    if max_seq_len is not None:
        arch["max_seq_len"] = max_seq_len
    return arch


def qwen3_0_6b(max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-0.6B (tied head). ``max_seq_len``: RoPE positions (default 40960; 32768 for ``-Base``)."""
    return qwen3(**_sized("0.6b", max_seq_len))


def qwen3_1_7b(max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-1.7B (tied head). ``max_seq_len``: RoPE positions (default 40960; 32768 for ``-Base``)."""
    return qwen3(**_sized("1.7b", max_seq_len))


def qwen3_4b(max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-4B (tied head). ``max_seq_len``: RoPE positions (default 40960; 32768 for ``-Base``)."""
    return qwen3(**_sized("4b", max_seq_len))


def qwen3_8b(max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-8B (untied head). ``max_seq_len``: RoPE positions (default 40960; 32768 for ``-Base``)."""
    return qwen3(**_sized("8b", max_seq_len))


def qwen3_14b(max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-14B (untied head). ``max_seq_len``: RoPE positions (default 40960; 32768 for ``-Base``)."""
    return qwen3(**_sized("14b", max_seq_len))


def qwen3_32b(max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-32B (untied head). ``max_seq_len``: RoPE positions (default 40960)."""
    return qwen3(**_sized("32b", max_seq_len))


def _lora_sized(size: str, lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank, lora_alpha,
                lora_dropout, use_dora, quantize_base, max_seq_len) -> TransformerDecoder:
    return lora_qwen3(lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank=lora_rank,
                      lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_dora=use_dora,
                      quantize_base=quantize_base, **_sized(size, max_seq_len))


def lora_qwen3_0_6b(lora_attn_modules: List[LORA_ATTN_MODULES], apply_lora_to_mlp: bool = False,
                    apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                    lora_dropout: float = 0.0, use_dora: bool = False, quantize_base: bool = False,
                    max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-0.6B with LoRA / DoRA adapters (arguments of :func:`lora_qwen3`)."""
    return _lora_sized("0.6b", lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank, lora_alpha,
                       lora_dropout, use_dora, quantize_base, max_seq_len)


def lora_qwen3_1_7b(lora_attn_modules: List[LORA_ATTN_MODULES], apply_lora_to_mlp: bool = False,
                    apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                    lora_dropout: float = 0.0, use_dora: bool = False, quantize_base: bool = False,
                    max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-1.7B with LoRA / DoRA adapters (arguments of :func:`lora_qwen3`)."""
    return _lora_sized("1.7b", lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank, lora_alpha,
                       lora_dropout, use_dora, quantize_base, max_seq_len)


def lora_qwen3_4b(lora_attn_modules: List[LORA_ATTN_MODULES], apply_lora_to_mlp: bool = False,
                  apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                  lora_dropout: float = 0.0, use_dora: bool = False, quantize_base: bool = False,
                  max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-4B with LoRA / DoRA adapters (arguments of :func:`lora_qwen3`)."""
    return _lora_sized("4b", lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank, lora_alpha,
                       lora_dropout, use_dora, quantize_base, max_seq_len)


def lora_qwen3_8b(lora_attn_modules: List[LORA_ATTN_MODULES], apply_lora_to_mlp: bool = False,
                  apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                  lora_dropout: float = 0.0, use_dora: bool = False, quantize_base: bool = False,
                  max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-8B with LoRA / DoRA adapters (arguments of :func:`lora_qwen3`)."""
    return _lora_sized("8b", lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank, lora_alpha,
                       lora_dropout, use_dora, quantize_base, max_seq_len)


def lora_qwen3_14b(lora_attn_modules: List[LORA_ATTN_MODULES], apply_lora_to_mlp: bool = False,
                   apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                   lora_dropout: float = 0.0, use_dora: bool = False, quantize_base: bool = False,
                   max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-14B with LoRA / DoRA adapters (arguments of :func:`lora_qwen3`)."""
    return _lora_sized("14b", lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank, lora_alpha,
                       lora_dropout, use_dora, quantize_base, max_seq_len)


def lora_qwen3_32b(lora_attn_modules: List[LORA_ATTN_MODULES], apply_lora_to_mlp: bool = False,
                   apply_lora_to_output: bool = False, lora_rank: int = 8, lora_alpha: float = 16,
                   lora_dropout: float = 0.0, use_dora: bool = False, quantize_base: bool = False,
                   max_seq_len: Optional[int] = None) -> TransformerDecoder:
    """Qwen3-32B with LoRA / DoRA adapters (arguments of :func:`lora_qwen3`)."""
    return _lora_sized("32b", lora_attn_modules, apply_lora_to_mlp, apply_lora_to_output, lora_rank, lora_alpha,
                       lora_dropout, use_dora, quantize_base, max_seq_len)
