"""Full fine-tuning with FSDP2 (torchtune's shard_model) over all ranks.
Run: tune run --nproc_per_node 2 full_sft_distributed --config configs/qwen2_5_0_5b_full.yaml

The loop is full_sft_single_device's (``SFTRecipe`` in ``recipes/full_sft_single_device.py``: read
it there, or copy it with ``logitless cp full_sft_single_device my_sft.py`` to change it). This recipe
runs it with ``distributed=True``: the Runtime joins the process group, FSDP2 shards the model
(``fsdp_*`` keys), each rank loads ``batch_size`` rows of every micro-batch, and the loss is the
mean over the tokens of all ranks, so a run matches one device given the same global batch.
"""

import sys

# before torchtune: registers ${logitless_asset:...} and drops torchao's import-time cpp-extension notice
import logitless  # noqa: F401, I001
from omegaconf import DictConfig
from torchtune import config

from full_sft_single_device import run_sft


@config.parse
def main(cfg: DictConfig) -> None:
    run_sft(cfg, lora=False, distributed=True)


if __name__ == "__main__":
    sys.exit(main())
