"""The SFT recipes' data: the tokenizer and dataset with every row checked against the length limit
(before the model is built), and the loader over this rank's share with the run's step counts.

Example:
    >>> tokenizer, dataset = build_sft_dataset(cfg, log=runtime.is_rank_zero)
    >>> loader, steps_per_epoch, total_steps = build_sft_dataloader(cfg, dataset, tokenizer, runtime,
    ...                                                             ignore_index=loss_fn.ignore_index)
"""

from __future__ import annotations

from typing import Any, Tuple

from omegaconf import DictConfig
from torch.utils.data import DataLoader
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX
from torchtune.utils import get_logger

from logitless.training.config import ConfigError
from logitless.training.dataloader import build_dataloader
from logitless.training.distributed import Runtime
from logitless.training.preflight import fit_sft_dataset, instantiate_dataset, model_limits


def build_sft_dataset(cfg: DictConfig, *, log: bool) -> Tuple[Any, Any]:
    """The tokenizer and the dataset, its rows fitted to ``max_seq_len`` (``on_too_long``).

    Args:
        cfg (DictConfig): the SFT config (``tokenizer``, ``dataset``, ``model``, ``loss``, ``on_too_long``).
        log (bool): log the counts of rows cut or dropped (rank 0).

    Returns:
        Tuple: ``(tokenizer, dataset)``.

    Raises:
        ConfigError: naming the key of a builder that fails, or rows too long with ``on_too_long: error``.
    """
    tokenizer = instantiate_dataset(cfg.tokenizer, "tokenizer")
    dataset, report = fit_sft_dataset(
        instantiate_dataset(cfg.dataset, "dataset", tokenizer), tokenizer=tokenizer,
        model_max_seq_len=model_limits(cfg.model).max_seq_len, on_too_long=cfg.on_too_long,
        ignore_index=cfg.loss.get("ignore_index", CROSS_ENTROPY_IGNORE_IDX))
    if report is not None and log:
        get_logger("INFO").info(report.message())
    return tokenizer, dataset


def build_sft_dataloader(cfg: DictConfig, dataset: Any, tokenizer: Any, runtime: Runtime, *,
                         ignore_index: int) -> Tuple[DataLoader, int, int]:
    """This rank's loader (a resumable sampler) and the run's length in optimizer steps.

    Args:
        cfg (DictConfig): the SFT config (``batch_size``, ``shuffle``, ``seed``, ``num_workers``,
            ``gradient_accumulation_steps``, ``epochs``, ``max_steps_per_epoch``, ``max_steps``).
        dataset (Any): the fitted dataset.
        tokenizer (Any): its ``pad_id`` pads the batches (0 when it has none).
        runtime (Runtime): this rank's share of the data.
        ignore_index (int): label of padded positions (the loss's).

    Returns:
        Tuple: ``(dataloader, steps_per_epoch, total_steps)``.

    Raises:
        ConfigError: when an epoch gives no optimizer step on a rank.
    """
    pad = getattr(tokenizer, "pad_id", 0)
    loader = build_dataloader(dataset, batch_size=cfg.batch_size, shuffle=cfg.shuffle, seed=cfg.seed,
                              rank=runtime.rank, world_size=runtime.world_size, padding_idx=0 if pad is None else pad,
                              ignore_index=ignore_index, num_workers=cfg.num_workers)
    ga = cfg.gradient_accumulation_steps
    steps_per_epoch = len(loader) // ga
    if cfg.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, cfg.max_steps_per_epoch)
    if steps_per_epoch == 0:
        raise ConfigError(
            f"config key 'batch_size': {len(dataset)} rows give {len(loader)} micro-batches of "
            f"{cfg.batch_size} per rank, fewer than gradient_accumulation_steps={ga}")
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    return loader, steps_per_epoch, total_steps


__all__ = ["build_sft_dataloader", "build_sft_dataset"]
