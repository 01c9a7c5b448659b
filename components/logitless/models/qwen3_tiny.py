"""A tiny Qwen3-architecture decoder for tests, CI and the bundled tiny Qwen3 configs.

Same blocks as Qwen3-0.6B (per-head q/k RMSNorm before RoPE, no q/k/v biases, an explicit head width
larger than ``embed_dim // num_heads``, tied head) at a size that trains on a CPU in seconds. Its
vocabulary is the bundled byte-level BPE (2026 tokens) plus Qwen3's 26 added tokens (ids 2026-2051,
``<think>`` 2050, ``</think>`` 2051): the folder ``logitless/datasets/assets/qwen3_tiny`` is a complete
Hugging Face checkpoint of it (weights, config, tokenizer with Qwen3's chat template), written by
transformers through ``scripts/make_tiny_qwen3.py``, so ``from_hf`` / ``hf_tokenizer`` /
``HFCheckpointer`` read it like a downloaded Qwen3.
"""

from __future__ import annotations

from typing import Any, Dict

from torchtune.modules import TransformerDecoder

from logitless.models.qwen3 import qwen3

#: Architecture of the bundled checkpoint (``logitless/datasets/assets/qwen3_tiny``).
TINY_QWEN3_CONFIG: Dict[str, Any] = dict(
    vocab_size=2052,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    embed_dim=128,
    intermediate_dim=384,
    head_dim=64,
    max_seq_len=1024,
    norm_eps=1e-6,
    rope_base=1_000_000.0,
    tie_word_embeddings=True,
)


def qwen3_tiny(**overrides: Any) -> TransformerDecoder:
    """The tiny Qwen3 decoder (:data:`TINY_QWEN3_CONFIG`, any entry overridable).

    Args:
        **overrides: :func:`logitless.models.qwen3` arguments to change (the bundled checkpoint needs
            the defaults).

    Returns:
        TransformerDecoder: the model, fp32 on the current default device.

    Raises:
        TypeError: an override that is not an architecture key.

    Example:
        >>> qwen3_tiny()(torch.randint(0, 2052, (2, 8))).shape
        torch.Size([2, 8, 2052])
    """
    unknown = set(overrides) - set(TINY_QWEN3_CONFIG)
    if unknown:
        raise TypeError(f"qwen3_tiny: unknown argument(s) {sorted(unknown)}; expected {sorted(TINY_QWEN3_CONFIG)}")
    return qwen3(**dict(TINY_QWEN3_CONFIG, **overrides))
