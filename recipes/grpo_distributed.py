"""GRPO with FSDP2 (torchtune's shard_model) over all ranks, full or LoRA policy.
Run: tune run --nproc_per_node 2 grpo_distributed --config configs/qwen_grpo.yaml

The loop is grpo_single_device's (``GRPORecipe`` in ``recipes/grpo_single_device.py``: read it there,
or copy it with ``logitless cp grpo_single_device my_grpo.py`` to change it). This recipe runs it
with ``distributed=True``: each rank samples its contiguous share of the step's prompts with the
policy's weights gathered for the sampling (or an unsharded rollout copy), scores it and trains on
it; rewards, advantages, loss normalisers and metrics cover the whole batch, so a run matches
grpo_single_device on the same seed.
"""

import sys

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
from omegaconf import DictConfig
from torchtune import config

from grpo_single_device import run_grpo


@config.parse
def main(cfg: DictConfig) -> None:
    run_grpo(cfg, distributed=True)


if __name__ == "__main__":
    sys.exit(main())
