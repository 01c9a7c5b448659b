"""GRPO checks that run before the model is built: the dataset columns the rewards read, and every
prompt's length against the model's ``max_seq_len`` (the ``generation:`` values are checked by
:class:`~logitless.generation.config.SamplerConfig`).

A reward function names the columns it needs as arguments (``math_correctness(prompts, completions,
answer, **kwargs)``): a dataset without one fails here, not at the first step after the model build
and the first generation. A prompt whose needed value is missing (None) or empty would score 0 on
every completion with no word: :func:`check_reward_columns` counts them at start and
``on_missing_answer`` drops them (counted in the log) or stops naming the first one.

A prompt of P tokens is sampled into a sequence of P + ``max_new_tokens`` tokens; one that does
not fit would fail at the first step that draws it (possibly many steps in). Here every prompt
of the dataset is checked at start, and ``on_too_long`` decides: drop it (counted in the log),
keep its end (``truncate``, as ``PromptDataset``'s ``overflow="truncate"`` does), or stop with an
error naming the row.

Example:
    >>> subset, report = fit_prompt_dataset(dataset, max_seq_len=512, max_new_tokens=64, on_too_long="drop")
    >>> report.message()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from logitless.rl.prompts import PROMPT_KEYS
from logitless.rl.rewards import COMPLETION_IDS, RewardSpec, reward_columns
from logitless.training.config import ConfigError
from logitless.training.preflight import ON_TOO_LONG, RowSubset

#: What a GRPO recipe does with a prompt whose answer (a column a reward needs) is missing or empty.
ON_MISSING_ANSWER = ("drop", "error")


def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, str) and not v.strip())


@dataclass
class AnswerReport:
    """What the answer check found, for the log at start.

    Attributes:
        rows (int): prompts in the dataset.
        kept (int): prompts sampled from.
        missing (int): prompts with a needed column None or empty.
        columns (Tuple[str, ...]): the columns the rewards need.
        first (Optional[Tuple[int, str, Any]]): the first such prompt (row, column, value).
        action (str): the ``on_missing_answer`` setting.
    """

    rows: int
    kept: int
    missing: int
    columns: Tuple[str, ...]
    first: Optional[Tuple[int, str, Any]]
    action: str

    def message(self, what: str = "dataset") -> str:
        """One line for the log."""
        if not self.missing:
            return f"{what}: every prompt has a value for {list(self.columns)}"
        i, col, v = self.first
        return (f"{what}: {self.missing} of {self.rows} prompts have no value for a column a reward needs "
                f"(first: row {i}, {col!r} = {v!r}); {self.rows - self.kept} dropped "
                f"(on_missing_answer={self.action!r})")


def check_reward_columns(dataset: Any, rewards: Sequence[RewardSpec], *, on_missing_answer: str,
                         key: str = "dataset", rollout_columns: Sequence[str] = (COMPLETION_IDS,)
                         ) -> Tuple[Any, AnswerReport]:
    """Checks that every reward finds its columns in ``dataset``, and counts the prompts whose needed
    values are missing or empty.

    Args:
        dataset: prompt rows ``{"prompt_tokens", "prompt", **columns}``.
        rewards (Sequence[RewardSpec]): the run's rewards (:func:`~logitless.rl.rewards.build_reward_specs`).
        on_missing_answer (str): ``"drop"`` (keep the other prompts, counted) or ``"error"``.
        key (str): the dataset's config key, for messages.
        rollout_columns (Sequence[str]): the keyword arguments the sampler adds to the dataset's
            columns (``PolicySampler.reward_columns``: the sampled token ids; with tool turns the
            conversation and the environment's info too).

    Returns:
        Tuple[Any, AnswerReport]: the dataset to sample from (the same object when nothing is dropped)
        and the report.

    Raises:
        ConfigError: a reward needs a column the dataset lacks, or cannot take one it has (no
            ``**kwargs``); a missing value with ``on_missing_answer="error"`` (naming the row, the column
            and the file); no prompt left.

    Example:
        >>> ds, report = check_reward_columns(ds, specs, on_missing_answer="drop")
        >>> report.message()
        'dataset: 2 of 44 prompts have no value for a column a reward needs (first: row 0, ...'
    """
    if on_missing_answer not in ON_MISSING_ANSWER:
        raise ConfigError(f"config key 'on_missing_answer': expected one of {list(ON_MISSING_ANSWER)}, "
                          f"got {on_missing_answer!r}")
    n = len(dataset)
    columns = [c for c in dataset[0] if c not in PROMPT_KEYS] if n else []
    given = columns + [c for c in rollout_columns if c not in columns]
    source = getattr(dataset, "source", "") or key
    needed: List[str] = []
    for i, spec in enumerate(rewards):
        required, accepted = reward_columns(spec.function)
        lacking = [c for c in required if c not in given]
        if lacking:
            raise ConfigError(f"config key 'rewards[{i}].function': {spec.name!r} reads the column {lacking[0]!r}, "
                              f"which {key} ({source}) does not have; its columns are {columns}. Expected a dataset "
                              f"with that column (prompt_dataset's answer_column exposes another column as 'answer')")
        extra = [c for c in given if accepted is not None and c not in accepted]
        if extra:
            raise ConfigError(f"config key 'rewards[{i}].function': {spec.name!r} is given every column of {key} and "
                              f"{', '.join(map(repr, rollout_columns))} as keyword arguments, but takes none named {extra[0]!r}; expected a "
                              f"signature ending in **kwargs (f(prompts, completions, "
                              f"{', '.join(required + ('**kwargs',))}))")
        needed += [c for c in required if c not in needed and c in columns]
    kept: List[int] = []
    first: Optional[Tuple[int, str, Any]] = None
    for i in range(n):
        row = dataset[i]
        blank = next((c for c in needed if _blank(row.get(c))), None)
        if blank is None:
            kept.append(i)
        elif first is None:
            first = (i, blank, row.get(blank))
    report = AnswerReport(n, len(kept), n - len(kept), tuple(needed), first, on_missing_answer)
    if first is not None and on_missing_answer == "error":
        i, col, v = first
        raise ConfigError(f"config key 'on_missing_answer': 'error', and {key} ({source}) row {i} has {col!r} = {v!r}; "
                          f"{report.missing} of {n} prompts have no value for {list(needed)}, which the rewards need "
                          f"(every completion would score 0). Expected a value in every row: fix the data, or set "
                          f"on_missing_answer=drop")
    if not kept:
        raise ConfigError(f"config key {key!r}: no prompt left to sample: {report.message(key)}. Expected at least "
                          f"one prompt with a value for {list(needed)}")
    if len(kept) == n:
        return dataset, report
    return RowSubset(dataset, kept), report


@dataclass
class PromptReport:
    """What the prompt-length check found, for the log at start.

    Attributes:
        rows (int): prompts in the dataset.
        kept (int): prompts sampled from.
        too_long (int): prompts with ``P + max_new_tokens > max_seq_len``.
        truncated (int): too-long prompts kept, cut from the left.
        limit (int): the model's ``max_seq_len`` (or ``generation.max_cache_len`` when smaller).
        max_new_tokens (int): completion length.
        dataset_skipped (int): prompts the dataset itself dropped (``max_prompt_tokens``, ``overflow: skip``).
        dataset_truncated (int): prompts the dataset itself cut (``overflow: truncate``).
        action (str): the ``on_too_long`` setting.
    """

    rows: int
    kept: int
    too_long: int
    truncated: int
    limit: Optional[int]
    max_new_tokens: int
    dataset_skipped: int
    dataset_truncated: int
    action: str

    def message(self, what: str = "dataset") -> str:
        """One line for the log."""
        own = (f"; the dataset itself dropped {self.dataset_skipped} and truncated {self.dataset_truncated} "
               f"prompts over its max_prompt_tokens")
        if self.limit is None:
            return f"{what}: {self.rows} prompts, the model's max_seq_len is unknown{own}"
        return (f"{what}: {self.kept} of {self.rows} prompts kept; {self.too_long} longer than "
                f"{self.limit - self.max_new_tokens} tokens (max_seq_len {self.limit} - max_new_tokens "
                f"{self.max_new_tokens}), {self.truncated} of them truncated, {self.rows - self.kept} dropped; "
                f"on_too_long={self.action!r}{own}")


class PromptSubset(RowSubset):
    """The prompts ``indices`` of a prompt dataset, each cut from the left to ``max_len`` tokens.

    Args:
        dataset (Dataset): rows ``{"prompt_tokens", "prompt", ...}``.
        indices (Sequence[int]): rows kept, in order.
        max_len (Optional[int]): keep the last ``max_len`` prompt tokens (where the question and the
            generation header are).
    """

    def cut(self, row: Dict[str, Any]) -> Dict[str, Any]:
        if len(row["prompt_tokens"]) <= self.max_len:
            return row
        return {**row, "prompt_tokens": list(row["prompt_tokens"])[-self.max_len:]}


def fit_prompt_dataset(dataset: Any, *, max_seq_len: Optional[int], max_new_tokens: int, on_too_long: str,
                       key: str = "dataset") -> Tuple[Any, PromptReport]:
    """Checks every prompt against ``max_seq_len - max_new_tokens`` and applies ``on_too_long``.

    Args:
        dataset: rows with ``prompt_tokens`` (e.g. :class:`logitless.rl.prompts.PromptDataset`).
        max_seq_len (Optional[int]): the longest sequence the sampler can run (None: unknown).
        max_new_tokens (int): completion length.
        on_too_long (str): ``"drop" | "truncate" | "error"``.
        key (str): the dataset's config key, for messages.

    Returns:
        Tuple[Any, PromptReport]: the dataset to sample from (the same object when nothing changes)
        and the report.

    Raises:
        ConfigError: a too-long prompt with ``on_too_long="error"`` (naming the row, its length and
        the limit), ``max_new_tokens`` that leaves no room for a prompt, or no prompt left.

    Example:
        >>> ds, report = fit_prompt_dataset(ds, max_seq_len=1024, max_new_tokens=256, on_too_long="drop")
    """
    if on_too_long not in ON_TOO_LONG:
        raise ConfigError(f"config key 'on_too_long': expected one of {list(ON_TOO_LONG)}, got {on_too_long!r}")
    n = len(dataset)
    own = (int(getattr(dataset, "num_skipped", 0)), int(getattr(dataset, "num_truncated", 0)))
    if max_seq_len is None:
        return dataset, PromptReport(n, n, 0, 0, None, max_new_tokens, *own, on_too_long)
    room = max_seq_len - max_new_tokens
    if room < 1:
        raise ConfigError(f"config key 'generation.max_new_tokens': {max_new_tokens} leaves no room for a prompt "
                          f"within the model's max_seq_len={max_seq_len}; expected at most {max_seq_len - 1}")
    kept: List[int] = []
    too_long = 0
    first: Optional[Tuple[int, int]] = None
    for i in range(n):
        length = len(dataset[i]["prompt_tokens"])
        if length > room:
            too_long += 1
            first = first or (i, length)
            if on_too_long != "truncate":
                continue
        kept.append(i)
    if on_too_long == "error" and first is not None:
        i, length = first
        raise ConfigError(f"config key 'on_too_long': 'error', and {key} prompt {i} has {length} tokens: with "
                          f"generation.max_new_tokens={max_new_tokens} that is {length + max_new_tokens} > the "
                          f"model's max_seq_len={max_seq_len}; {too_long} of {n} prompts are too long. Expected "
                          f"prompts of at most {room} tokens: shorten them (the dataset's max_prompt_tokens), "
                          f"lower max_new_tokens, or set on_too_long to drop or truncate")
    truncated = too_long if on_too_long == "truncate" else 0
    report = PromptReport(n, len(kept), too_long, truncated, max_seq_len, max_new_tokens, *own, on_too_long)
    if not kept:
        raise ConfigError(f"config key {key!r}: no prompt left to sample: {report.message(key)}. Expected at least "
                          f"one prompt of at most {room} tokens")
    if too_long == 0:
        return dataset, report
    return PromptSubset(dataset, kept, room if truncated else None), report


__all__ = ["ON_MISSING_ANSWER", "AnswerReport", "PromptReport", "PromptSubset", "check_reward_columns",
           "fit_prompt_dataset"]
