"""Model builders: a tiny Qwen2.5-architecture decoder for tests, CI and the bundled configs."""

from logitless.models.qwen2_5_tiny import (
    TINY_QWEN2_5_CONFIG,
    lora_qwen2_5_tiny,
    qwen2_5_tiny,
    qwen2_5_tiny_untied,
    tiny_hf_config,
)

__all__ = [
    "TINY_QWEN2_5_CONFIG",
    "lora_qwen2_5_tiny",
    "qwen2_5_tiny",
    "qwen2_5_tiny_untied",
    "tiny_hf_config",
]
