"""The GRPO recipes' prompts: the training and evaluation prompt sets, every prompt checked at start
against the columns the rewards read (``on_missing_answer``) and the sampler's length limit
(``on_too_long``), and which rows each step takes.

Example:
    >>> tokenizer, dataset, eval_dataset = build_prompt_datasets(cfg)
    >>> dataset = fit_prompts(dataset, "dataset", cfg, rewards=specs, max_seq_len=2048, max_new_tokens=256,
    ...                       log=True)
    >>> step_prompt_indices(0, num_rows=len(dataset), prompts_per_step=8, seed=0)
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig
from torchtune.utils import get_logger

from logitless.rl.preflight import check_reward_columns, fit_prompt_dataset
from logitless.rl.rewards import RewardSpec
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
                max_seq_len: Optional[int], max_new_tokens: int, log: bool) -> Optional[Any]:
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

    Returns:
        Optional[Any]: the dataset to sample from.

    Raises:
        ConfigError: a column a reward needs is absent; prompts without its value with
            ``on_missing_answer: error``; too-long prompts with ``on_too_long: error``; no prompt left.
    """
    if dataset is None:
        return None
    dataset, answers = check_reward_columns(dataset, rewards, on_missing_answer=cfg.on_missing_answer, key=key)
    dataset, lengths = fit_prompt_dataset(dataset, max_seq_len=max_seq_len, max_new_tokens=max_new_tokens,
                                          on_too_long=cfg.on_too_long, key=key)
    if log:
        logger = get_logger("INFO")
        if answers.missing:
            logger.warning(answers.message(key))
        logger.info(lengths.message(key))
    return dataset


def step_prompt_indices(step: int, *, num_rows: int, prompts_per_step: int, seed: int) -> List[int]:
    """Dataset rows of GRPO step ``step`` (0-based), in batch order.

    A fixed shuffle per epoch of the dataset, drawn from ``seed``: a resumed run needs only the step.

    Args:
        step (int): the step, 0-based.
        num_rows (int): rows in the dataset.
        prompts_per_step (int): prompts per step.
        seed (int): the run's seed.

    Returns:
        List[int]: ``prompts_per_step`` row indices.

    Example:
        >>> sorted(step_prompt_indices(0, num_rows=4, prompts_per_step=4, seed=0))
        [0, 1, 2, 3]
    """
    rows = []
    for idx in range(step * prompts_per_step, (step + 1) * prompts_per_step):
        epoch, pos = divmod(idx, num_rows)
        perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        rows.append(int(perm[pos]))
    return rows


__all__ = ["build_prompt_datasets", "fit_prompts", "step_prompt_indices"]
