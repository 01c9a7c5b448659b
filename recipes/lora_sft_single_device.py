"""LoRA fine-tuning on one device; adapters saved separately (merged too with merge_adapters=True).
Run: tune run lora_sft_single_device --config configs/tiny_lora.yaml

The loss is whatever ``loss._component_`` names (logitless.losses.*); the recipe only uses the loss
protocol. Everything else lives in :mod:`logitless.training` (see SFTRecipe).
"""

import sys

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
from omegaconf import DictConfig
from torchtune import config

from logitless.training.sft_recipe import recipe_main


@config.parse
def main(cfg: DictConfig) -> None:
    recipe_main(cfg, lora=True, distributed=False)


if __name__ == "__main__":
    sys.exit(main())
