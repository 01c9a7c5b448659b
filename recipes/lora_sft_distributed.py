"""LoRA fine-tuning with FSDP2 over all ranks; checkpoints as lora_sft_single_device writes them.
Run: tune run --nproc_per_node 2 lora_sft_distributed --config configs/qwen2_5_0_5b_lora.yaml

The loop is full_sft_single_device's (``SFTRecipe`` in ``recipes/full_sft_single_device.py``: read
it there, or copy it with ``logitless cp full_sft_single_device my_sft.py`` to change it). This recipe
runs it with ``lora=True`` (as lora_sft_single_device: a ``lora_*`` model, adapters trained over a
frozen base, saved separately and merged) and ``distributed=True`` (as full_sft_distributed: FSDP2
over the process group, each rank loads its share of every batch). Rank 0 gathers the full
weights for each checkpoint, so its folders are the same files lora_sft_single_device writes.
"""

import sys

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
from omegaconf import DictConfig
from torchtune import config

from full_sft_single_device import run_sft


@config.parse
def main(cfg: DictConfig) -> None:
    run_sft(cfg, lora=True, distributed=True)


if __name__ == "__main__":
    sys.exit(main())
