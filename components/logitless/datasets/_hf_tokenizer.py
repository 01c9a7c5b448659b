"""Hugging Face ``tokenizer_config.json`` / ``generation_config.json`` content for torchtune's Qwen2.5 tokenizer.

transformers' ``AutoTokenizer`` needs ``tokenizer_config.json`` next to ``tokenizer.json`` (or
``vocab.json`` + ``merges.txt``) to know the tokenizer class, the special tokens and the chat template;
without it it builds an empty tokenizer. These builders derive that file from a torchtune
``Qwen2Tokenizer`` so the ids, eos and pad agree with what training used.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

# ChatML exactly as torchtune's Qwen2_5Tokenizer.tokenize_messages lays out text messages:
# "<|im_start|>{role}\n{content}<|im_end|>\n" per message; a generation prompt opens the assistant turn.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _token(tokenizer: Any, token_id: Optional[int]) -> Optional[str]:
    if token_id is None:
        return None
    by_id = {i: t for t, i in tokenizer.special_tokens.items()}
    if token_id not in by_id:
        raise ValueError(f"tokenizer: id {token_id} is not one of its special tokens {sorted(by_id)}")
    return by_id[token_id]


def hf_tokenizer_config(tokenizer: Any, *, chat_template: Optional[str] = CHATML_TEMPLATE,
                        model_max_length: Optional[int] = None) -> Dict[str, Any]:
    """``tokenizer_config.json`` content for a torchtune ``Qwen2Tokenizer`` / ``Qwen2_5Tokenizer``.

    Args:
        tokenizer: the torchtune tokenizer (``special_tokens``, ``eos_id``, ``pad_id``, ``bos_id``).
        chat_template (Optional[str]): Jinja chat template; the default reproduces torchtune's
            ``tokenize_messages`` layout for text messages.
        model_max_length (Optional[int]): longest sequence (``tokenizer.max_seq_len`` when None;
            transformers' "very large" default when that is None too).

    Returns:
        Dict[str, Any]: the JSON content (``Qwen2Tokenizer`` class, special tokens with their ids,
        eos / pad / bos tokens, chat template).

    Raises:
        ValueError: when the tokenizer has no ``special_tokens`` or its eos / pad is not one of them.

    Example:
        >>> cfg = hf_tokenizer_config(tiny_qwen2_5_tokenizer())
        >>> cfg["eos_token"], cfg["pad_token"]
        ('<|im_end|>', '<|endoftext|>')
    """
    specials = getattr(tokenizer, "special_tokens", None)
    if not specials:
        raise ValueError(f"tokenizer: {type(tokenizer).__name__} has no special_tokens; expected torchtune's "
                         f"Qwen2Tokenizer / Qwen2_5Tokenizer")
    max_len = model_max_length if model_max_length is not None else getattr(tokenizer, "max_seq_len", None)
    config: Dict[str, Any] = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for t, i in sorted(specials.items(), key=lambda kv: kv[1])
        },
        "additional_special_tokens": [t for t, _ in sorted(specials.items(), key=lambda kv: kv[1])],
        "bos_token": _token(tokenizer, getattr(tokenizer, "bos_id", None)),
        "eos_token": _token(tokenizer, tokenizer.eos_id),
        "pad_token": _token(tokenizer, getattr(tokenizer, "pad_id", None)),
        "unk_token": None,
        "errors": "replace",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": int(max_len) if max_len is not None else 131072,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def hf_generation_config(tokenizer: Any) -> Dict[str, Any]:
    """``generation_config.json`` content: the tokenizer's stop tokens as eos, its pad and bos.

    Args:
        tokenizer: a torchtune tokenizer (``eos_id``; ``stop_tokens``, ``pad_id``, ``bos_id`` if it has them).

    Returns:
        Dict[str, Any]: ``eos_token_id`` (a list: generation stops at any of torchtune's stop tokens),
        ``pad_token_id``, ``bos_token_id``.

    Example:
        >>> hf_generation_config(tiny_qwen2_5_tokenizer())["eos_token_id"]
        [2028, 2026]
    """
    stops = [int(t) for t in getattr(tokenizer, "stop_tokens", None) or [tokenizer.eos_id]]
    if tokenizer.eos_id not in stops:
        stops.insert(0, int(tokenizer.eos_id))
    pad = getattr(tokenizer, "pad_id", None)
    bos = getattr(tokenizer, "bos_id", None)
    return {"bos_token_id": bos, "eos_token_id": list(dict.fromkeys(stops)), "pad_token_id": pad}
