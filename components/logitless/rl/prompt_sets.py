"""The GRPO recipes' prompts: the training and evaluation prompt sets, every prompt checked at start
against the columns the rewards read (``on_missing_answer``) and the sampler's length limit
(``on_too_long``), and the run's prompt stream (which rows each step takes).

Example:
    >>> tokenizer, dataset, eval_dataset = build_prompt_datasets(cfg)
    >>> dataset = fit_prompts(dataset, "dataset", cfg, rewards=specs, max_seq_len=2048, max_new_tokens=256,
    ...                       log=True)
    >>> step_prompt_indices(0, num_rows=len(dataset), prompts_per_step=8, seed=0)
    >>> prompt_stream_indices(16, 8, num_rows=len(dataset), seed=0)  # the prompt stream's positions 16-23
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig
from torchtune.utils import get_logger

from logitless.rl.preflight import check_reward_columns, fit_prompt_dataset
from logitless.rl.rewards import COMPLETION_IDS, RewardSpec
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


def fit_prompts(dataset: Optional[Any], key: str, cfg: DictConfig, *, rewards: Sequence[RewardSpec],
                max_seq_len: Optional[int], max_new_tokens: int, log: bool,
                rollout_columns: Sequence[str] = (COMPLETION_IDS,)) -> Optional[Any]:
    """``dataset`` with every prompt holding the values the rewards read (``on_missing_answer``) and
    fitted to ``max_seq_len - max_new_tokens`` (``on_too_long``).

    Args:
        dataset (Optional[Any]): prompt rows (``prompt_tokens``); None (no evaluation set) is returned as is.
        key (str): its config key, for messages.
        cfg (DictConfig): the config (``on_missing_answer``, ``on_too_long``).
        rewards (Sequence[RewardSpec]): the run's rewards (their signatures name the columns they read).
        max_seq_len (Optional[int]): the longest sequence the sampler runs (None: unknown).
        max_new_tokens (int): completion length.
        log (bool): log the counts (rank 0).
        rollout_columns (Sequence[str]): what the sampler adds to the rewards' keyword arguments
            (``PolicySampler.reward_columns``).

    Returns:
        Optional[Any]: the dataset to sample from.

    Raises:
        ConfigError: a column a reward needs is absent; prompts without its value with
            ``on_missing_answer: error``; too-long prompts with ``on_too_long: error``; no prompt left.
    """
    if dataset is None:
        return None
    if len(dataset) and COMPLETION_IDS in dataset[0]:
        raise ConfigError(f"config key {key!r}: its rows have a column {COMPLETION_IDS!r}, the name under which the "
                          f"reward functions receive the sampled token ids; rename the column")
    dataset, answers = check_reward_columns(dataset, rewards, on_missing_answer=cfg.on_missing_answer, key=key,
                                            rollout_columns=rollout_columns)
    dataset, lengths = fit_prompt_dataset(dataset, max_seq_len=max_seq_len, max_new_tokens=max_new_tokens,
                                          on_too_long=cfg.on_too_long, key=key)
    if log:
        logger = get_logger("INFO")
        if answers.missing:
            logger.warning(answers.message(key))
        logger.info(lengths.message(key))
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
