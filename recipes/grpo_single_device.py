"""GRPO on one device (GPU or CPU), full or LoRA policy.
Run: tune run grpo_single_device --config configs/tiny_grpo.yaml

Sampling (KV cache, last-position logits only), rewards, advantages and the policy update live in
:mod:`logitless.rl`; the loss is ``logitless.losses.GRPOLoss`` through the loss protocol; checkpoints,
resume, metric logging and progress come from :mod:`logitless.training` (see GRPORecipe, which
grpo_distributed shares).
"""

import sys

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
from omegaconf import DictConfig
from torchtune import config

from logitless.rl.recipe import recipe_main


@config.parse
def main(cfg: DictConfig) -> None:
    recipe_main(cfg)


if __name__ == "__main__":
    sys.exit(main())
