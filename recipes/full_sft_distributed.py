"""Full fine-tuning with FSDP2 (torchtune's shard_model) over all ranks.
Run: tune run --nproc_per_node 2 full_sft_distributed --config configs/qwen2_5_0_5b_full.yaml

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
    recipe_main(cfg, lora=False, distributed=True)


if __name__ == "__main__":
    sys.exit(main())
