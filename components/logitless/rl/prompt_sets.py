"""The GRPO recipes' prompts: the training and evaluation prompt sets, every prompt checked against
the sampler's length limit at start, and the run's prompt stream (which rows each step takes).

Example:
    >>> tokenizer, dataset, eval_dataset = build_prompt_datasets(cfg)
    >>> dataset = fit_prompts(dataset, "dataset", cfg, max_seq_len=2048, max_new_tokens=256, log=True)
    >>> step_prompt_indices(0, num_rows=len(dataset), prompts_per_step=8, seed=0)
    >>> prompt_stream_indices(16, 8, num_rows=len(dataset), seed=0)  # the prompt stream's positions 16-23
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from omegaconf import DictConfig
from torchtune.utils import get_logger

from logitless.rl.preflight import fit_prompt_dataset
from logitless.rl.rewards import COMPLETION_IDS
from logitless.training.config import ConfigError
from logitless.training.preflight import instantiate_dataset


def build_prompt_datasets(cfg: DictConfig) -> Tuple[Any, Any, Optional[Any]]:
    """The tokenizer, the training prompts and the evaluation prompts (None without evaluation).

    Args:
        cfg (DictConfig): the GRPO config (``tokenizer``, ``dataset``, ``eval_dataset``,
            ``eval_every_n_steps``).

    Returns:
        Tuple: ``(tokenizer, dataset, eval_dataset)``.

    Raises:
        ConfigError: naming the key of a builder that fails.
    """
    tokenizer = instantiate_dataset(cfg.tokenizer, "tokenizer")
    dataset = instantiate_dataset(cfg.dataset, "dataset", tokenizer)
    eval_dataset = (instantiate_dataset(cfg.eval_dataset, "eval_dataset", tokenizer)
                    if cfg.eval_dataset is not None and cfg.eval_every_n_steps is not None else None)
    return tokenizer, dataset, eval_dataset


def fit_prompts(dataset: Optional[Any], key: str, cfg: DictConfig, *, max_seq_len: Optional[int],
                max_new_tokens: int, log: bool) -> Optional[Any]:
    """``dataset`` with every prompt fitted to ``max_seq_len - max_new_tokens`` (``on_too_long``).

    Args:
        dataset (Optional[Any]): prompt rows (``prompt_tokens``); None (no evaluation set) is returned as is.
        key (str): its config key, for messages.
        cfg (DictConfig): the config (``on_too_long``).
        max_seq_len (Optional[int]): the longest sequence the sampler runs (None: unknown).
        max_new_tokens (int): completion length.
        log (bool): log the counts (rank 0).

    Returns:
        Optional[Any]: the dataset to sample from.

    Raises:
        ConfigError: too-long prompts with ``on_too_long: error``, or no prompt left.
    """
    if dataset is None:
        return None
    if len(dataset) and COMPLETION_IDS in dataset[0]:
        raise ConfigError(f"config key {key!r}: its rows have a column {COMPLETION_IDS!r}, the name under which the "
                          f"reward functions receive the sampled token ids; rename the column")
    dataset, report = fit_prompt_dataset(dataset, max_seq_len=max_seq_len, max_new_tokens=max_new_tokens,
                                         on_too_long=cfg.on_too_long, key=key)
    if log:
        get_logger("INFO").info(report.message(key))
    return dataset


def prompt_stream_indices(start: int, count: int, *, num_rows: int, seed: int) -> List[int]:
    """Dataset rows at positions ``start .. start + count - 1`` of the run's prompt stream.

    The stream is the dataset in a fixed shuffle per epoch, drawn from ``seed``, epoch after epoch:
    its position (how many prompts the run has drawn) is all a resumed run needs. A step without
    dynamic sampling draws ``prompts_per_step`` prompts, so step ``s`` starts at
    ``s * prompts_per_step``; dynamic sampling draws its further rounds from the same stream.

    Args:
        start (int): the first position (0-based).
        count (int): how many prompts.
        num_rows (int): rows in the dataset.
        seed (int): the run's seed.

    Returns:
        List[int]: ``count`` row indices, in stream order.

    Example:
        >>> sorted(prompt_stream_indices(4, 4, num_rows=4, seed=0))  # the second epoch, reshuffled
        [0, 1, 2, 3]
    """
    rows, perms = [], {}
    for idx in range(start, start + count):
        epoch, pos = divmod(idx, num_rows)
        if epoch not in perms:
            perms[epoch] = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        rows.append(int(perms[epoch][pos]))
    return rows


def step_prompt_indices(step: int, *, num_rows: int, prompts_per_step: int, seed: int) -> List[int]:
    """Dataset rows of GRPO step ``step`` (0-based) without dynamic sampling, in batch order:
    :func:`prompt_stream_indices` from ``step * prompts_per_step``.

    Example:
        >>> sorted(step_prompt_indices(0, num_rows=4, prompts_per_step=4, seed=0))
        [0, 1, 2, 3]
    """
    return prompt_stream_indices(step * prompts_per_step, prompts_per_step, num_rows=num_rows, seed=seed)


__all__ = ["build_prompt_datasets", "fit_prompts", "prompt_stream_indices", "step_prompt_indices"]
