"""Model builders torchtune 0.6.1 lacks: Qwen3 dense (0.6B-32B, LoRA / DoRA), Llama 3.x from its
config, any Hugging Face checkpoint folder (``from_hf``, ``hf_tokenizer``, ``HFCheckpointer``), and
tiny Qwen2.5 / Qwen3 models for tests, CI and the bundled configs.

``MODELS`` names every builder by a short key (benchmarks and scripts take these):

    >>> from logitless.models import build_named
    >>> model = build_named("qwen3_1_7b")
"""

from typing import Callable, Dict

from logitless.models.checkpointer import HFCheckpointer, hf_weight_files
from logitless.models.convert import hf_to_tune_converter, tune_to_hf_converter
from logitless.models.hf import (
    FAMILIES,
    HFConfigError,
    HFModelSpec,
    from_hf,
    hf_config_from_model,
    hf_model_spec,
    hf_tokenizer,
    model_family,
    model_type_of,
    read_hf_config,
)
from logitless.models.llama3 import llama3_decoder, lora_llama3_decoder
from logitless.models.qwen2_5_tiny import (
    TINY_QWEN2_5_CONFIG,
    lora_qwen2_5_tiny,
    qwen2_5_tiny,
    qwen2_5_tiny_untied,
    tiny_hf_config,
)
from logitless.models.qwen3 import (
    QWEN3_ARCHS,
    lora_qwen3,
    lora_qwen3_0_6b,
    lora_qwen3_14b,
    lora_qwen3_1_7b,
    lora_qwen3_32b,
    lora_qwen3_4b,
    lora_qwen3_8b,
    qwen3,
    qwen3_0_6b,
    qwen3_14b,
    qwen3_1_7b,
    qwen3_32b,
    qwen3_4b,
    qwen3_8b,
)
from logitless.models.qwen3_tiny import TINY_QWEN3_CONFIG, qwen3_tiny
from logitless.models.qwen3_tokenizer import QWEN3_CHAT_TEMPLATE, Qwen3Tokenizer, qwen3_tokenizer

#: Short key -> dotted builder path (random-weight models for benchmarks and scripts).
MODELS: Dict[str, str] = {
    "tiny": "logitless.models.qwen2_5_tiny",
    "qwen3_tiny": "logitless.models.qwen3_tiny",
    "qwen2_5_0_5b": "torchtune.models.qwen2_5.qwen2_5_0_5b",
    "qwen2_5_1_5b": "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct",
    "qwen2_5_3b": "torchtune.models.qwen2_5.qwen2_5_3b",
    "qwen2_5_7b": "torchtune.models.qwen2_5.qwen2_5_7b_instruct",
    **{f"qwen3_{size.replace('.', '_')}": f"logitless.models.qwen3_{size.replace('.', '_')}" for size in QWEN3_ARCHS},
    "llama3_2_1b": "torchtune.models.llama3_2.llama3_2_1b",
    "llama3_2_3b": "torchtune.models.llama3_2.llama3_2_3b",
    "llama3_1_8b": "torchtune.models.llama3_1.llama3_1_8b",
}


def named_builder(key: str) -> Callable:
    """The builder :data:`MODELS` names ``key``.

    Raises:
        KeyError: naming the key and listing the known ones.

    Example:
        >>> named_builder("qwen3_1_7b").__name__
        'qwen3_1_7b'
    """
    if key not in MODELS:
        raise KeyError(f"model {key!r}: unknown; expected one of {sorted(MODELS)}")
    from torchtune.config._utils import _get_component_from_path

    return _get_component_from_path(MODELS[key])


def build_named(key: str, **kwargs):
    """``named_builder(key)(**kwargs)``: a random-weight model of a short key."""
    return named_builder(key)(**kwargs)


__all__ = [  # the builders and components configs name; the other names are internal
    "HFCheckpointer", "from_hf", "hf_tokenizer", "llama3_decoder", "lora_llama3_decoder", "lora_qwen2_5_tiny",
    "lora_qwen3", "lora_qwen3_0_6b", "lora_qwen3_14b", "lora_qwen3_1_7b", "lora_qwen3_32b", "lora_qwen3_4b",
    "lora_qwen3_8b", "qwen2_5_tiny", "qwen2_5_tiny_untied", "qwen3", "qwen3_0_6b", "qwen3_14b", "qwen3_1_7b",
    "qwen3_32b", "qwen3_4b", "qwen3_8b", "qwen3_tiny", "qwen3_tokenizer",
]
