"""Datasets, the bundled tiny assets (tokenizer, checkpoint, toy data) and synthetic data."""

# Public: __all__ (docs/CONTRACT.md). The other names are internal, imported here for the recipes and tests.
from logitless.datasets._alpaca import alpaca_dataset, tiny_alpaca_dataset
from logitless.datasets._assets import (
    ASSETS_DIR,
    TINY_ALPACA_FILES,
    TINY_CHECKPOINT_DIR,
    TINY_TOKENIZER_DIR,
    asset_path,
    tiny_qwen2_5_tokenizer,
)
from logitless.datasets._hf_tokenizer import CHATML_TEMPLATE, hf_generation_config, hf_tokenizer_config
from logitless.datasets._synthetic import (
    SyntheticDataset,
    SyntheticTokenizer,
    synthetic_dataset,
    synthetic_tokenizer,
)

__all__ = ["alpaca_dataset", "synthetic_dataset", "synthetic_tokenizer", "tiny_alpaca_dataset",
           "tiny_qwen2_5_tokenizer"]
