"""LoRA fine-tuning on one device; adapters saved separately (merged too with merge_adapters=True).
Run: tune run lora_sft_single_device --config configs/tiny_lora.yaml

The loop is full_sft_single_device's (``SFTRecipe`` in ``recipes/full_sft_single_device.py``: read
it there, or copy it with ``logitless cp full_sft_single_device my_sft.py`` to change it). This recipe
runs it with ``lora=True``: the config's model must be a ``lora_*`` builder; only the adapters
train, the base stays frozen, and every checkpoint saves the adapters (``adapter_model.pt`` and a
PEFT ``adapter/`` folder) next to the base weights with the adapters merged (``merge_adapters``).
"""

import sys

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
from omegaconf import DictConfig
from torchtune import config

from full_sft_single_device import run_sft


@config.parse
def main(cfg: DictConfig) -> None:
    run_sft(cfg, lora=True, distributed=False)


if __name__ == "__main__":
    sys.exit(main())
