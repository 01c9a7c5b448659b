"""GRPO with FSDP2 (torchtune's shard_model) over all ranks, full or LoRA policy.
Run: tune run --nproc_per_node 2 grpo_distributed --config configs/qwen_grpo.yaml

Each rank samples its contiguous share of the step's prompts with the policy's weights gathered
for the sampling, scores it, and trains on it; rewards, advantages, loss normalisers and metrics
cover the whole batch, so a run matches grpo_single_device on the same seed. Everything lives in
:mod:`logitless.rl` and :mod:`logitless.training` (see GRPORecipe and Runtime).
"""

import sys

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
from omegaconf import DictConfig
from torchtune import config

from logitless.rl.recipe import recipe_main


@config.parse
def main(cfg: DictConfig) -> None:
    recipe_main(cfg, distributed=True)


if __name__ == "__main__":
    sys.exit(main())
