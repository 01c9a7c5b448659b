"""Paths of the small assets bundled with the package and builders that load them with torchtune."""

from __future__ import annotations

from typing import Any, Optional

from torchtune.data import PromptTemplate
from torchtune.models.qwen2_5 import qwen2_5_tokenizer
from torchtune.models.qwen2_5._tokenizer import Qwen2_5Tokenizer

from logitless.resources import PACKAGE_DIR, package_asset

ASSETS_DIR = PACKAGE_DIR / "datasets" / "assets"
TINY_TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
TINY_CHECKPOINT_DIR = ASSETS_DIR / "qwen2_5_tiny"
TINY_ALPACA_FILES = {"train": ASSETS_DIR / "tiny_alpaca.json", "eval": ASSETS_DIR / "tiny_alpaca_eval.json"}


def asset_path(name: str) -> str:
    """Absolute path of a bundled asset.

    Args:
        name (str): path relative to ``logitless/datasets/assets`` (e.g. ``"tokenizer/vocab.json"``).

    Returns:
        str: the absolute path.

    Raises:
        FileNotFoundError: naming the asset and the folder searched, if it does not exist.

    Example:
        >>> asset_path("qwen2_5_tiny/config.json")
        '/.../logitless/datasets/assets/qwen2_5_tiny/config.json'
    """
    return package_asset(f"datasets/{name}")  # the lookup configs use as ${logitless_asset:datasets/NAME}


def tiny_qwen2_5_tokenizer(
    max_seq_len: Optional[int] = None,
    prompt_template: Optional[PromptTemplate] = None,
    **kwargs: Any,
) -> Qwen2_5Tokenizer:
    """torchtune's own Qwen2.5 tokenizer on the bundled 2048-token byte-level BPE.

    Equivalent to ``torchtune.models.qwen2_5.qwen2_5_tokenizer(path=.../vocab.json,
    merges_file=.../merges.txt, special_tokens_path=.../tokenizer.json)``: the 22 Qwen2.5 special
    tokens get ids 2026-2047 (``<|endoftext|>`` 2026, ``<|im_start|>`` 2027, ``<|im_end|>`` 2028).

    Args:
        max_seq_len (Optional[int]): truncation length (required for packed datasets).
        prompt_template (Optional[PromptTemplate]): as in torchtune's builder.
        **kwargs: passed to ``qwen2_5_tokenizer`` (e.g. ``truncation_type``).

    Returns:
        Qwen2_5Tokenizer: the tokenizer.

    Example:
        >>> tok = tiny_qwen2_5_tokenizer(max_seq_len=256)
        >>> tok.decode(tok.encode("12 + 7 = 19", add_eos=False))
        '12 + 7 = 19'
    """
    return qwen2_5_tokenizer(
        path=str(TINY_TOKENIZER_DIR / "vocab.json"),
        merges_file=str(TINY_TOKENIZER_DIR / "merges.txt"),
        special_tokens_path=str(TINY_TOKENIZER_DIR / "tokenizer.json"),
        max_seq_len=max_seq_len,
        prompt_template=prompt_template,
        **kwargs,
    )
